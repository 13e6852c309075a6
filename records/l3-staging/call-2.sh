# Second device call: the same load (16 conversations x 12 rounds at 105% of L1 only's
# capacity) with the file L3 on tmpfs read by the engine's threads, against the chain with a
# 4 GiB arena (about half the workload's 958 pages of 8 MiB) staged by 8 helper processes;
# the fetch stages again what left the arena while the request waited.
# From the repository root with the wheels in .whl: B=560 bash records/l3-staging/call-2.sh
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
FILE='{"root":"/dev/shm/kvf","io_threads":8}'
chain(){ echo "{\"stores\":[{\"store\":\"shm\",\"config\":{\"name\":\"kvs\",\"capacity_bytes\":$1,\"remove_when_unused\":true}},{\"store\":\"file\",\"config\":$FILE}],\"stage_processes\":$2}"; }
run(){ # name, seconds, args...
  local n=$1 s=$2; shift 2; el $n; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  timeout $(lim $s) $D "$@" --out $R/$n > $R/$n.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  grep -E "^\| (serial|1[0-9][0-9]%) +\| (L1|ideal)" $R/$n.log | cut -d'|' -f1-6,9,14-18 | head -8
  grep -o "'stage_[a-z_]*': [0-9]*\|'staged_pages': [0-9]*\|'in_place_reads': [0-9]*\|'demote_[a-z_]*': [0-9]*" $R/$n.log | tr '\n' ' '; echo; }
run load-file 170 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-config "$FILE"
run load-chain-4g 200 --clients 16 --rounds 12 --loads 1.05 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store chain --l3-config "$(chain 4294967296 8)"
el done
