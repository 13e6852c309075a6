"""Replay a run's recorded prefills through the cost model and count the splits that skip
in-place L3 pages (the figure in records/demo-engines.md, section 4).

After each prefill, in order, a typical request's split: 10 L3 pages of the 8B shape loaded
in place at 46 GB/s against recomputing them, 300 tokens computed anyway.

    python records/demo-engines/replay_split.py [prefills.json]

(default: packages/core/tests/data/h100_8b_prefills.json, call 2's L1+L2+L3 prefills). Run
it with an older kvtier on the path to see the code before a change.
"""

from __future__ import annotations

import json
import sys

from kvtier.cache.cost import CostModel

PAGE_BYTES = 64 * 128 * 1024

path = sys.argv[1] if len(sys.argv) > 1 else "packages/core/tests/data/h100_8b_prefills.json"
rows = json.load(open(path))["prefills"]
m = CostModel()
m.observe_load(PAGE_BYTES * 8, PAGE_BYTES * 8 / 46e9)
skips, rates = 0, []
for tokens, seconds, context in rows:
    m.observe_recompute(tokens, seconds, context=context)
    _, l3 = m.split(l2_pages=0, l3_pages=10, in_place=True, compute_tokens=300,
                    page_size=64, page_bytes=PAGE_BYTES, layers=32, context=1000)
    skips += l3 < 10
    rates.append(m.recompute_tokens_per_s or 0.0)
known = [r for r in rates if r]
print(f"{len(rows)} prefills: {skips} splits skip in-place pages; recompute rate "
      f"{min(known) / 1e3:.0f}K-{max(known) / 1e3:.0f}K tokens/s")
