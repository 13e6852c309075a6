"""Page-key hashing: tokens -> chained page keys for one long prompt, per hash, with the native
chain (kvtier-native-keys, one call per prompt) where installed and supported and the Python
loop (one hash call per page) side by side, and the bare per-call cost of the same hash
measured in the same run (the floor a chain of one hash call per page cannot beat from
Python)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from kvtier.errors import ConfigError
from kvtier.keys import HASHES, NATIVE_KEYS_ENV, PageKeyer, hash_function
from kvtier.report import progress, table
from kvtier.spec import KVSpec


#: No cache is built here (it hashes prompts with every hash):
#: `kvtier --config FILE` says the file does not apply (`kvtier.cli`).
BUILDS_CACHE = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=131072, help="prompt length (default 128K)")
    p.add_argument("--page-sizes", default="16,32,64,128", help="comma-separated page sizes")
    p.add_argument("--hashes", default=",".join(HASHES),
                   help="comma-separated page-key hashes (those not installed are skipped)")
    p.add_argument("--repeat", type=int, default=30, help="timed repetitions (median reported)")
    p.add_argument("--target-ms", type=float, default=1.0,
                   help="target for the whole prompt (default 1 ms)")
    p.add_argument("--json", help="write every result here")


def _median_ms(fn, repeat: int) -> float:
    fn()                                    # warm up (imports, allocator)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _bare(h, n: int, block: bytes) -> None:
    for _ in range(n):
        h(block).digest()


def _keyers(spec: KVSpec, name: str) -> tuple[PageKeyer | None, PageKeyer]:
    """(the native keyer or None, the Python-loop keyer) for hash ``name``."""
    default = PageKeyer(model_id="bench", spec=spec, hash=name)
    saved = os.environ.get(NATIVE_KEYS_ENV)
    os.environ[NATIVE_KEYS_ENV] = "0"
    try:
        python = PageKeyer(model_id="bench", spec=spec, hash=name)
    finally:
        if saved is None:
            del os.environ[NATIVE_KEYS_ENV]
        else:
            os.environ[NATIVE_KEYS_ENV] = saved
    return (default if default.implementation == "native" else None), python


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150000, size=args.tokens, dtype=np.int64)
    rows, results, skipped = [], [], []
    sizes = [int(s) for s in args.page_sizes.split(",") if s]
    hashes = []
    for name in (h.strip() for h in args.hashes.split(",") if h.strip()):
        try:
            hashes.append((name, hash_function(name)))
        except ConfigError as exc:
            skipped.append(f"{name}: {exc}")
    for name, h in hashes:
        for ps in progress(sizes, desc=f"{name} page sizes"):
            spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=ps)
            native, python = _keyers(spec, name)
            n = args.tokens // ps
            if native is not None and native.keys(tokens) != python.keys(tokens):
                raise AssertionError(f"{name} page {ps}: native keys differ from the Python loop")
            native_ms = None if native is None else \
                _median_ms(lambda k=native: k.keys(tokens), args.repeat)
            python_ms = _median_ms(lambda k=python: k.keys(tokens), args.repeat)
            floor_ms = _median_ms(lambda h=h, n=n, b=b"\x01" * (32 + 4 * ps): _bare(h, n, b),
                                  args.repeat)
            ms = python_ms if native_ms is None else native_ms     # what PageKeyer uses
            results.append({"hash": name, "page_size": ps, "pages": n,
                            "implementation": "python" if native is None else "native",
                            "keys_ms": ms, "native_ms": native_ms, "python_ms": python_ms,
                            "bare_ms": floor_ms, "us_per_page": ms * 1e3 / n,
                            "meets_target": ms <= args.target_ms})
            rows.append([name, ps, n, _fmt(native_ms), _fmt(python_ms), f"{floor_ms:.3f}",
                         f"{ms * 1e3 / n:.3f}",
                         "-" if native_ms is None else f"{floor_ms / native_ms:.2f}",
                         f"{floor_ms / python_ms:.2f}", "yes" if ms <= args.target_ms else "no"])
    print(f"hashing + chaining a {args.tokens}-token prompt (median of {args.repeat}); native = "
          f"kvtier-native-keys (one call per prompt; '-' where not installed or not supporting "
          f"the hash), python = one hash call per page, bare = one hash call per page on a "
          f"block of the same size, no chaining; us/page and the target for the one PageKeyer "
          f"uses")
    print(table(["hash", "page size", "pages", "native ms", "python ms", "bare ms", "us/page",
                 "bare/native", "bare/python", f"<= {args.target_ms:g} ms"], rows))
    for line in skipped:
        print(f"skipped {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "repeat": args.repeat,
                       "target_ms": args.target_ms, "results": results, "skipped": skipped},
                      f, indent=1)
    return 0
