#!/bin/bash
# The CPU demo's split against its alternatives after the recompute fit's knee and margin
# (2026-12-06): multi-turn, long context and the trace, each one run with every setup.
# Run from the repository root: bash records/split-cpu/after-fit.sh OUT
O=${1:-/tmp/split-after-fit}; mkdir -p $O
S='L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)'
for w in mt long trace; do
  case $w in mt) A="";; long) A="--workload long --clients 4 --rounds 4";;
    trace) A="--workload trace --trace ../shared/data/mooncake_synthetic_trace.jsonl";; esac
  rm -rf /dev/shm/kvsplit
  python -m kvtier demo --no-progress --no-plot --setups "$S" --l3-config '{"root":"/dev/shm/kvsplit"}' \
    $A --out $O/$w > $O/$w.log 2>&1; echo "$w rc=$?"
  grep -E "^\| (L1|ideal)" $O/$w.log | head -5 | cut -d'|' -f2,3,8,12,17; grep "Cost-aware split" $O/$w.log
done
rm -rf /dev/shm/kvsplit
