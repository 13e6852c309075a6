#!/bin/bash
# Third device call (2026-12-06). Wheels as in call-1.sh. From the repository root:
#   B=420 bash records/demo-engines/call-3.sh
#  1. issue 41 at 105% of L1 only's capacity (16 conversations x 12 rounds, shm L3 in place):
#     the cost-aware split against loading every hit, to see whether the split's skipped
#     pages are what holds L1+L2+L3 at 67% of the ideal under load (call 2);
#  2. the file L3 on the host disk against L1+L2 again (the run-to-run spread of call 1).
. records/demo-stream/common.sh    # install, el, lim (B), machine.txt, K, D
el load
rm -rf /dev/shm/kva; timeout $(lim 280) $D --clients 16 --rounds 12 --setups 'L1 only,L1+L2+L3,L1+L2+L3 load all,ideal (all in L1)' --l3-store shm --l3-config '{"root":"/dev/shm/kva","capacity_bytes":25769803776}' --loads 1.05 --out $R/load-16x12-all > $R/load-16x12-all.log 2>&1; echo rc=$?; rm -rf /dev/shm/kva
grep -E "capacity|^\| (load|serial|1[0-9][0-9]%)" $R/load-16x12-all.log | cut -d'|' -f1-6,8,9,13-18 | head -24
el disk
rm -rf /tmp/kvd; timeout $(lim 100) $D --setups 'L1 only,L1+L2,L1+L2+L3,ideal (all in L1)' --l3-config '{"root":"/tmp/kvd"}' --out $R/disk-2 > $R/disk-2.log 2>&1; echo rc=$?; rm -rf /tmp/kvd
grep -E "^\| (L1|ideal)" $R/disk-2.log | cut -c1-200 | head -4
el done
