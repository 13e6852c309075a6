"""Page-key hashing: tokens -> chained SHA-256 keys for one long prompt, and the raw
per-call SHA-256 cost measured in the same run (the floor a per-page chain cannot beat)."""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from ..keys import PageKeyer
from ..report import progress, table
from ..spec import KVSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=131072, help="prompt length (default 128K)")
    p.add_argument("--page-sizes", default="16,32,64,128", help="comma-separated page sizes")
    p.add_argument("--repeat", type=int, default=30, help="timed repetitions (median reported)")


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _bare_sha(n: int, block: bytes) -> None:
    sha = hashlib.sha256
    for _ in range(n):
        sha(block).digest()


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150000, size=args.tokens, dtype=np.int64)
    rows = []
    sizes = [int(s) for s in args.page_sizes.split(",") if s]
    for ps in progress(sizes, desc="page sizes"):
        spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=ps)
        keyer = PageKeyer(model_id="bench", spec=spec)
        n = args.tokens // ps
        ms = _median_ms(lambda k=keyer: k.keys(tokens), args.repeat)
        floor_ms = _median_ms(lambda n=n, b=b"\x01" * (32 + 4 * ps): _bare_sha(n, b),
                              args.repeat)
        rows.append([ps, n, f"{ms:.3f}", f"{ms * 1e3 / n:.3f}", f"{floor_ms:.3f}",
                     f"{floor_ms / ms:.2f}"])
    print(f"hashing + chaining a {args.tokens}-token prompt (median of {args.repeat})")
    print(table(["page size", "pages", "keys ms", "us/page", "bare sha256 ms",
                 "bare/keys"], rows))
    return 0
