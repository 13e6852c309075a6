#!/bin/bash
# One device call (2026-12-06). Wheels: `pip wheel --no-deps packages/core packages/tools
# packages/nvidia-tma -w .whl` plus transformers 5.24 and isal wheels in .whl/.
# Run from the repository root (it ran with B=420, 349 s): B=420 bash records/demo-h100-load/call-1.sh
#  0. what a prefill of the demo model costs by length, and how much is host time;
#  1. the store benches on the host's tmpfs: file (issue 39) and shm (issue 40);
#  2. 8B multi-turn with the shm L3, and the same with an L2 that holds every page (the host
#     DRAM ceiling of any tier below L1: issue 40's 90%-of-ideal target);
#  3. 8B multi-turn under load with more conversations, so that the queue builds (issue 41);
#  4. the file L3 on tmpfs with 8 I/O threads (issue 39), if time is left.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s); R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kv .whl/*.whl || exit 1
export PYTHONPATH=/tmp/kv
el(){ echo "== $(( $(date +%s)-T0 ))s $*"; (cd /tmp && tar czf $OUT/res.tgz --exclude='*.png' res); }
lim(){ local l=$(( ${B:-540} - ($(date +%s)-T0) )); [ $l -gt $1 ] && l=$1; [ $l -lt 1 ] && l=1; echo $l; }
{ nvidia-smi -L; free -g; nproc; df -h /dev/shm; } > $R/machine.txt 2>&1
K="python3 -m kvtier"
D="$K demo --device cuda --model-size 8b --dtype bfloat16 --no-progress"
tab(){ grep -A7 "^| setup             | hit rate" $1 | head -7 | cut -d'|' -f2,3,7,10,12; grep "L3 read (" -A6 $1 | cut -d'|' -f2,4,5 | head -7; }
el floor
timeout $(lim 60) python3 records/demo-h100-load/prefill_floor.py > $R/prefill-floor.log 2>&1; echo rc=$?; cat $R/prefill-floor.log | tail -11
el store-shm
timeout $(lim 45) $K bench store --store shm --page-sizes 1M,2M,4M,8M --total 1G --repeat 3 --json $R/store-shm.json > $R/store-shm.log 2>&1; echo rc=$?
tail -7 $R/store-shm.log
el mt-shm
rm -rf /dev/shm/kva; timeout $(lim 90) $D --no-plot --l3-store shm --l3-config '{"root":"/dev/shm/kva","capacity_bytes":8589934592}' --out $R/mt-shm > $R/mt-shm.log 2>&1; echo rc=$?; rm -rf /dev/shm/kva
tab $R/mt-shm.log
el mt-l2-all
timeout $(lim 70) $D --no-plot --l2-pages 400 --setups 'L1 only,L1+L2,ideal (all in L1)' --out $R/mt-l2-all > $R/mt-l2-all.log 2>&1; echo rc=$?
tab $R/mt-l2-all.log
el load
rm -rf /dev/shm/kva; timeout $(lim 230) $D --clients 12 --rounds 8 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config '{"root":"/dev/shm/kva","capacity_bytes":17179869184}' --loads 0.97,1.03 --concurrency 12 --out $R/mt-load-12 > $R/mt-load-12.log 2>&1; echo rc=$?; rm -rf /dev/shm/kva
grep -A16 "^| load   *| setup  *| util" $R/mt-load-12.log | cut -d"|" -f2-9,14,15,16
grep -A16 "^| load  *| setup  *| match" $R/mt-load-12.log
el store-file
timeout $(lim 70) $K bench store --store file --dir /dev/shm/kvb --page-sizes 1M,2M,4M,8M --total 1G --repeat 3 --json $R/store-file-tmpfs.json > $R/store-file-tmpfs.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
tail -9 $R/store-file-tmpfs.log
el file-io8
rm -rf /dev/shm/kvf; timeout $(lim 90) $D --no-plot --setups 'L1 only,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)' --l3-config '{"root":"/dev/shm/kvf","io_threads":8}' --out $R/mt-file-io8 > $R/mt-file-io8.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
tab $R/mt-file-io8.log
el done
