# Seventeenth device call: the copy engine's issue thread, handing each layer of a load over
# as soon as its copies are queued (call 16: ~1.5 ms a request of the serving thread's time
# went into queueing a load's 32 per-layer batches before the prefill could start). Call 13's
# at-dispatch run, with the issue thread off (the default) and on, alternating, two each, on
# one machine; the copy engine's GPU tests first.
# From the repository root with the wheels in .whl: B=585 bash records/l3-staging/call-17.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider packages/nvidia-tma/tests/test_gpu.py \
  -k "copy_engine" > $R/gpu-tests.log 2>&1; echo tests rc=$?; tail -2 $R/gpu-tests.log
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
printf '[cache]\ntransfer_config = { issue_thread = true }\n' > /tmp/issue-thread.toml
rows(){ grep -E "^\| (serial|12.3 req/s) " $R/$1.log | cut -d'|' -f1-6,18; grep -A8 "Where a request" $R/$1.log | tail -4; }
for i in 1 2; do
  unset KVTIER_CONFIG; run caller-$i 125 $LOAD --setups 'L1+L2+L3,ideal (all in L1)'; rows caller-$i
  export KVTIER_CONFIG=/tmp/issue-thread.toml; run issue-thread-$i 125 $LOAD --setups 'L1+L2+L3,ideal (all in L1)'; rows issue-thread-$i
done
unset KVTIER_CONFIG; el done
