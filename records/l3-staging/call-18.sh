# Eighteenth device call: a load's copies as one strided copy per page run over every layer
# (`layerwise_load = false`: ~70 copies a request instead of ~2,000 per-layer ones, queued on
# the serving thread in one batch call) against the per-layer default, alternating, two
# each, on one machine. The prefill's first layer then waits on the device for the whole
# load (~5 ms of DMA), which a launch-bound prefill may absorb; call 17 moved the per-layer
# queueing to an issue thread and the prefill beside it grew by 6-8 ms.
# From the repository root with the wheels in .whl: B=595 bash records/l3-staging/call-18.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
printf '[cache]\ntransfer_config = { layerwise_load = false }\n' > /tmp/whole-load.toml
rows(){ grep -E "^\| (serial|12.3 req/s) " $R/$1.log | cut -d'|' -f1-6,18; grep -A8 "Where a request" $R/$1.log | tail -4; }
for i in 1 2; do
  export KVTIER_CONFIG=/tmp/whole-load.toml; run whole-$i 145 $LOAD --setups 'L1+L2+L3,ideal (all in L1)'; rows whole-$i
  unset KVTIER_CONFIG; run per-layer-$i 145 $LOAD --setups 'L1+L2+L3,ideal (all in L1)'; rows per-layer-$i
done
unset KVTIER_CONFIG; el done
