#!/bin/bash
# How large the file store's calls into tmpfs should be once a 1 MiB page is one checksum call
# (format 4): `kvtier bench store` on /dev/shm, 1 and 2 MiB pages, io_call_bytes 8 MiB (the
# default: a 64-page batch of 1 MiB pages is 8 calls, for 16 I/O threads), 4, 2 and 1 MiB.
# From the repository root with the wheels in .whl: bash records/open-targets/call-4.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
for c in 8M 4M 2M 1M; do
  el io-call-$c
  timeout $(lim 80) $K bench store --dir /dev/shm/kvb --page-sizes 1M,2M --total 1G \
    --io-call $c --json $R/store-call-$c.json > $R/store-call-$c.log 2>&1; echo rc=$?
  grep -E "^\| [0-9]" $R/store-call-$c.log | cut -d'|' -f2,4,5,7,8
done
rm -rf /dev/shm/kvb; cp $R/store-call-* $OUT/ 2>/dev/null; el done
