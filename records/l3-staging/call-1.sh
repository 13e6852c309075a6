# First device call: the file L3 on tmpfs under load (16 conversations x 12 rounds at 105% of
# L1 only's capacity), read by the engine's own I/O threads into L2 (the code before), against
# a chain of a 2 GiB shm arena (a quarter of the workload's 958 pages of 8 MiB) in front of
# the same file L3, whose file pages 8 helper processes stage into the arena while requests
# wait and the engine loads in place; then the chain served one request at a time.
# From the repository root with the wheels in .whl: B=580 bash records/l3-staging/call-1.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
run load-file 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "$FILE"
run load-chain-2g 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 2147483648 8)"
run mt-chain-2g 90 --setups 'L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 2147483648 8)"
el done
