"""Trace replay through the real tiers, without model compute: per-tier hit rates for given
tier sizes (``kvtier simulate``), for sizing a deployment and for the demo.

A trace is JSON lines in the Mooncake format: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block; equal ids = equal content).
Block ``b`` becomes the 512 token ids ``b*512 .. b*512+511`` (distinct blocks never share a
token sequence); the last block is cut to ``input_length``. Each request runs the engine's
sequence against a `TieredKVCache` over a tiny KV geometry (one layer, one byte per row, so
pages move for real but cost nothing): match, fetch the L2/L3 hit into L1, "prefill" the
rest (allocate pages, no compute), commit, release. Requests run one after another, each
after the previous one's background writes finished, so a run is deterministic.

Alongside, the same run counts the hit rate of an unbounded cache (every page ever committed
stays): the ceiling any tier sizing can reach.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError, InvalidArgumentError
from .page_allocator import PageAllocator

#: Tokens per trace block (the Mooncake format's 512).
BLOCK_TOKENS = 512

__all__ = ["BLOCK_TOKENS", "PageAllocator", "SimResult", "TraceRequest", "block_tokens",
           "sample_trace",
           "l3_config_for", "load_trace", "simulate", "add_arguments", "run"]


# --------------------------------------------------------------------------------------------
# Trace
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self) -> np.ndarray:
        """The prompt's token ids (uint32): block b -> b*512 .. b*512+511, cut to length."""
        return block_tokens(self.hash_ids, self.input_length)


def block_tokens(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or (int(ids.max()) + 1) * BLOCK_TOKENS > 2**32):
        raise InvalidArgumentError("hash ids must be in [0, 2**23) to map to uint32 tokens",
                                   argument="hash_ids")
    if not 0 <= input_length <= ids.size * BLOCK_TOKENS:
        raise InvalidArgumentError(f"input_length {input_length} does not fit {ids.size} "
                                   f"blocks of {BLOCK_TOKENS} tokens", argument="input_length",
                                   value=input_length)
    toks = (ids[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS, dtype=np.int64)).ravel()
    return toks[:input_length].astype(np.uint32)


def sample_trace(num_requests: int = 600, *, seed: int = 0) -> list[TraceRequest]:
    """A generated Mooncake-format workload, so `kvtier simulate` runs without a trace file:
    conversations behind a few shared system prompts, each turn resending the history plus a
    new user message (1-3 blocks), interleaved at random; deterministic for a seed."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ConfigError(f"sample requests must be an int >= 1, got {num_requests!r}",
                          key="sample_requests", value=num_requests)
    rng = np.random.default_rng(seed)
    next_id = 0

    def blocks(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    systems = [blocks(int(rng.integers(2, 6))) for _ in range(4)]
    live: list[list[int]] = []
    out: list[TraceRequest] = []
    t = 0.0
    while len(out) < num_requests:
        if not live or (len(live) < 24 and rng.random() < 0.3):
            live.append(list(systems[int(rng.integers(len(systems)))]))
        k = int(rng.integers(len(live)))
        conv = live[k]
        conv += blocks(int(rng.integers(1, 4)))
        n_tok = len(conv) * BLOCK_TOKENS - int(rng.integers(0, BLOCK_TOKENS))
        t += float(rng.exponential(200.0))
        out.append(TraceRequest(round(t, 3), n_tok, int(rng.integers(16, 512)), tuple(conv)))
        conv += blocks(1)                                   # the answer joins the history
        if len(conv) > 24 or rng.random() < 0.08:           # the conversation ends
            live.pop(k)
    return out


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace through `kvtier.trace.read_trace` (typed errors naming the file
    and line; an empty trace warns and gives no request)."""
    from .trace import read_trace
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise ConfigError(f"limit must be an int >= 1 or None, got {limit!r}", key="limit",
                          value=limit)
    return [TraceRequest(r.timestamp, r.input_length, r.output_length, r.hash_ids)
            for r in read_trace(path, max_requests=limit, source_block=BLOCK_TOKENS,
                                allow_empty=True)]


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------
@dataclass
class SimResult:
    """Token counts of one replay; rates are fractions of all prompt tokens."""

    requests: int = 0
    skipped: int = 0                     # requests larger than L1 (cannot run at all)
    prompt_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    computed_tokens: int = 0
    ideal_hit_tokens: int = 0            # an unbounded cache, same page size
    elapsed_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_tokens(self) -> int:
        return self.l1_hit_tokens + self.l2_hit_tokens + self.l3_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.rate(self.hit_tokens)

    @property
    def ideal_hit_rate(self) -> float:
        return self.rate(self.ideal_hit_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "skipped": self.skipped,
                "prompt_tokens": self.prompt_tokens, "l1_hit_tokens": self.l1_hit_tokens,
                "l2_hit_tokens": self.l2_hit_tokens, "l3_hit_tokens": self.l3_hit_tokens,
                "computed_tokens": self.computed_tokens, "hit_rate": self.hit_rate,
                "l1_hit_rate": self.rate(self.l1_hit_tokens),
                "l2_hit_rate": self.rate(self.l2_hit_tokens),
                "l3_hit_rate": self.rate(self.l3_hit_tokens),
                "ideal_hit_rate": self.ideal_hit_rate, "elapsed_s": self.elapsed_s,
                "settings": self.settings}


