"""Control-plane cost of the controller: match, fetch bookkeeping and commit, per page.

A 128K-token prompt and many small requests run against a `TieredKVCache` over a KV geometry
so small that moving a page costs next to nothing, so the times are the controller's own
(hashing, index walks, pins, LRU, eviction, scheduling). In the same run the benchmark
measures two references: bare page-key hashing of the same prompt (the floor every path
pays) and copying one page of a real model's KV (host memory, same page size) -- the data
work a page's control overhead is weighed against.

``kvtier --config FILE bench control`` (or ``$KVTIER_CONFIG``) builds every cache with the
file's ``[cache]`` settings, but for those each scenario sets itself (`_SCENARIO_FIELDS`: the
tiers, their sizes and the policies it measures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Mapping

import numpy as np
import torch

from kvtier.report import progress, table
from kvtier.spec import KVSpec


#: CacheConfig fields each scenario sets itself; a config file's values for them do not apply
#: (``host_pool_bytes`` and ``host_pool_ratio`` would size the host pool the scenario sizes).
_SCENARIO_FIELDS = ("model_id", "host_pool_pages", "host_pool_bytes", "host_pool_ratio",
                    "write_policy", "prefetch_policy", "l3_store", "l3_config")


def rig_config(host_pages: int, *, write_policy: str, l3: str | None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A scenario's cache config: ``extra`` (a config file's ``[cache]`` table) under the
    scenario's own fields."""
    cfg = {k: v for k, v in (extra or {}).items() if k not in _SCENARIO_FIELDS}
    cfg.update({"model_id": "bench-control", "host_pool_pages": host_pages,
                "write_policy": write_policy, "prefetch_policy": "wait_complete",
                "l3_store": l3, "l3_config": {"capacity_bytes": 1 << 30} if l3 else {}})
    return cfg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=131072, help="long prompt (default 128K)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--small-requests", type=int, default=500,
                   help="number of small requests (default 500)")
    p.add_argument("--small-tokens", type=int, default=2048,
                   help="tokens per small request (default 2048; half shared)")
    p.add_argument("--repeat", type=int, default=7, help="repetitions (median reported)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the L1 pool (cpu, cuda, ...); default cpu")
    p.add_argument("--ref-layers", type=int, default=32, help="reference model: layers")
    p.add_argument("--ref-kv-heads", type=int, default=8, help="reference model: KV heads")
    p.add_argument("--ref-head-dim", type=int, default=128, help="reference model: head dim")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the table (and the reference page copy) as JSON")


def _median(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None
            ) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Rig:
    """A cache over a tiny geometry plus the engine side (free list of device pages)."""

    def __init__(self, page_size: int, device_pages: int, host_pages: int, *,
                 write_policy: str, l3: str | None, device: str = "cpu",
                 extra: Mapping[str, Any] | None = None):
        from kvtier.cache import TieredKVCache
        from kvtier.device_pool import DeviceKVPool
        from kvtier.page_allocator import PageAllocator
        self.spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size,
                               dtype="uint8")
        self.alloc = PageAllocator(device_pages)
        self.cache = TieredKVCache.from_config(
            rig_config(host_pages, write_policy=write_policy, l3=l3, extra=extra),
            device_pool=DeviceKVPool.empty(self.spec, device_pages, device),
            allocate_device_pages=self.alloc.alloc, free_device_pages=self.alloc.free)

    def pages(self, n: int) -> list[int]:
        got = self.alloc.alloc(n)
        if got is None:
            self.cache.evict(n - self.alloc.free_count)
            got = self.alloc.alloc(n)
        assert got is not None, "benchmark rig too small"
        return got

    def request(self, tokens: np.ndarray, acc: dict[str, float] | None = None) -> None:
        """One engine request: match (+ prefetch), wait for L3 reads, fetch, wait for the
        load, 'prefill' the rest, commit, release. ``acc`` sums the seconds of the
        controller's calls ("control") apart from waits for data and engine-side page
        allocation ("data")."""
        c = self.cache
        t0 = time.perf_counter()
        m = c.match(tokens)
        c.prefetch(m)
        t1 = time.perf_counter()
        while not c.prefetch_ready(m):            # L3 -> L2 reads: data, not control
            time.sleep(20e-6)
        t2 = time.perf_counter()
        dev = self.pages(m.pages_to_load)
        t3 = time.perf_counter()
        h = c.fetch(m, dev)
        t4 = time.perf_counter()
        h.wait()
        if dev:
            h.done()
        t5 = time.perf_counter()
        n = len(m.keys) - m.l1_count - h.pages_loaded
        new = self.pages(n)
        t6 = time.perf_counter()
        c.commit(tokens, m.l1_pages + h.device_pages + new, match=m)
        left = c.release(m)
        t7 = time.perf_counter()
        self.alloc.free(left)
        if acc is not None:
            acc["control"] += (t1 - t0) + (t4 - t3) + (t7 - t6)
            acc["data"] += (t2 - t1) + (t3 - t2) + (t5 - t4) + (t6 - t5)

    def close(self) -> None:
        self.cache.close()


