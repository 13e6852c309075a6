#!/bin/bash
# How the file store should cut a batch of small pages into calls on tmpfs once a 1 MiB page
# is one checksum call (format 4): a 64-page batch of 1 MiB pages is 8 calls of 8 MiB
# (io_call_bytes) for 16 I/O threads, and the calls in flight go to 16 write lanes (a file
# each: tmpfs serialises writes to one file). store_writes.py (one caller) with smaller calls,
# with and without more lanes; then `kvtier bench store` (2 callers) at 8 and 4 MiB calls.
# From the repository root with the wheels in .whl: bash records/open-targets/call-4.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
W=records/open-targets/store_writes.py
w(){ timeout 40 python3 $W /dev/shm/kvw "$@" 2>&1 | tee -a $R/writes.log; }
el writes
w 1 16 1024 0
w 1 16 1024 0 '{"io_call_bytes": 4194304}'
w 1 16 1024 0 '{"io_call_bytes": 4194304, "write_lanes": 32}'
w 1 16 1024 0 '{"io_call_bytes": 2097152, "write_lanes": 32}'
w 1 16 1024 0 '{"io_call_bytes": 2097152, "write_lanes": 64}'
w 1 16 1024 0 '{"write_lanes": 32}'
w 2 16 512 0 '{"io_call_bytes": 4194304, "write_lanes": 32}'
for c in 8M 4M; do
  el bench-io-call-$c
  timeout $(lim 80) $K bench store --dir /dev/shm/kvb --page-sizes 1M,2M --total 1G \
    --io-call $c --json $R/store-call-$c.json > $R/store-call-$c.log 2>&1; echo rc=$?
  grep -E "^\| [0-9]" $R/store-call-$c.log | cut -d'|' -f2,4,5,7,8
done
rm -rf /dev/shm/kvb /dev/shm/kvw; cp $R/writes.log $R/store-call-* $OUT/ 2>/dev/null; el done
