# Second device call: a launch-bound loop beside store reads (threads by piece size, processes,
# torch copies); the 8B multi-turn demo with the file L3 on tmpfs, calls of 512 KiB (the code
# before) and 8 MiB (io_call_bytes, the default now); then 16 conversations x 12 rounds at 105%
# of L1 only's capacity with that file L3 (8 MiB calls), its reads prefetched during the queue
# wait. From the repository root with the wheels in .whl: B=540 bash records/file-store-threads/call-2.sh
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
el launch-probe
rm -rf /dev/shm/lp; DEVICE=cuda ITERS=200 PAGES=64 timeout $(lim 150) python3 records/file-store-threads/launch_probe.py /dev/shm/lp $R/launch.json > $R/launch.log 2>&1; echo rc=$?; rm -rf /dev/shm/lp
grep readers $R/launch.log
mt(){ # name, io_call_bytes
  el $1; rm -rf /dev/shm/kvf
  timeout $(lim 100) $D --setups 'L1+L2+L3,ideal (all in L1)' --l3-config "{\"root\":\"/dev/shm/kvf\",\"io_threads\":8,\"io_call_bytes\":$2}" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
  grep -E "^\| (L1|ideal)" $R/$1.log | cut -d'|' -f2,8,12 | head -2; grep -E "^\| L1\+L2\+L3 " $R/$1.log | sed -n 3p | cut -d'|' -f2,4,5,6,9; }
mt mt-512k 524288; mt mt-8m 8388608
load(){ # name, io_call_bytes
  el $1; rm -rf /dev/shm/kvf
  timeout $(lim 240) $D --clients 16 --rounds 12 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "{\"root\":\"/dev/shm/kvf\",\"io_threads\":8,\"io_call_bytes\":$2}" --loads 1.05 --out $R/$1 > $R/$1.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
  grep -E "capacity|^\| (serial|1[0-9][0-9]%) +\| L1\+" $R/$1.log | cut -d'|' -f1-6,9,14-18 | head -5; }
load load-8m 8388608
el done
