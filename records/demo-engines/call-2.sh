#!/bin/bash
# Second device call (2026-12-06). Wheels as in call-1.sh. From the repository root:
#   B=560 bash records/demo-engines/call-2.sh
#  1. the file store on the host's tmpfs against raw I/O (the bench no longer pauses 1 s
#     after each write on a filesystem in memory), batches of 64 and of 13 (a multi-turn
#     request's read: ~102 MiB of 8 MiB pages), 8 and 16 I/O threads;
#  2. the demo's file L3 on tmpfs with 16 I/O threads;
#  3. issue 41: 8B multi-turn under an open-loop load, with enough requests (16 conversations
#     x 12 rounds) for L1 only's queue to build, shm L3 loaded in place.
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
sb(){ # name, seconds, bench args...
  local n=$1 s=$2; shift 2; el $n
  timeout $(lim $s) $K bench store --store file --dir /dev/shm/kvb --json $R/$n.json "$@" > $R/$n.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kvb; grep -E "^\| [0-9]+ [KM]iB|^against" $R/$n.log | cut -c1-400; }
sb store-t8 80 --page-sizes 1M,2M,4M,8M --total 512M --repeat 3 --threads 8
sb store-8m-b13 40 --page-sizes 8M --total 416M --batch 13 --repeat 3 --threads 8
sb store-8m-b13-t16 40 --page-sizes 8M --total 416M --batch 13 --repeat 3 --threads 16
el file-t16
rm -rf /dev/shm/kvf; timeout $(lim 60) $D --setups 'L1+L2+L3,ideal (all in L1)' --l3-config '{"root":"/dev/shm/kvf","io_threads":16}' --out $R/file-t16 > $R/file-t16.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvf
grep -E "^\| (L1|ideal)" $R/file-t16.log | cut -c1-200 | sed -n '1,2p;5,6p;7,8p'
el load
rm -rf /dev/shm/kva; timeout $(lim 300) $D --clients 16 --rounds 12 --setups 'L1 only,L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config '{"root":"/dev/shm/kva","capacity_bytes":25769803776}' --loads 1.0,1.05 --out $R/load-16x12 > $R/load-16x12.log 2>&1; echo rc=$?; rm -rf /dev/shm/kva
grep -E "capacity|^\| (load|serial|1[0-9][0-9]%|  )" $R/load-16x12.log | cut -c1-260 | head -30
el done