def _long_prompt(args: argparse.Namespace, tokens: np.ndarray, rows: list, hash_s: float,
                 page_copy_s: float) -> None:
    n = len(tokens) // args.page_size

    def row(name: str, seconds: float, pages: int = n) -> None:
        us = seconds * 1e6 / max(pages, 1)
        rows.append([name, pages, f"{seconds * 1e3:.3f}", f"{us:.2f}",
                     f"{seconds / hash_s:.2f}", f"{100 * us * 1e-6 / page_copy_s:.2f}"])

    for policy in ("write_back", "write_through"):
        rig = _Rig(args.page_size, 2 * n + 8, 2 * n + 8, write_policy=policy, l3=None,
                   device=args.device, extra=getattr(args, "cache_file", None))
        try:
            _long_prompt_on(rig, args, tokens, policy, row)
        finally:
            rig.close()


def _long_prompt_on(rig: _Rig, args: argparse.Namespace, tokens: np.ndarray, policy: str,
                    row: Callable[..., None]) -> None:
    c = rig.cache
    n = len(tokens) // args.page_size
    k = f"{len(tokens) // 1024}K"
    state: dict[str, Any] = {}

    def fresh() -> None:                      # empty cache, pages for the whole prompt
        c.wait_idle()
        for m in state.pop("ms", []):
            rig.alloc.free(c.release(m))
        c.evict(10 * n)
        c.evict(10 * n, tier="l2")
        state["m"] = c.match(tokens)
        state["pages"] = rig.pages(n)

    def commit() -> None:
        c.commit(tokens, state["pages"], match=state["m"])
        state["ms"] = [state["m"]]

    row(f"commit {k}, new pages ({policy})", _median(commit, args.repeat, fresh))
    if policy == "write_back":
        def cold() -> None:
            c.release(c.match(tokens))
        fresh()
        row(f"match + release {k}, all miss", _median(cold, args.repeat))
        return
    c.wait_idle()

    def hot() -> None:
        c.release(c.match(tokens))
    row(f"match + release {k}, all L1", _median(hot, args.repeat))

    def recommit() -> None:
        m = c.match(tokens)
        c.commit(tokens, m.l1_pages, match=m)
        c.release(m)
    row(f"match + commit + release {k}, all L1", _median(recommit, args.repeat))

    def to_l2() -> None:                      # everything in L2 only
        c.wait_idle()
        c.evict(10 * n)
    fetch_t: list[float] = []

    def l2_fetch() -> None:
        m = c.match(tokens)
        dev = rig.pages(m.pages_to_load)
        t0 = time.perf_counter()
        h = c.fetch(m, dev)
        fetch_t.append(time.perf_counter() - t0)
        h.wait()
        rig.alloc.free(c.release(m))
    row(f"match + fetch + wait + release {k}, all L2", _median(l2_fetch, args.repeat, to_l2))
    row("  of which the fetch() call", statistics.median(fetch_t))


