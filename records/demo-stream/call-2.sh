#!/bin/bash
# One device call, after reads got their own L3 worker and file-store threads and the
# streamed split learnt the wait before the first layer group (2026-12-06).
# Wheels as in call-1.sh. Run from the repository root: B=560 bash records/demo-stream/call-2.sh
#  1. 8B multi-turn, file L3 on tmpfs (8 I/O threads): streamed, whole (l3_stream_layers =
#     false), streamed, whole -- alternated, each with its own L1-only and ideal runs;
#  2. the long-context pair;
#  3. the file L3 on the host disk, streamed, against L1+L2;
#  4. the file store on /dev/shm against its raw modes (512 MiB per measurement).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s); R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kv .whl/*.whl || exit 1
export PYTHONPATH=/tmp/kv
el(){ echo "== $(( $(date +%s)-T0 ))s $*"; (cd /tmp && tar czf $OUT/res.tgz res); }
lim(){ local l=$(( ${B:-560} - ($(date +%s)-T0) )); [ $l -gt $1 ] && l=$1; [ $l -lt 1 ] && l=1; echo $l; }
{ nvidia-smi -L; free -g; nproc; df -h /dev/shm /tmp; } > $R/machine.txt 2>&1
printf '[cache]\nl3_stream_layers = false\n' > /tmp/whole.toml
K="python3 -m kvtier"
D="$K demo --device cuda --model-size 8b --dtype bfloat16 --no-progress --no-plot"
S='L1 only,L1+L2+L3,ideal (all in L1)'
FT='{"root":"/dev/shm/kvf","io_threads":8}'
tab(){ grep -E "^\| (L1|ideal)" $1 | cut -d'|' -f2,3,7,8,10,12 | head -4; grep -E "^\| L1\+L2\+L3 " $1 | sed -n 3p | cut -d'|' -f2,4,5,6; grep -E "^\| L1\+L2\+L3 " $1 | sed -n 2p | cut -d'|' -f4,5; }
one(){ # name, workload args, stream|whole, setups, l3 config, seconds
  el $1
  [ $3 = whole ] && export KVTIER_CONFIG=/tmp/whole.toml || unset KVTIER_CONFIG
  rm -rf /dev/shm/kvf /tmp/kvd; timeout $(lim $6) $D $2 --setups "$4" --l3-config "$5" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf /tmp/kvd; unset KVTIER_CONFIG; tab $R/$1.log
}
one mt-stream-1 "" stream "$S" "$FT" 60
one mt-whole-1 "" whole "$S" "$FT" 60
one mt-disk "" stream 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' '{"root":"/tmp/kvd"}' 70
one long-stream "--workload long --clients 4 --rounds 4" stream "$S" "$FT" 90
one long-whole "--workload long --clients 4 --rounds 4" whole "$S" "$FT" 90
one mt-stream-2 "" stream "$S" "$FT" 60
one mt-whole-2 "" whole "$S" "$FT" 60
el store-shm
timeout $(lim 120) $K bench store --dir /dev/shm/kvb --total 512M --page-sizes 1M,2M,4M,8M --repeat 2 --threads 8 --json $R/store-shm.json > $R/store-shm.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
tail -12 $R/store-shm.log
el done
