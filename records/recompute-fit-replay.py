"""Replay the recorded demo runs' prefills through the cost split's recompute fit.

For each setup of each run directory given (a demo ``--out`` with results.json): the least-
squares fit of ``fixed + tokens / rate`` over the prefills that loaded nothing ("clean") and
over those that loaded pages ("loaded"), and the online fit (`kvtier.cache.cost._Marginal`,
fed every prefill in order, as the cache is) every 8 requests.

    python records/recompute-fit-replay.py records/demo-h200-8b/2026-12-05/mt-file-tmpfs ...
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvtier.cache.cost import _Marginal, pairs


def lsq(rows):
    if len(rows) < 3:
        return "n/a"
    a = np.array([[1.0, c] for c, _ in rows])
    t = np.array([s for _, s in rows])
    (fixed, per_token), *_ = np.linalg.lstsq(a, t, rcond=None)
    rate = f"{1 / per_token / 1e3:.0f}K tok/s" if per_token > 0 else "negative slope"
    return f"{fixed * 1e3:.1f} ms + {rate}"


for run in sys.argv[1:]:
    d = json.load(open(f"{run}/results.json"))
    print(f"== {run}")
    for setup, reqs in d["requests"].items():
        clean = [(q["computed_tokens"], q["prefill_s"]) for q in reqs
                 if q["l2_tokens"] + q["l3_tokens"] == 0]
        loaded = [(q["computed_tokens"], q["prefill_s"]) for q in reqs
                  if q["l2_tokens"] + q["l3_tokens"] > 0]
        m = _Marginal(0.3)
        online = []
        for i, q in enumerate(reqs):
            m.observe(q["computed_tokens"], q["prefill_s"],
                      pairs(q["tokens"], q["computed_tokens"]))
            if i % 8 == 7:
                fit = m._solve()
                online.append("--" if fit is None else f"{1 / fit[1] / 1e3:.0f}K")
        print(f"  {setup:18s} clean n={len(clean):2d}: {lsq(clean):26s} loaded "
              f"n={len(loaded):2d}: {lsq(loaded):26s} online: {' '.join(online)}")
