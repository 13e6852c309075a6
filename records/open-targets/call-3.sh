#!/bin/bash
# The file store's writes with layer groups of at least 1 MiB (group_bytes, format 4) against
# format 3's split (min(8, layers) groups: group_bytes 0), same machine, same run: batch_set /
# batch_get of 1, 2 and 8 MiB pages at 16 I/O threads (store_writes.py), then
# `kvtier bench store` on /dev/shm (1-8 MiB pages against the best raw mode) with the new
# default and, for 1 and 2 MiB pages, with group_bytes 0.
# From the repository root with the wheels in .whl: bash records/open-targets/call-3.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
W=records/open-targets/store_writes.py
w(){ timeout 40 python3 $W /dev/shm/kvw "$@" 2>&1 | tee -a $R/writes.log; }
el writes
for a in "1 1024" "2 512" "8 128"; do
  set -- $a; w $1 16 $2 0 '{"group_bytes": 0}'; w $1 16 $2 0
done
el bench-default
timeout $(lim 150) $K bench store --dir /dev/shm/kvb --page-sizes 1M,2M,4M,8M --total 1G \
  --json $R/store.json > $R/store.log 2>&1; echo rc=$?; grep -E "^\| |group_bytes|ratios|bitwise" $R/store.log
el bench-format3
timeout $(lim 100) $K bench store --dir /dev/shm/kvb --page-sizes 1M,2M --total 1G \
  --group-bytes 0 --json $R/store-g0.json > $R/store-g0.log 2>&1; echo rc=$?; grep -E "^\| |group_bytes|bitwise" $R/store-g0.log
rm -rf /dev/shm/kvw /dev/shm/kvb; cp $R/writes.log $R/store*.json $R/store*.log $OUT/ 2>/dev/null; el done