def l3_config_for(store: str, pages: int | None, page_bytes: int,
                  base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` plus a capacity of ``pages`` pages for stores whose Config has
    ``capacity_bytes`` (memory, file, ...); a ConfigError for stores without one."""
    cfg = dict(base or {})
    if pages is None:
        return cfg
    from .interfaces import L3_STORES
    from .registry import get_backend_class
    cls = get_backend_class(L3_STORES, store)
    fields = getattr(cls.Config, "__dataclass_fields__", {})
    if "capacity_bytes" not in fields:
        raise ConfigError(f"l3 store {store!r} has no capacity_bytes setting; size it through "
                          "its own config", key="l3_pages", value=pages)
    cfg["capacity_bytes"] = pages * page_bytes
    return cfg


def _sized_store(store: str, pages: int | None, base: dict[str, Any] | None, spec: Any,
                 host_pool: Any) -> Any:
    """The L3 store, attached to ``host_pool``, holding ``pages`` pages: its capacity is
    counted in what one stored page really takes there (`L3Store.object_nbytes`: the file
    store's objects carry a trailer and may be padded), measured on a first instance."""
    from .registry import create_l3_store
    per_page = spec.page_bytes
    if pages is not None:
        l3_config_for(store, pages, per_page, base)           # checks the store has a capacity
        probe = create_l3_store(store, dict(base or {}), spec=spec)
        try:
            probe.attach(host_pool)
            per_page = probe.object_nbytes()
        finally:
            probe.close()
    s = create_l3_store(store, l3_config_for(store, pages, per_page, base), spec=spec)
    try:
        s.attach(host_pool)
    except BaseException:
        s.close()
        raise
    return s


def simulate(trace: str | Path | Sequence[TraceRequest], *, l1_pages: int, l2_pages: int,
             l3: str | None = None, l3_pages: int | None = None,
             l3_config: dict[str, Any] | None = None, page_size: int = 64,
             write_policy: str = "write_through", prefetch_policy: str = "wait_complete",
             limit: int | None = None, count_only_l1: bool = False,
             show_progress: bool = True, desc: str = "replay") -> SimResult:
    """Replay ``trace`` through an L1 of ``l1_pages``, an L2 of ``l2_pages`` and the L3 store
    ``l3`` (None: no L3) of ``l3_pages`` pages; pages of ``page_size`` tokens.

    ``count_only_l1`` counts L2/L3 hits as computed (with a one-page L2 and no L3 this is the
    L1-only baseline: L1's contents evolve as if the lower tiers were absent).
    """
    from .cache import CacheConfig
    from .device_pool import DeviceKVPool
    from .spec import KVSpec

    for name, v in (("l1_pages", l1_pages), ("l2_pages", l2_pages), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name} must be a positive int, got {v!r}", key=name, value=v)
    if l3 is None and (l3_pages is not None or l3_config):
        raise ConfigError("l3_pages/l3_config need an l3 store", key="l3")
    if l3_pages is not None and (isinstance(l3_pages, bool) or not isinstance(l3_pages, int)
                                 or l3_pages <= 0):
        raise ConfigError(f"l3_pages must be a positive int, got {l3_pages!r}",
                          key="l3_pages", value=l3_pages)
    reqs = load_trace(trace, limit) if isinstance(trace, (str, Path)) else list(trace)[:limit]
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size,
                      dtype="uint8")
    device_pool = DeviceKVPool.empty(spec, l1_pages)
    alloc = PageAllocator(l1_pages)
    cfg: dict[str, Any] = {
        "model_id": "kvtier-simulate", "host_pool_pages": l2_pages,
        "write_policy": write_policy, "prefetch_policy": prefetch_policy}
    host_pool = store = None
    if l3 is not None:
        # the cache's default pool and the store are made here, so that the store's capacity
        # is counted in its real object size
        from .host_pool import HostKVPool
        from .registry import create_host_allocator
        c = CacheConfig.from_dict(cfg)
        host_pool = HostKVPool(spec, l2_pages, layout=c.host_layout, allocator=(
            create_host_allocator(c.host_allocator, c.host_allocator_config)))
        try:
            store = _sized_store(l3, l3_pages, l3_config, spec, host_pool)
        except BaseException:
            host_pool.close()
            raise
    res = SimResult(settings={"l1_pages": l1_pages, "l2_pages": l2_pages, "l3": l3,
                              "l3_pages": l3_pages, "page_size": page_size,
                              "write_policy": write_policy, "prefetch_policy": prefetch_policy,
                              "count_only_l1": count_only_l1})
    t0 = time.perf_counter()
    try:
        _replay(reqs, cfg, res, device_pool, alloc, host_pool, store, page_size,
                count_only_l1, show_progress, desc)
    finally:
        if store is not None:
            store.close()
        if host_pool is not None:
            host_pool.close()
    res.elapsed_s = time.perf_counter() - t0
    return res


def _replay(reqs: Sequence[TraceRequest], cfg: dict[str, Any], res: SimResult,
            device_pool: Any, alloc: PageAllocator, host_pool: Any, store: Any,
            page_size: int, count_only_l1: bool, show_progress: bool, desc: str) -> None:
    from .cache import TieredKVCache
    from .report import progress
    l1_pages = device_pool.num_pages
    seen: set[bytes] = set()
    with TieredKVCache.from_config(cfg, device_pool=device_pool, free_device_pages=alloc.free,
                                   allocate_device_pages=alloc.alloc, host_pool=host_pool,
                                   store=store) as cache:

        def take(n: int) -> list[int] | None:
            if n == 0:
                return []
            pages = alloc.alloc(n)
            if pages is None:
                cache.evict(n - alloc.free_count)
                pages = alloc.alloc(n)
            return pages

        for req in progress(reqs, desc=desc, disable=not show_progress):
            tokens = req.tokens()
            m = cache.match(tokens)
            n_full = len(m.keys)
            res.requests += 1
            res.prompt_tokens += req.input_length
            ideal = 0
            for k in m.keys:
                if k not in seen:
                    break
                ideal += 1
            seen.update(m.keys)
            res.ideal_hit_tokens += ideal * page_size
            if n_full > l1_pages:
                res.skipped += 1
                res.computed_tokens += req.input_length
                alloc.free(cache.release(m))
                continue
            dev = take(m.pages_to_load)
            h = cache.fetch(m, dev if dev is not None else [])
            h.wait()
            loaded = h.pages_loaded
            need = n_full - m.l1_count - loaded
            new = list(h.unused_pages[:need])    # the rest of unused_pages: release gives back
            more = take(need - len(new))
            if more is None:            # pinned prefix + this request exceed L1
                res.skipped += 1
                res.computed_tokens += req.input_length
                alloc.free(cache.release(m))
                continue
            cache.commit(tokens, m.l1_pages + h.device_pages + new + more, match=m)
            alloc.free(cache.release(m))
            l1 = m.l1_count * page_size
            l2 = min(loaded, m.l2_count) * page_size
            l3h = loaded * page_size - l2
            if count_only_l1:
                l2 = l3h = 0
            res.l1_hit_tokens += l1
            res.l2_hit_tokens += l2
            res.l3_hit_tokens += l3h
            res.computed_tokens += req.input_length - l1 - l2 - l3h
            cache.wait_idle()
        res.metrics = cache.metrics()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="JSON-lines trace (Mooncake format); "
                   "default: a generated sample workload (--sample-requests)")
    p.add_argument("--sample-requests", type=int, default=600,
                   help="requests of the generated workload when no --trace is given")
    p.add_argument("--l1-pages", type=int, required=True, help="device (L1) pages")
    p.add_argument("--l2-pages", type=int, required=True, help="host (L2) pages")
    p.add_argument("--l3", default=None,
                   help="L3 store name (any registered: memory, file, ...); default none")
    p.add_argument("--l3-pages", type=int, default=None,
                   help="L3 capacity in pages (stores with capacity_bytes)")
    p.add_argument("--l3-config", default=None, help="JSON object for the store's Config")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--prefetch-policy", default="wait_complete",
                   choices=["best_effort", "wait_complete", "timeout"])
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--baseline", action="store_true",
                   help="also replay L1 only (one-page L2, no L3, only L1 hits count)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also write a PNG of the hit rate per tier of every run")


def plot(results: list[tuple[str, "SimResult"]], path: str, title: str) -> str:
    """Stacked L1/L2/L3 hit rate per run, with the unbounded cache's rate marked."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.6, 3.8), dpi=100)
    names = [n for n, _ in results]
    bottom = [0.0] * len(results)
    for tier, color in (("l1", "tab:red"), ("l2", "tab:orange"), ("l3", "tab:green")):
        vals = [100 * r.rate(getattr(r, f"{tier}_hit_tokens")) for _, r in results]
        ax.bar(names, vals, bottom=bottom, color=color, label=f"{tier.upper()} hits")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ideal = [100 * r.ideal_hit_rate for _, r in results]
    ax.scatter(names, ideal, marker="_", s=900, color="black", label="unbounded cache",
               zorder=3)
    ax.set(ylabel="token hit rate (%)", ylim=(0, 105))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from .report import table
    if args.l3_config:
        try:
            l3_config = json.loads(args.l3_config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--l3-config is not JSON: {exc}", key="l3_config") from None
        if not isinstance(l3_config, dict):
            raise ConfigError("--l3-config must be a JSON object", key="l3_config")
    else:
        l3_config = None
    if args.l3 is None and (args.l3_pages is not None or l3_config):
        raise ConfigError("--l3-pages/--l3-config need --l3 NAME", key="l3")
    if args.trace is None:
        reqs = sample_trace(args.sample_requests)[:args.limit]
        if not args.json:
            print(f"no --trace: a generated sample workload of {len(reqs)} requests "
                  f"(conversations behind shared system prompts)")
    else:
        reqs = load_trace(args.trace, args.limit)
    common = dict(page_size=args.page_size, write_policy=args.write_policy,
                  prefetch_policy=args.prefetch_policy)
    results = [("tiers", simulate(reqs, l1_pages=args.l1_pages, l2_pages=args.l2_pages,
                                  l3=args.l3, l3_pages=args.l3_pages, l3_config=l3_config,
                                  desc="replay (tiers)", **common))]
    if args.baseline:
        results.append(("L1 only", simulate(reqs, l1_pages=args.l1_pages, l2_pages=1,
                                            count_only_l1=True, desc="replay (L1 only)",
                                            **common)))
    if args.plot:
        plot(results, args.plot, f"kvtier simulate: L1 {args.l1_pages}, L2 {args.l2_pages}, "
             f"L3 {args.l3 or 'none'} (pages of {args.page_size} tokens)")
    if args.json:
        print(json.dumps({name: r.as_dict() for name, r in results}, indent=2))
        return 0
    res = results[0][1]
    print(f"{res.requests} requests, {res.prompt_tokens} prompt tokens, page {args.page_size} "
          f"tokens; L1 {args.l1_pages} pages, L2 {args.l2_pages} pages, L3 "
          f"{args.l3 or 'none'}" + (f" {args.l3_pages} pages" if args.l3_pages else ""))
    rows = []
    for name, r in results:
        rows.append([name, f"{100 * r.rate(r.l1_hit_tokens):.1f}",
                     f"{100 * r.rate(r.l2_hit_tokens):.1f}",
                     f"{100 * r.rate(r.l3_hit_tokens):.1f}", f"{100 * r.hit_rate:.1f}",
                     f"{100 * r.ideal_hit_rate:.1f}",
                     f"{r.hit_rate / r.ideal_hit_rate:.3f}" if r.ideal_hit_rate else "-",
                     r.skipped, f"{r.elapsed_s:.1f}"])
    print(table(["run", "L1 hit %", "L2 hit %", "L3 hit %", "total hit %",
                 "unbounded %", "total/unbounded", "skipped", "seconds"], rows))
    if len(results) > 1:
        gain = 100 * (results[0][1].hit_rate - results[1][1].hit_rate)
        print(f"tiers vs L1 only: {gain:+.1f} percentage points of hit rate")
    return 0

