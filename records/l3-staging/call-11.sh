# Eleventh device call: who holds the interpreter lock while L1+L2+L3 serves under load
# (calls 8-9: its prefill 2-11 ms longer than served one at a time, the ideal's not). The
# demo's prefill is launched from Python (transformers' Llama, ~22 ms of fixed cost a prefill
# on the H100): any Python another thread runs meanwhile can stretch it. Call 9's
# at-dispatch run twice: once under py-spy sampling only the lock's holder (200 Hz, every
# thread), and once with the thread switch interval at 0.1 ms instead of CPython's 5 ms.
# From the repository root with the wheels (py-spy's too) in .whl:
# B=300 bash records/l3-staging/call-11.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
base="${D#python3 -m kvtier }"
P="python3 records/l3-staging/switch-interval.py"
D="/tmp/kv/bin/py-spy record -r 200 --gil --threads --nonblocking -f raw -o $R/gil.raw -- $P 0.005 $base"
run gil 135 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
grep -E "^\| (serial|12.3 req/s) " $R/gil.log | cut -d'|' -f1-6,9,14-18
python3 records/l3-staging/gil-summary.py $R/gil.raw 200 > $R/gil-summary.txt 2>&1; head -30 $R/gil-summary.txt
D="$P 0.0001 $base"
run switch-0.0001 125 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
grep -E "^\| (serial|12.3 req/s) " $R/switch-0.0001.log | cut -d'|' -f1-6,9,14-18
grep -A8 "Where a request" $R/gil.log | tail -5; grep -A8 "Where a request" $R/switch-0.0001.log | tail -5
el done
