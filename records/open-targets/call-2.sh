#!/bin/bash
# Why the file store's 1 MiB writes on a 16-core host's tmpfs run at 13% of raw (call 1's
# bench; 8 MiB 66%): the bench at CPython's 5 ms switch interval and at the demo's 0.1 ms,
# then batch_set of 1 MiB pages alone under a wall-clock profile (py-spy, every thread).
# From the repository root with the wheels (py-spy's too) in .whl: B=300 bash records/open-targets/call-2.sh
rm -rf /tmp/res; . records/demo-stream/common.sh >/dev/null 2>&1
W=records/open-targets/store_writes.py
for sw in 0 0.1; do el "writes switch $sw"
  timeout $(lim 60) python3 $W /dev/shm/kvw 1 16 1024 $sw 2>&1 | tee $R/writes-1m-$sw.log
  timeout $(lim 60) python3 $W /dev/shm/kvw 8 16 256 $sw 2>&1 | tee $R/writes-8m-$sw.log
done
el profile
timeout $(lim 60) /tmp/kv/bin/py-spy record -r 500 --idle --threads -f raw -o $R/writes.raw -- \
  python3 $W /dev/shm/kvw 1 16 1024 0 > $R/writes-profile.log 2>&1; tail -3 $R/writes-profile.log
python3 - $R/writes.raw <<'PY' | tee $R/writes-leaves.txt
import sys
from collections import Counter
leaf = Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if stack:
        f = stack.split(";")
        leaf[(f[0].split(" (")[0], f[-1])] += int(n)
for (t, f), c in leaf.most_common(30):
    print(f"{c:7d} {t[:28]:28s} {f[:110]}")
PY
el "bench switch 0.1"
timeout $(lim 70) python3 -c "import sys; sys.setswitchinterval(1e-4); from kvtier.cli import main; sys.exit(main(['bench','store','--dir','/dev/shm/kvb','--page-sizes','1M,8M','--total','1G']))" > $R/store-01.log 2>&1
grep -E "^\|" $R/store-01.log; rm -rf /dev/shm/kvb /dev/shm/kvw
el done
