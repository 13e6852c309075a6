#!/bin/bash
# Loads that start as their L3 batches land (`l3_load_while_reading`, 2026-12-07): the fetch
# reads its L3 pages in the plan that loads them, the L2 hit loading at once and each batch
# of `l3_batch_pages` loading as it lands, against the fetch that waits for the whole read
# and then loads beside the prefill (`l3_load_while_reading = false`), interleaved; the
# same with 16 I/O threads in the file store; and the ceiling of a host-memory tier: an L2
# that holds every page (L1+L2 with --l2-pages above the workload's distinct pages).
# From the repository root with the wheels in .whl: B=560 bash records/demo-load-while-reading/call-1.sh
rm -rf /tmp/res; . records/demo-stream/common.sh
printf '[cache]\nl3_load_while_reading = false\n' > /tmp/after.toml
FT16='{"root":"/dev/shm/kvf","io_threads":16}'
v(){ # name, workload args, config file or "", l3 config, seconds, [extra demo args], [setups]
  el $1
  if [ -n "$3" ]; then export KVTIER_CONFIG=$3; else unset KVTIER_CONFIG; fi
  rm -rf /dev/shm/kvf; timeout $(lim $5) $D $2 $6 --setups "${7:-$S}" --l3-config "$4" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; unset KVTIER_CONFIG; tab $R/$1.log
}
v mt-new "" "" "$FT" 40
v mt-old "" /tmp/after.toml "$FT" 40
v mt-new16 "" "" "$FT16" 40
v mt-l2all "" "" "$FT" 40 "--l2-pages 400" 'L1 only,L1+L2,ideal (all in L1)'
v long-new "$L" "" "$FT" 80
v long-old "$L" /tmp/after.toml "$FT" 80
v long-new16 "$L" "" "$FT16" 80
v long-l2all "$L" "" "$FT" 80 "--l2-pages 1500" 'L1 only,L1+L2,ideal (all in L1)'
el done
