# Fifth device call: the router's in-use check with its SM-kernel trial (a copy engine that
# falls short of its calibrated rate is traded for the SM kernel only if that runs faster
# under the same load), on call 4's workload (the chain with a 16 GiB arena at 105% load) and
# on call 3's file L3 through L2 (39% of ideal under load there, when the router had moved
# both directions to the SM kernel). The routed GPU tests first (the code after the refactor).
# From the repository root with the wheels in .whl:
# B=520 bash records/l3-staging/call-5.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/nvidia-tma/tests/test_gpu.py \
  -k "routed" > $R/gpu-tests.log 2>&1; echo tests rc=$?; tail -3 $R/gpu-tests.log
S='L1 only,L1+L2+L3,ideal (all in L1)'
C="$(chain 17179869184 8)"
LOAD="--clients 16 --rounds 12 --loads 1.05"
routes(){ python3 -c "import json,sys; [print(e['setup'], e['level'], e.get('route'), e.get('route_trials'), e.get('rerouted')) for e in json.load(open(sys.argv[1]))['load'].get('engine_stats', [])]" $R/$1/results.json; }
run load-16g-router 180 $LOAD --setups "$S" --l3-store chain --l3-config "$C"
routes load-16g-router
run load-file-router 170 $LOAD --setups "$S" --l3-config "$FILE"
routes load-file-router
el done
