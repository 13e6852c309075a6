# Sourced by call-*.sh (run from the repository root on the device): installs the wheels in
# .whl, and defines the timing, table and one-demo-run helpers the calls share.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s); R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kv .whl/*.whl || exit 1
export PYTHONPATH=/tmp/kv
el(){ echo "== $(( $(date +%s)-T0 ))s $*"; (cd /tmp && tar czf $OUT/res.tgz res); }
lim(){ local l=$(( ${B:-560} - ($(date +%s)-T0) )); [ $l -gt $1 ] && l=$1; [ $l -lt 1 ] && l=1; echo $l; }
{ nvidia-smi -L; free -g; nproc; df -h /dev/shm /tmp; } > $R/machine.txt 2>&1
printf '[cache]\nl3_stream_layers = false\n' > /tmp/whole.toml
printf '[cache]\nl3_stream_min_read_s = 0\n' > /tmp/always.toml
K="python3 -m kvtier"
D="$K demo --device cuda --model-size 8b --dtype bfloat16 --no-progress --no-plot"
S='L1 only,L1+L2+L3,ideal (all in L1)'
FT='{"root":"/dev/shm/kvf","io_threads":8}'
L="--workload long --clients 4 --rounds 4"
tab(){ grep -E "^\| (L1|ideal)" $1 | cut -d'|' -f2,3,7,8,10,12 | head -4; grep -E "^\| L1\+L2\+L3 " $1 | sed -n 3p | cut -d'|' -f2,4,5,6; grep -E "^\| L1\+L2\+L3 " $1 | sed -n 2p | cut -d'|' -f4,5; }
one(){ # name, workload args, default|whole|always, setups, l3 config, seconds
  el $1
  case $3 in whole) export KVTIER_CONFIG=/tmp/whole.toml;; always) export KVTIER_CONFIG=/tmp/always.toml;; *) unset KVTIER_CONFIG;; esac
  rm -rf /dev/shm/kvf /tmp/kvd; timeout $(lim $6) $D $2 --setups "$4" --l3-config "$5" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf /tmp/kvd; unset KVTIER_CONFIG; tab $R/$1.log
}
run_(){ # name, workload args, config file (or "" for the defaults), seconds: one demo run
  el $1
  if [ -n "$3" ]; then export KVTIER_CONFIG=$3; else unset KVTIER_CONFIG; fi
  rm -rf /dev/shm/kvf; timeout $(lim $4) $D $2 --setups "$S" --l3-config "$FT" --out $R/$1 > $R/$1.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvf; unset KVTIER_CONFIG; tab $R/$1.log
}
