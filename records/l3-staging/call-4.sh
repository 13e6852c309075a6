# Fourth device call: does the SM copy kernel slow the prefill under load? In call 3 the
# router's in-use check moved both directions from the copy engine to the SM kernel (the copy
# engine ran 14-16% under its calibrated rate there) in every run. The chain with a 16 GiB
# arena (it holds every page: L3 is in place, nothing staged) at the same load, with the SM
# kernel alone and with the copy engine alone, in one call.
# From the repository root with the wheels in .whl (each run needs more than 150 s):
# B=520 bash records/l3-staging/call-4.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
# first the router's in-use check and its SM-kernel trial (GPU tests)
timeout 100 python3 -m pytest -q -p no:cacheprovider packages/nvidia-tma/tests/test_gpu.py \
  -k "routed" > $R/gpu-tests.log 2>&1; echo tests rc=$?; tail -3 $R/gpu-tests.log
S='L1 only,L1+L2+L3,ideal (all in L1)'
C="$(chain 17179869184 8)"
run load-16g-sm 195 --clients 16 --rounds 12 --loads 1.05 --setups "$S" --l3-store chain --l3-config "$C" --transfer-engine nvidia-tma
run load-16g-copy 195 --clients 16 --rounds 12 --loads 1.05 --setups "$S" --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine
el done
