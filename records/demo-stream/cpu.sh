#!/bin/bash
# The CPU default demo (small model), file L3 on tmpfs, streamed against whole L3 reads,
# alternated, two rounds each. Run from the repository root: bash records/demo-stream/cpu.sh OUT
O=${1:-/tmp/demo-stream-cpu}; mkdir -p $O
printf '[cache]\nl3_stream_layers = false\n' > $O/whole.toml
S='L1 only,L1+L2,L1+L2+L3,ideal (all in L1)'
for i in 1 2; do
  for v in stream whole; do
    [ $v = whole ] && export KVTIER_CONFIG=$O/whole.toml || unset KVTIER_CONFIG
    rm -rf /dev/shm/kvf-demo
    python -m kvtier demo --no-progress --no-plot --setups "$S" \
      --l3-config '{"root":"/dev/shm/kvf-demo"}' --out $O/$v-$i > $O/$v-$i.log 2>&1
    echo "$v-$i rc=$?"
    grep -E "^\| (L1\+L2\+L3|ideal|L1 only|L1\+L2) " $O/$v-$i.log | head -4 | cut -d'|' -f2,3,7,10,12
    grep -E "^\| L1\+L2\+L3 " $O/$v-$i.log | sed -n 3p | cut -d'|' -f2,5,6
  done
done
rm -rf /dev/shm/kvf-demo
