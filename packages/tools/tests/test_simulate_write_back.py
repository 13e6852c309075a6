"""write_back with an L3 never loses pages: L1 evictions wait for the L2 room being written
out (the controller replayed by `kvtier simulate`)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtier_tools.simulate import TraceRequest, simulate


ABCB = [TraceRequest(0, 1024, 1, (b, b + 100)) for b in (0, 1, 2, 1)]


def _sim(l3):
    return simulate(ABCB, l1_pages=2, l2_pages=2, page_size=512, write_policy="write_back",
                    l3=l3, l3_pages=64 if l3 else None, show_progress=False)


def test_write_back_with_l3_moves_pages_down_instead_of_dropping_them():
    without, with_l3 = _sim(None), _sim("memory")
    assert without.l2_hit_tokens == 1024                  # 25 % of the 4096 prompt tokens
    assert with_l3.l2_hit_tokens == 1024
    assert with_l3.hit_tokens >= without.hit_tokens
    assert with_l3.metrics.get("l1_dirty_dropped", 0) <= without.metrics["l1_dirty_dropped"]


def _shared_prefix_trace(n: int, seed: int) -> list[TraceRequest]:
    """Requests of 2-6 blocks that share prefixes (a tree of block ids), as chat turns do."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids, node = [], 0
        for depth in range(rng.randint(2, 6)):
            node = node * 4 + rng.randint(1, 3 if depth < 2 else 4)
            ids.append(node % 100_000)
        out.append(TraceRequest(0, 512 * len(ids), 1, tuple(ids)))
    return out


def test_write_back_simulate_is_deterministic_and_l3_only_adds_hits():
    reqs = _shared_prefix_trace(150, seed=3)
    kw = dict(l1_pages=12, l2_pages=16, page_size=512, write_policy="write_back",
              show_progress=False)
    runs = [simulate(reqs, l3="memory", l3_pages=400, **kw) for _ in range(3)]
    tiers = [(r.l1_hit_tokens, r.l2_hit_tokens, r.l3_hit_tokens) for r in runs]
    assert tiers[0] == tiers[1] == tiers[2], tiers
    base = simulate(reqs, **kw)
    assert runs[0].hit_tokens >= base.hit_tokens
    assert runs[0].l1_hit_tokens == base.l1_hit_tokens      # L1 behaves as without L3
    assert runs[0].metrics.get("l1_dirty_dropped", 0) <= base.metrics.get("l1_dirty_dropped", 0)


def test_simulate_cli_minimal_case(tmp_path):
    trace = tmp_path / "abcb.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 1024,
                                         "output_length": 1, "hash_ids": [b, b + 100]}) + "\n"
                             for b in (0, 1, 2, 1)))
    args = [sys.executable, "-m", "kvtier", "simulate", "--trace", str(trace), "--l1-pages", "2",
            "--l2-pages", "2", "--page-size", "512", "--write-policy", "write_back", "--json"]
    rates = []
    for extra in ([], ["--l3", "memory"], ["--l3", "memory"]):
        o = subprocess.run(args + extra, capture_output=True, text=True, timeout=120)
        assert o.returncode == 0, o.stderr
        rates.append(json.loads(o.stdout)["tiers"]["l2_hit_rate"])
    assert rates == [0.25, 0.25, 0.25]
