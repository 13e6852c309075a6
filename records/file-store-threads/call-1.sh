# The probe of what serialises the file store's threads, on the device host's tmpfs, twice.
# Run from the repository root with the wheels in .whl: B=240 bash records/file-store-threads/call-1.sh
source records/demo-stream/common.sh
for i in 1 2; do
  el probe-$i
  rm -rf /dev/shm/kvprobe
  timeout $(lim 200) python3 records/file-store-threads/probe.py /dev/shm/kvprobe $R/probe-$i.json > $R/probe-$i.log 2>&1; echo rc=$?
  cat $R/probe-$i.log
done
rm -rf /dev/shm/kvprobe
el done
