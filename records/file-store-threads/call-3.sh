# Third device call: 16 conversations x 12 rounds at 105% of L1 only's capacity with the file L3
# on tmpfs, its reads prefetched during the queue wait beside the running prefill: 2 I/O threads
# with 8 MiB calls (the default now), then 8 I/O threads with 512 KiB calls (the code before;
# call 2 ran 8 threads with 8 MiB calls). From the repository root with the wheels in .whl:
# B=480 bash records/file-store-threads/call-3.sh
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
load(){ # name, io_threads, io_call_bytes
  el $1; rm -rf /dev/shm/kvf
  timeout $(lim 230) $D --clients 16 --rounds 12 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "{\"root\":\"/dev/shm/kvf\",\"io_threads\":$2,\"io_call_bytes\":$3}" --loads 1.05 --out $R/$1 > $R/$1.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
  grep -E "^\| (serial|1[0-9][0-9]%) +\| (L1\+|ideal)" $R/$1.log | cut -d'|' -f1-6,9,14-18 | head -6; }
load load-t2-8m 2 8388608
load load-t8-512k 8 524288
el done