def _small_requests(args: argparse.Namespace, rows: list, page_copy_s: float) -> None:
    ps = args.page_size
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 150000, size=args.small_tokens // 2, dtype=np.int64)
    reqs = [np.concatenate([shared, rng.integers(0, 150000, size=args.small_tokens -
                                                  len(shared), dtype=np.int64)])
            for _ in range(args.small_requests)]
    per = args.small_tokens // ps
    total = per * args.small_requests
    # L1 holds a quarter of the working set. Without L3 the L2 holds all of it (pass 2 hits
    # L2); with L3 the L2 holds another quarter (pass 2 hits L3 too).
    for l2_pages, l3 in ((total + 8, None), (max(total // 4, 8), "memory")):
        rig = _Rig(ps, max(total // 4, 4 * per), l2_pages, write_policy="write_through", l3=l3,
                   device=args.device, extra=getattr(args, "cache_file", None))
        try:
            _small_on(rig, args, reqs, rows, l3, page_copy_s)
        finally:
            rig.close()


def _small_on(rig: _Rig, args: argparse.Namespace, reqs: list, rows: list, l3: str | None,
              page_copy_s: float) -> None:
    runs = []
    for _ in range(2):                        # pass 1: all new; pass 2: hits in every tier
        acc = {"control": 0.0, "data": 0.0}
        t0 = time.perf_counter()
        for r in reqs:
            rig.request(r, acc)
        rig.cache.wait_idle()
        runs.append((time.perf_counter() - t0, acc))
    mt = rig.cache.metrics()
    name = f"{args.small_requests} x {args.small_tokens}-token requests, L3 {l3 or 'none'}"
    pages = args.small_requests * (args.small_tokens // args.page_size)
    for label, (wall, acc) in zip(("pass 1 (cold)", "pass 2 (warm)"), runs):
        for what, s in ((f"{label}: match+fetch+commit+release calls", acc["control"]),
                        (f"{label}: wall, background work and data waits included", wall)):
            us = s * 1e6 / pages
            rows.append([f"{name}, {what}", pages, f"{s * 1e3:.1f}", f"{us:.2f}", "-",
                         f"{100 * us * 1e-6 / page_copy_s:.2f}"])
    hits = {t: mt.get(f"{t}_hit_pages", 0) for t in ("l1", "l2", "l3")}
    rows.append([f"  pages over both passes: L1 hit {hits['l1']}, L2 hit {hits['l2']}, "
                 f"L3 hit {hits['l3']}, miss {mt.get('miss_pages', 0)}", "", "", "", "", ""])


def _page_copy_s(nbytes: int, device: str) -> tuple[float, str]:
    """Seconds to move one reference page, measured here: a pinned host-to-device copy timed
    with device events on an accelerator; else a host copy out of a buffer far larger than
    the CPU caches (a cache-hot copy would flatter the data path)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(times[5:]), "loaded host-to-device (pinned)"
    n = max(2, (512 << 20) // nbytes)
    src = torch.randint(0, 255, (n, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(2 * n):
        t0 = time.perf_counter()
        dst[(i * 7 + 3) % n].copy_(src[i % n])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[n:]), "copied host-to-host, cold cache"


def run(args: argparse.Namespace) -> int:
    from kvtier.cache.config import CacheConfig
    from kvtier.keys import PageKeyer
    # `kvtier --config FILE bench control`: every value checked before anything is measured
    file = CacheConfig.file_settings()
    if file:
        CacheConfig.from_dict({"model_id": "bench-control", **file})
        for l3 in (None, "memory"):
            CacheConfig.from_dict(rig_config(8, write_policy="write_through", l3=l3,
                                             extra=file))
    args.cache_file = file
    applied = {k: v for k, v in file.items() if k not in _SCENARIO_FIELDS}
    ps = args.page_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150000, size=args.tokens, dtype=np.int64)
    n = args.tokens // ps
    tiny = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, page_size=ps, dtype="uint8")
    keyer = PageKeyer(model_id="bench-control", spec=tiny)
    hash_s = _median(lambda: keyer.keys(tokens), max(args.repeat, 11))
    ref = KVSpec.mha(num_layers=args.ref_layers, num_kv_heads=args.ref_kv_heads,
                     head_dim=args.ref_head_dim, page_size=ps, dtype="bfloat16")
    page_copy_s, what = _page_copy_s(ref.page_bytes, args.device)
    rows: list = [["page keys only (hashing floor)", n, f"{hash_s * 1e3:.3f}",
                   f"{hash_s * 1e6 / n:.2f}", "1.00",
                   f"{100 * hash_s / n / page_copy_s:.2f}"]]
    steps = [lambda: _long_prompt(args, tokens, rows, hash_s, page_copy_s),
             lambda: _small_requests(args, rows, page_copy_s)]
    for step in progress(steps, desc="control-plane scenarios"):
        step()
    print(f"control plane, L1 on {args.device}, page size {ps}, median of {args.repeat}; "
          f"reference: one {ref.page_bytes / 2**20:.1f} MiB page ({args.ref_layers} layers x "
          f"{args.ref_kv_heads} KV heads x {args.ref_head_dim} bf16) {what} in "
          f"{page_copy_s * 1e6:.0f} us ({ref.page_bytes / page_copy_s / 1e9:.1f} GB/s)")
    if applied:
        print("config file settings: " + ", ".join(f"{k}={v!r}" for k, v in applied.items()))
    header = ["scenario", "pages", "ms", "us/page", "x hashing", "% of moving a page"]
    print(table(header, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "page_size": ps, "repeat": args.repeat,
                       "page_copy_s": page_copy_s, "page_copy": what,
                       "page_bytes": ref.page_bytes, "cache_config": applied,
                       "rows": [dict(zip(header, r)) for r in rows]}, f, indent=2,
                      default=str)
    return 0
