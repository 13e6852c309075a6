"""Summarise a py-spy ``--gil --threads -f raw`` profile: who held the interpreter lock.

Samples per thread group (a thread's name without its number), the main thread's split into
the load runs (``demo/load.py`` on its stack) and the rest, with the prefill's share of each;
then, for every other group, the functions its threads entered and the frames they held the
lock in.

    python records/l3-staging/gil-summary.py gil.raw [RATE_HZ]
"""
import collections
import re
import sys

from spyraw import samples, where

path = sys.argv[1]
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
groups: collections.Counter = collections.Counter()
main: collections.Counter = collections.Counter()
entries: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
selfs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
PLUMBING = ("threading.py", "concurrent/futures/thread.py", "<frozen runpy>")


total = 0
for frames, n in samples(path):
    total += n
    m = re.match(r"thread \(\d+\)(?:: (.*))?$", frames[0])
    name = (m.group(1) if m and m.group(1) else "unnamed") if m else frames[0]
    group = re.sub(r"[-_]?\d+$", "", name)
    groups[group] += n
    body = [where(f) for f in frames[1:]]
    if group == "MainThread":
        phase = "load" if any("demo/load.py" in f for f in body) else "serial and setup"
        part = "prefill" if any(f.startswith("DemoModel.prefill ") for f in body) else "other"
        main[(phase, part)] += n
        continue
    inner = [f for f in body if not any(p in f for p in PLUMBING)]
    entries[group][inner[0] if inner else "(idle plumbing)"] += n
    if inner:
        selfs[group][inner[-1]] += n

span = f" of {total / rate:.1f} s sampled at {rate:g} Hz" if rate else ""
print(f"{total} samples holding the lock{span}")
for g, c in groups.most_common():
    share = f" {100 * c / total:5.1f}% of lock samples"
    print(f"  {c:7d}{share}  {g}")
print("main thread:")
for (phase, part), c in sorted(main.items()):
    print(f"  {c:7d}  {phase}: {part}")
for g, _ in groups.most_common():
    if g == "MainThread":
        continue
    print(f"{g}: entered")
    for f, c in entries[g].most_common(6):
        print(f"  {c:7d}  {f}")
    print(f"{g}: held the lock in")
    for f, c in selfs[g].most_common(6):
        print(f"  {c:7d}  {f}")
