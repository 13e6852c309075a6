#!/bin/bash
# Fourth device call (2026-12-06): the recompute fit over a window with a knee, loads that
# overlap the prefill's fixed cost and a 2% margin before skipping (this commit), against the
# code before it (wheels in .whl/old, built from its parent), on the same machine. Wheels as
# in call-1.sh. From the repository root: B=540 bash records/demo-engines/call-4.sh
#  1. 16 conversations x 12 rounds at 105% of L1 only's capacity, shm L3 in place: before, after;
#  2. multi-turn with the file L3 on tmpfs: the split against loading every hit and none.
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kv-old .whl/old/kvtier_*.whl .whl/isal*.whl .whl/transformers*.whl || exit 1
load(){ # name, python path
  el $1; rm -rf /dev/shm/kva
  PYTHONPATH=$2 timeout $(lim 190) $D --clients 16 --rounds 12 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config '{"root":"/dev/shm/kva","capacity_bytes":25769803776}' --loads 1.05 --out $R/$1 > $R/$1.log 2>&1; echo rc=$?; rm -rf /dev/shm/kva
  grep -E "capacity|^\| (serial|1[0-9][0-9]%) +\| L1\+" $R/$1.log | cut -d'|' -f1-6,9,14-18 | head -5
  grep -E "^\| L1\+L2\+L3 .*\| [0-9]+/[0-9]+ " $R/$1.log | cut -d'|' -f2,12 | head -2; }
load load-after /tmp/kv
load load-before /tmp/kv-old
el mt-file
rm -rf /dev/shm/kvf; PYTHONPATH=/tmp/kv timeout $(lim 90) $D --setups 'L1 only,L1+L2,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)' --l3-config '{"root":"/dev/shm/kvf","io_threads":8}' --out $R/mt-file > $R/mt-file.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
grep -E "^\| (L1|ideal)" $R/mt-file.log | cut -d'|' -f2,3,8,12 | head -5; grep "Cost-aware split" $R/mt-file.log
el done
