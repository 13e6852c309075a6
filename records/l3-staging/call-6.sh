# Sixth device call: call 5's chain run (16 GiB arena, 105% load) measured 63% of the ideal
# with the router keeping the copy engine, against 85% in call 4 with the copy engine alone.
# The two back to back in one call, the copy engine alone first, to tell the router's own
# cost from the machine's drift between calls.
# From the repository root with the wheels in .whl:
# B=580 bash records/l3-staging/call-6.sh
rm -rf /tmp/res; . records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
S='L1 only,L1+L2+L3,ideal (all in L1)'
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --loads 1.05"
routes(){ python3 -c "import json,sys; [print(e['setup'], e['level'], e.get('route'), e.get('route_trials'), e.get('rerouted')) for e in json.load(open(sys.argv[1]))['load'].get('engine_stats', [])]" $R/$1/results.json; }
run load-16g-copy 280 $LOAD --setups "$S" --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine
run load-16g-router 280 $LOAD --setups "$S" --l3-store chain --l3-config "$C"
routes load-16g-router
el done
