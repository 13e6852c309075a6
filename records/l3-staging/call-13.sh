# Thirteenth device call: call 12's at-dispatch run (0.1 ms switch interval) three times on
# one machine. Its ideal's prefill under load went from 26.1 ms (call 11) to 44.8 (call 12)
# on the same command while L1+L2+L3's stayed near its serial replay: how far one run's
# "% of ideal" moves from run to run.
# From the repository root with the wheels in .whl: B=420 bash records/l3-staging/call-13.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
rows(){ grep -E "^\| (serial|12.3 req/s) " $R/$1.log | cut -d'|' -f1-9,14-18; grep -A8 "Where a request" $R/$1.log | tail -4; }
for i in 1 2 3; do
  run at-dispatch-$i 130 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
  rows at-dispatch-$i
done
el done
