#!/bin/bash
# What every device call of this record shares; a call script sets NEW (the folder under .whl/
# with main's core and tools wheels) and B (seconds the call may take), sources this, and
# lists its runs. Wheels: `pip wheel --no-deps packages/core packages/tools packages/nvidia-tma
# -w .whl` (the code before, for "old": core alone in .whl/old/; main's core and tools in
# .whl/$NEW/), carried to the device with transformers and isal wheels.
# run NAME CODE SIZE ROOT SETUPS: one demo (CODE old or new) with the file L3 under ROOT;
# tab: its summary rows; cal: the calibration's metrics and samples (calls 2-3).
# Run from the repository root: B=585 bash records/data-path-calibration/device-call-N.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s); R=/tmp/res; mkdir -p $R
P="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
$P --target /tmp/old .whl/*.whl || exit 1
$P --force-reinstall --target /tmp/old .whl/old/*.whl || exit 1
$P --target /tmp/new .whl/*.whl || exit 1
$P --force-reinstall --target /tmp/new .whl/$NEW/*.whl || exit 1
el(){ echo "== $(( $(date +%s)-T0 ))s $*"; (cd /tmp && tar czf $OUT/res.tgz res); }
lim(){ local l=$(( ${B:-585} - ($(date +%s)-T0) )); [ $l -gt $1 ] && l=$1; echo $l; }
{ nvidia-smi -L; free -g; nproc; } > $R/machine.txt 2>&1
tab(){ grep -A7 "^| setup             | hit rate" $1 | head -7 | cut -d'|' -f2,3,6,8,10,12; grep "Cost-aware\|Measured ideal" $1 | cut -c1-230 | head -2; grep -A7 "^| setup             | recompute" $1 | head -7 | cut -d'|' -f2-5; }
run(){ # name code size root setups
  local n=$1 code=$2 size=$3 root=$4 setups=$5; el $n-$code
  rm -rf $root; mkdir -p $root
  PYTHONPATH=/tmp/$code timeout $(lim $LIM) python3 -m kvtier demo --device cuda --dtype bfloat16 --no-progress --no-plot --model-size $size --setups "$setups" --l3-config "{\"root\":\"$root\"}" --out $R/$n-$code > $R/$n-$code.log 2>&1; echo rc=$?; tab $R/$n-$code.log
  rm -rf $root; }
cal(){ python3 -c "
import json,sys
d=json.load(open(sys.argv[1]+'/results.json'))
for s,m in d['cache_metrics'].items():
    print(s,'calibrated',m.get('recompute_calibrated'),'rate %.0f fixed %.1f ms attn %.3g'%(m.get('recompute_tokens_per_s') or 0,1e3*(m.get('recompute_fixed_s') or 0),m.get('recompute_attn_s_per_pair') or 0),'skipped L2/L3',m.get('cost_skipped_pages_l2'),m.get('cost_skipped_pages_l3'))
for s,c in d.get('calibration',{}).items():
    print(s,'samples',[(n,round(t*1e3,2),x) for n,t,x in c])
" $R/$1; }
