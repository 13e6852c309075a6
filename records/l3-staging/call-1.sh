# First device call: the file L3 on tmpfs under load (16 conversations x 12 rounds at 105% of
# L1 only's capacity), read by the engine's own I/O threads into L2 (the code before), against
# a chain of a 2 GiB shm arena (a quarter of the workload's 958 pages of 8 MiB) in front of
# the same file L3, whose file pages 8 helper processes stage into the arena while requests
# wait and the engine loads in place; then the chain served one request at a time.
# From the repository root with the wheels in .whl: B=580 bash records/l3-staging/call-1.sh
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
FILE='{"root":"/dev/shm/kvf","io_threads":8}'
chain(){ echo "{\"stores\":[{\"store\":\"shm\",\"config\":{\"name\":\"kvs\",\"capacity_bytes\":$1,\"remove_when_unused\":true}},{\"store\":\"file\",\"config\":$FILE}],\"stage_processes\":$2}"; }
run(){ # name, seconds, args...
  local n=$1 s=$2; shift 2; el $n; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  timeout $(lim $s) $D "$@" --out $R/$n > $R/$n.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  grep -E "capacity|^\| (serial|1[0-9][0-9]%) +\| (L1|ideal)" $R/$n.log | cut -d'|' -f1-6,9,14-18 | head -8
  grep -o "'stage_[a-z_]*': [0-9]*\|'staged_pages': [0-9]*\|'in_place_reads': [0-9]*" $R/$n.log | tr '\n' ' '; echo; }
run load-file 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "$FILE"
run load-chain-2g 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 2147483648 8)"
run mt-chain-2g 90 --setups 'L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 2147483648 8)"
el done
