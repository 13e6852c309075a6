# Eighth device call: the next queued request's hits loaded into L1 while the request ahead
# prefills (DemoEngine.preload), against every load at dispatch (--no-preload), on call 6's
# copy-engine run: L1+L2+L3 and the ideal at 12.3 requests/s (105% of call 6's L1-only
# capacity, 11.73/s; L1 only in the first run for the speedups).
# From the repository root with the wheels in .whl: B=560 bash records/l3-staging/call-8.sh
# (Preload was the default then; on later code the first run needs --preload.)
rm -rf /tmp/res; . records/l3-staging/lib.sh
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --rate 12.3 --l3-store chain --l3-config $C --transfer-engine nvidia-copy-engine"
run preload 300 $LOAD --setups 'L1 only,L1+L2+L3,ideal (all in L1)'
grep -E "^\| (serial|12.3 req/s) " $R/preload.log | cut -d'|' -f1-6,9,14-18
grep -A9 "Where a request" $R/preload.log
python3 -c "import json,sys; [print(r['level'], r['setup'], r.get('preloaded_pct'), r.get('preload_skips')) for r in json.load(open(sys.argv[1]))['load']['table'] if r['kind'] != 'serial']" $R/preload/results.json
run at-dispatch 250 $LOAD --setups 'L1+L2+L3,ideal (all in L1)' --no-preload
grep -E "^\| (serial|12.3 req/s) " $R/at-dispatch.log | cut -d'|' -f1-6,9,14-18
grep -A8 "Where a request" $R/at-dispatch.log
el done
