#!/bin/bash
# Why 1 MiB writes into tmpfs ran at 13% of raw on a 16-core host (call 1; 8 MiB 66%): the
# file store's batch_set / batch_get of 1 MiB pages with 1, 4 and 16 I/O threads at CPython's
# 5 ms switch interval and at the demo's 0.1 ms; the checksum replaced by nothing and done in
# one call a page (what the 8 per-page checksum calls cost) and called holding the interpreter
# lock (ISA-L's CRC-32 through ctypes); smaller runs (io_call_bytes 2 MiB);
# 8 MiB pages; the same writes without the store (write_paths.py: raw pwritev, the 8 checksum
# calls a page, one); then the 1 MiB writes at 16 threads under a wall-clock profile (py-spy).
# From the repository root with the wheels (py-spy's too) in .whl:
# bash records/open-targets/call-2.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
W=records/open-targets/store_writes.py
w(){ timeout 40 python3 $W /dev/shm/kvw "$@" 2>&1 | tee -a $R/writes.log; }
el store
w 1 1 1024 0; w 1 4 1024 0; w 1 16 1024 0; w 1 16 1024 0.1
w 1 16 1024 0 '{}' nocrc; w 1 16 1024 0 '{}' onegroup; w 1 16 1024 0.1 '{}' onegroup
w 1 16 1024 0 '{"io_call_bytes": 2097152}'; w 1 16 1024 0 '{"io_call_bytes": 2097152}' onegroup
w 1 16 1024 0 '{}' held; w 1 4 1024 0 '{}' held; w 1 16 1024 0.1 '{}' held
w 8 16 128 0; w 8 16 128 0 '{}' onegroup; w 8 16 128 0 '{}' held; w 1 16 1024 0
el micro
for a in "16 1024 8 16" "16 1024 2 16" "4 1024 8 4" "16 128 1 16"; do
  set -- $a; m=1; [ $3 = 1 ] && m=8
  timeout 60 python3 records/open-targets/write_paths.py /dev/shm/kvp $m $1 $2 $3 $4 2>&1 | tee -a $R/micro.log
done
el profile
timeout 60 /tmp/kv/bin/py-spy record -r 250 --idle --threads -f raw -o $R/writes.raw -- \
  python3 $W /dev/shm/kvw 1 16 1024 0 > $R/profile.log 2>&1; tail -3 $R/profile.log
python3 - $R/writes.raw <<'PY' | tee $R/leaves.txt
import sys
from collections import Counter
leaf, incl = Counter(), Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if stack and "kvtier-file-w" in stack.split(";")[0]:
        f = stack.split(";")
        leaf[f[-1]] += int(n)
        for x in set(f[1:]):
            incl[x] += int(n)
print("writer threads, by leaf:")
for f, c in leaf.most_common(15):
    print(f"{c:7d} {f[:120]}")
print("writer threads, inclusive:")
for f, c in incl.most_common(15):
    print(f"{c:7d} {f[:120]}")
PY
rm -rf /dev/shm/kvw /dev/shm/kvp; cp $R/writes.log $R/micro.log $R/leaves.txt $OUT/ 2>/dev/null; el done
