"""Summarise call-7.sh's profile (py-spy's raw collapsed stacks): samples per thread, then,
under a focus frame (default: the demo engine's ``serve``), its direct children and the
inclusive and self samples of every frame below it.

    python records/l3-staging/spy-summary.py prof.raw [FUNCTION FILE-SUFFIX]
"""
import collections
import re
import sys

from spyraw import samples, where as bare

path = sys.argv[1]
func, where = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("serve", "demo/engine.py")
threads: collections.Counter = collections.Counter()
incl: collections.Counter = collections.Counter()
self_: collections.Counter = collections.Counter()
child: collections.Counter = collections.Counter()
total = 0


def focus(frame: str) -> bool:
    m = re.match(r"(\S+) \((.*):\d+\)$", frame)
    return m is not None and m.group(1).split(".")[-1] == func and m.group(2).endswith(where)


for frames, n in samples(path):
    threads[frames[0]] += n
    at = next((i for i, f in enumerate(frames) if focus(f)), None)
    if at is None:
        continue
    total += n
    below = [bare(f) for f in frames[at + 1:]]
    for key in set(below):
        incl[key] += n
    if below:
        child[below[0]] += n
    self_[below[-1] if below else bare(frames[at])] += n


def show(title: str, counts: collections.Counter, top: int) -> None:
    print(title)
    for key, c in counts.most_common(top):
        print(f"  {c:7d} {100 * c / max(1, total):5.1f}% {key}")


print("threads:")
for t, c in threads.most_common(12):
    print(f"  {c:7d} {t}")
print(f"{func} ({where}): {total} samples")
show("direct children:", child, 15)
show("inclusive:", incl, 60)
show("self:", self_, 30)
