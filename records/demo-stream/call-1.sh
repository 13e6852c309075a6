#!/bin/bash
# One device call. Wheels: `pip wheel --no-deps packages/core packages/tools
# packages/nvidia-tma -w .whl` plus transformers 5.24 and isal wheels in .whl/.
# Run from the repository root: B=560 bash records/demo-stream/call-1.sh (S=... to change the setups)
#  (written 2026-12-06; ran the same day on an H100: records/demo-stream.md)
#  1. 8B multi-turn, file L3 on tmpfs (8 I/O threads): L3 reads streamed layer group by layer
#     group (the default), then the same with l3_stream_layers = false, in the same call;
#  2. the same pair on the long-context workload;
#  3. the file L3 on the host disk, streamed, against L1+L2;
#  4. (after the multi-turn pair) the file store on /dev/shm against its raw modes, 8 I/O threads.
. records/demo-stream/common.sh   # (ran on 7c42447, where l3_stream_layers defaulted to true)
S=${S:-'L1 only,L1+L2+L3,ideal (all in L1)'}
tab(){ grep -A6 "^| setup             | hit rate" $1 | head -6 | cut -d'|' -f2,3,7,10,12; grep "L3 read (" -A5 $1 | cut -d'|' -f2,4,5 | head -6; grep -i "ideal\|split" $1 | head -3; }
for w in mt long; do
  [ $w = mt ] && W="" || W="--workload long --clients 4 --rounds 4"
  for v in stream whole; do
    el $w-$v
    [ $v = whole ] && export KVTIER_CONFIG=/tmp/whole.toml || unset KVTIER_CONFIG
    rm -rf /dev/shm/kvf; timeout $(lim 95) $D $W --setups "$S" --l3-config "$FT" --out $R/$w-$v > $R/$w-$v.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
    tab $R/$w-$v.log
  done
  if [ $w = mt ]; then
    el store-shm
    timeout $(lim 90) $K bench store --dir /dev/shm/kvb --total 1G --page-sizes 1M,2M,4M,8M --repeat 2 --threads 8 --json $R/store-shm.json > $R/store-shm.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
    tail -12 $R/store-shm.log
  fi
done
unset KVTIER_CONFIG
el mt-disk
timeout $(lim 100) $D --setups 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' --l3-config '{"root":"/tmp/kvd"}' --out $R/mt-disk > $R/mt-disk.log 2>&1; echo rc=$?; rm -rf /tmp/kvd
tab $R/mt-disk.log
el done
