# Tenth device call: is the longer prefill of L1+L2+L3 under load (calls 8-9: 7-11 ms over
# its serial replay, while the ideal's got shorter) the interpreter lock? The arrivals'
# thread (match, L3 prefetch) and the cache's threads run Python beside the serving thread,
# whose prefill is launched from Python. Call 9's at-dispatch run (no preload) with the
# thread switch interval at CPython's default (5 ms) and at 0.1 ms, one after the other.
# From the repository root with the wheels in .whl: B=240 bash records/l3-staging/call-10.sh
# (SI="0.0001" B=125: the second alone)
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
base="${D#python3 -m kvtier }"
for si in ${SI:-0.005 0.0001}; do
  D="python3 records/l3-staging/switch-interval.py $si $base"
  run switch-$si 118 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
  grep -E "^\| (serial|12.3 req/s) " $R/switch-$si.log | cut -d'|' -f1-6,9,14-18
done
el done
