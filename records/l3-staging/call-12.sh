# Twelfth device call: the demo with the interpreter's switch interval at 0.1 ms (its new
# default, `--switch-interval-ms`; the cache's `switch_interval_s`). Call 11 found the 5 ms
# default stretched L1+L2+L3's prefill under load by 13 ms. Call 8's runs at 12.3
# requests/s: with preload (L1 only, L1+L2+L3, the ideal), then at dispatch (L1+L2+L3, the
# ideal), then at dispatch at CPython's 5 ms again (`--switch-interval-ms 0`), one machine.
# From the repository root with the wheels in .whl: B=580 bash records/l3-staging/call-12.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
rows(){ grep -E "^\| (serial|12.3 req/s) " $R/$1.log | cut -d'|' -f1-6,9,14-18; grep -A8 "Where a request" $R/$1.log | tail -5; }
run preload 290 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --preload
rows preload
run at-dispatch 125 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
rows at-dispatch
run at-dispatch-5ms 125 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload --switch-interval-ms 0
rows at-dispatch-5ms
el done
