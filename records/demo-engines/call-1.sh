#!/bin/bash
# One device call (2026-12-06): does the engine that moves pages during the prefill slow it?
# Wheels: `pip wheel --no-deps packages/core packages/tools packages/nvidia-tma -w .whl` plus
# the transformers 5.24 and isal wheels in .whl/. From the repository root:
#   B=560 bash records/demo-engines/call-1.sh
#  1. the file store on the host's tmpfs against raw I/O, with a total small enough to finish;
#  2. 8B multi-turn, shm L3 loaded in place: the router (default), the router without its
#     in-use check (verify_mib = 0), and the copy engine alone;
#  3. the file L3 on tmpfs (8 I/O threads) with the router and with the copy engine;
#  4. the file L3 on the host disk with whole reads (the default since 4af217e) against L1+L2.
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
printf '[cache]\ntransfer_config = { verify_mib = 0 }\n' > /tmp/noverify.toml
SHM='{"root":"/dev/shm/kva","capacity_bytes":8589934592}'
FT='{"root":"/dev/shm/kvf","io_threads":8}'
tab(){ grep -E "^\| (L1|ideal)" $1 | grep -v "GB/s\|in place\|^| L1 only  *| [0-9,]* *| -" | cut -d"|" -f2,3,8,12 | head -5
       grep -E "^\| (L1|ideal).*\| [0-9]+ +\| [-0-9]+ +\| [0-9.]+ +\| [0-9.]+ " $1 | cut -d'|' -f2,5,6 | head -5
       grep -c "moved to" $1; grep -E "^\| (L1|ideal).*GB/s|in place" $1 | cut -d'|' -f2,4,5 | head -5; }
one(){ # name, seconds, extra demo args...
  local n=$1 s=$2; shift 2; el $n
  rm -rf /dev/shm/kva /dev/shm/kvf /tmp/kvd; timeout $(lim $s) $D --out $R/$n "$@" > $R/$n.log 2>&1; echo rc=$?
  rm -rf /dev/shm/kva /dev/shm/kvf /tmp/kvd; tab $R/$n.log; }
el store-file
timeout $(lim 75) $K bench store --store file --dir /dev/shm/kvb --page-sizes 1M,4M,8M --total 256M --repeat 3 --threads 8 --json $R/store-file-tmpfs.json > $R/store-file-tmpfs.log 2>&1; echo rc=$?; rm -rf /dev/shm/kvb
tail -8 $R/store-file-tmpfs.log
one shm-routed 65 --setups 'L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config "$SHM"
one shm-ce 65 --setups 'L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config "$SHM" --transfer-engine nvidia-copy-engine
KVTIER_CONFIG=/tmp/noverify.toml one shm-noverify 65 --setups 'L1+L2+L3,ideal (all in L1)' --l3-store shm --l3-config "$SHM"
one file-ce 70 --setups 'L1+L2+L3,ideal (all in L1)' --l3-config "$FT" --transfer-engine nvidia-copy-engine
one file-routed 70 --setups 'L1+L2+L3,ideal (all in L1)' --l3-config "$FT"
one disk 90 --setups 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' --l3-config '{"root":"/tmp/kvd"}'
el done
