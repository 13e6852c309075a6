# Sourced by call-*.sh (run from the repository root on the device): the file L3 on tmpfs,
# a chain of an shm arena of $1 bytes before it with $2 helper processes, and one demo run.
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
FILE='{"root":"/dev/shm/kvf","io_threads":8}'
chain(){ echo "{\"stores\":[{\"store\":\"shm\",\"config\":{\"name\":\"kvs\",\"capacity_bytes\":$1,\"remove_when_unused\":true}},{\"store\":\"file\",\"config\":$FILE}],\"stage_processes\":$2}"; }
run(){ # name, seconds, args...
  local n=$1 s=$2; shift 2; el $n; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  timeout $(lim $s) $D "$@" --out $R/$n > $R/$n.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf /dev/shm/kvs-*
  grep -E "capacity|^\| (serial|1[0-9][0-9]%) +\| (L1|ideal)" $R/$n.log | cut -d'|' -f1-6,9,14-18 | head -8
  grep -o "'stage_[a-z_]*': [0-9]*\|'staged_pages': [0-9]*\|'in_place_reads': [0-9]*\|'demote_[a-z_]*': [0-9]*" $R/$n.log | tr '\n' ' '; echo; }
