# Fifth device call: the router's in-use check with its SM-kernel trial (a copy engine that
# falls short of its calibrated rate is traded for the SM kernel only if that runs faster
# under the same load), on call 4's workload: the chain with a 16 GiB arena at 105% load.
# From the repository root with the wheels in .whl:
# B=240 bash records/l3-staging/call-5.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
S='L1 only,L1+L2+L3,ideal (all in L1)'
C="$(chain 17179869184 8)"
routes(){ python3 -c "import json,sys; [print(e['setup'], e['level'], e.get('route'), e.get('route_trials'), e.get('rerouted')) for e in json.load(open(sys.argv[1]))['load'].get('engine_stats', [])]" $R/$1/results.json; }
run load-16g-router 180 --clients 16 --rounds 12 --loads 1.05 --setups "$S" --l3-store chain --l3-config "$C"
routes load-16g-router
el done
