# Second device call: the same load (16 conversations x 12 rounds at 105% of L1 only's
# capacity) with the file L3 on tmpfs read by the engine's threads, against the chain with a
# 4 GiB arena (about half the workload's 958 pages of 8 MiB) staged by 8 helper processes;
# the fetch stages again what left the arena while the request waited.
# From the repository root with the wheels in .whl: B=560 bash records/l3-staging/call-2.sh
. records/l3-staging/lib.sh        # FILE, chain (bytes, helpers), run (name, s, args)
run load-file 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "$FILE"
run load-chain-4g 200 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 4294967296 8)"
el done
