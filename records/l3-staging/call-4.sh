# Fourth device call: does the SM copy kernel the router moves loads to slow the prefill under
# load? The chain with a 16 GiB arena (it holds every page: L3 is in place, nothing staged) at
# the same load, with the router (default) and with the copy engine alone, in one call.
# From the repository root with the wheels in .whl (each run needs more than 150 s):
# B=400 bash records/l3-staging/call-4.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
S='L1 only,L1+L2+L3,ideal (all in L1)'
C="$(chain 17179869184 8)"
run load-16g-router 195 --clients 16 --rounds 12 --loads 1.05 --setups "$S" --l3-store chain --l3-config "$C"
run load-16g-copy 195 --clients 16 --rounds 12 --loads 1.05 --setups "$S" --l3-store chain --l3-config "$C" --transfer-engine nvidia-copy-engine
el done
