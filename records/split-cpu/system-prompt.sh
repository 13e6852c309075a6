#!/bin/bash
# The CPU demo's split against its alternatives on the shared-system-prompt workload of the
# L3 issue (12 clients x 6 rounds, a 2,048-token first turn, a 512-token system prompt),
# the file L3 on tmpfs (2026-12-07). Run from the repository root:
# bash records/split-cpu/system-prompt.sh OUT
O=${1:-/tmp/split-system}; mkdir -p $O
S='L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)'
rm -rf /dev/shm/kvsplit
python -m kvtier demo --no-progress --no-plot --setups "$S" --l3-config '{"root":"/dev/shm/kvsplit"}' \
  --clients 12 --rounds 6 --first-tokens 2048 --system-tokens 512 --out $O/sys > $O/sys.log 2>&1
echo "rc=$?"; rm -rf /dev/shm/kvsplit
grep -E "^\| (L1|ideal)" $O/sys.log | head -5 | cut -d'|' -f2,3,8,12,17; grep "Cost-aware split" $O/sys.log
