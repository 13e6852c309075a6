#!/bin/bash
# The open targets of the L3 and serving issues on a lent GPU (an H200 asked for) with kvtier's defaults (2026-12-07):
# the `file` store on tmpfs at 1-8 MiB pages against the raw modes of the same run
# (`kvtier bench store`, default threads); multi-turn under load at 105% of L1 only's
# capacity, 16 clients x 12 rounds (L1 only, L1+L2+L3, the ideal), the L3 a `chain` of a 16
# GiB `shm` arena before the file L3 on tmpfs with 8 staging helpers (records/l3-staging.md);
# long context with the file L3 on tmpfs alone, the cost-aware split against loading every hit and
# against L1+L2 (nothing from L3), beside the ideal.
# (As run, the store step had --total 2G and 90 s, ran out, and was run again as here, right
# after the rest, on the same machine.)
# From the repository root with the wheels in .whl: B=570 bash records/open-targets/call-1.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
F='{"root":"/dev/shm/kvf"}'; FILE="$F"     # the file store's own thread count (16 here)
el store
rm -rf /dev/shm/kvb; mkdir -p /dev/shm/kvb
timeout $(lim 200) $K bench store --dir /dev/shm/kvb --page-sizes 1M,2M,4M,8M --total 1G \
  --json $R/store.json > $R/store.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
grep -E "^\|" $R/store.log | tail -12
el load
rm -rf /dev/shm/kvf /dev/shm/kvs-*; timeout $(lim 290) $D --clients 16 --rounds 12 --loads 1.05 \
  --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 17179869184 8)" \
  --out $R/load > $R/load.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf /dev/shm/kvs-*
grep -E "^\| (serial|105%) " $R/load.log | cut -d'|' -f1-9,14-18
grep -A9 "Where a request" $R/load.log | tail -6
el long
rm -rf /dev/shm/kvf; timeout $(lim 170) $D $L --setups 'L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)' \
  --l3-config "$F" --out $R/long > $R/long.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
grep -E "^\| (L1|ideal)" $R/long.log | head -12
el done
