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
from typing import Any, Mapping, Sequence

import numpy as np

from kvtier.errors import ConfigError, InvalidArgumentError, show_value
from kvtier.page_allocator import PageAllocator

#: Tokens per trace block (the Mooncake format's 512).
BLOCK_TOKENS = 512
#: Hash ids are below this: block b's tokens b*512 .. b*512+511 must fit in uint32.
HASH_ID_LIMIT = 2**32 // BLOCK_TOKENS
#: Upper bound of page counts (as `kvtier.cache.config.MAX_COUNT`) and of a pool's bytes.
MAX_PAGES = MAX_POOL_BYTES = 2**48
#: CacheConfig fields the replay sets itself (the L2 size, the L3 store): a config file's
#: values for them do not apply; ``host_pool_bytes`` and ``host_pool_ratio`` would size the
#: L2 that ``l2_pages`` sizes.
_REPLAY_FIELDS = ("host_pool_pages", "host_pool_bytes", "host_pool_ratio", "l3_store",
                  "l3_config")

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
    if len(hash_ids) and not (0 <= min(hash_ids) and max(hash_ids) < HASH_ID_LIMIT):
        raise InvalidArgumentError("hash ids must be in [0, 2**23) to map to uint32 tokens",
                                   argument="hash_ids")
    ids = np.asarray(hash_ids, dtype=np.int64)
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


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise ConfigError(f"limit must be an int >= 1 or None, got {show_value(limit)}",
                          key="limit", value=limit)


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace through `kvtier_tools.trace.read_trace` (typed errors naming the file
    and line; an empty trace warns and gives no request). A hash id of 2**23 or more (its
    block's token ids would not fit in uint32) is a `TraceFormatError` naming the line."""
    from .trace import TraceFormatError, read_trace
    _check_limit(limit)
    source = str(path)
    out = []
    for r in read_trace(path, max_requests=limit, source_block=BLOCK_TOKENS, allow_empty=True):
        big = next((i for i, h in enumerate(r.hash_ids) if h >= HASH_ID_LIMIT), None)
        if big is not None:
            raise TraceFormatError(f"{source}:{r.line}: hash_ids[{big}] = {r.hash_ids[big]} "
                                   f"is not below 2**23, the most whose {BLOCK_TOKENS} token "
                                   "ids fit in uint32", source=source, line=r.line,
                                   field="hash_ids")
        out.append(TraceRequest(r.timestamp, r.input_length, r.output_length, r.hash_ids))
    return out


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
    from kvtier.interfaces import L3_STORES
    from kvtier.registry import get_backend_class
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
    from kvtier.registry import create_l3_store
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


def replay_config(cache_config: Mapping[str, Any] | None, *, l2_pages: int,
                  write_policy: str | None = None, prefetch_policy: str | None = None
                  ) -> dict[str, Any]:
    """The replay's CacheConfig as a dict, checked: ``cache_config`` (a config file's
    ``[cache]`` table) under the replay's own settings; ``write_policy`` and
    ``prefetch_policy`` win where given (else the file's, else write_through and
    wait_complete); the L2 size and the L3 store are always the replay's."""
    from kvtier.cache import CacheConfig
    if cache_config:                    # every value checked, those the replay overrides too
        CacheConfig.from_dict({"model_id": "kvtier-simulate", **cache_config})
    base = {k: v for k, v in dict(cache_config).items() if k not in _REPLAY_FIELDS} \
        if cache_config else {}
    cfg: dict[str, Any] = {"model_id": "kvtier-simulate", **base, "host_pool_pages": l2_pages}
    cfg["write_policy"] = write_policy or base.get("write_policy", "write_through")
    cfg["prefetch_policy"] = prefetch_policy or base.get("prefetch_policy", "wait_complete")
    CacheConfig.from_dict(cfg)
    return cfg


def _check_count(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_PAGES:
        raise ConfigError(f"{name} must be an int in [1, 2**48], got {show_value(v)}",
                          key=name, value=v)


def _check_sizes(l1_pages: Any, l2_pages: Any, l3_pages: Any, page_size: Any) -> None:
    for name, v in (("l1_pages", l1_pages), ("l2_pages", l2_pages), ("l3_pages", l3_pages)):
        if v is not None or name != "l3_pages":
            _check_count(name, v)
    if isinstance(page_size, bool) or not isinstance(page_size, int) \
            or not 0 < page_size <= 2**20:
        raise ConfigError(f"page_size must be an int in [1, 2**20], got "
                          f"{show_value(page_size)}", key="page_size", value=page_size)


def simulate(trace: str | Path | Sequence[TraceRequest], *, l1_pages: int, l2_pages: int,
             l3: str | None = None, l3_pages: int | None = None,
             l3_config: dict[str, Any] | None = None, page_size: int = 64,
             write_policy: str | None = None, prefetch_policy: str | None = None,
             limit: int | None = None, count_only_l1: bool = False,
             show_progress: bool = True, desc: str = "replay",
             cache_config: Mapping[str, Any] | None = None) -> SimResult:
    """Replay ``trace`` through an L1 of ``l1_pages``, an L2 of ``l2_pages`` and the L3 store
    ``l3`` (None: no L3) of ``l3_pages`` pages; pages of ``page_size`` tokens.

    ``count_only_l1`` counts L2/L3 hits as computed (with a one-page L2 and no L3 this is the
    L1-only baseline: L1's contents evolve as if the lower tiers were absent).
    ``cache_config``: further CacheConfig fields (a config file's ``[cache]`` table) under
    the replay's own (`replay_config`); checked before anything is allocated.
    """
    from kvtier.cache.config import CacheConfig
    from kvtier.device_pool import DeviceKVPool
    from kvtier.spec import KVSpec

    _check_sizes(l1_pages, l2_pages, l3_pages, page_size)
    if l3 is None and (l3_pages is not None or l3_config):
        raise ConfigError("l3_pages/l3_config need an l3 store", key="l3")
    _check_limit(limit)
    cfg = replay_config(cache_config, l2_pages=l2_pages, write_policy=write_policy,
                        prefetch_policy=prefetch_policy)
    write_policy, prefetch_policy = cfg["write_policy"], cfg["prefetch_policy"]
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size,
                      dtype="uint8")
    for name, pages in (("l1_pages", l1_pages), ("l2_pages", l2_pages)):
        if pages * spec.page_bytes > MAX_POOL_BYTES:
            raise ConfigError(f"{name}: {pages} pages of {spec.page_bytes} bytes is more than "
                              f"the {MAX_POOL_BYTES} bytes (256 TiB) a pool may have",
                              key=name, value=pages)
    reqs = load_trace(trace, limit) if isinstance(trace, (str, Path)) else list(trace)[:limit]
    device_pool = DeviceKVPool.empty(spec, l1_pages)
    alloc = PageAllocator(l1_pages)
    host_pool = store = None
    if l3 is not None:
        # the cache's default pool and the store are made here, so that the store's capacity
        # is counted in its real object size
        from kvtier.host_pool import HostKVPool
        from kvtier.registry import create_host_allocator
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
    applied = {k: v for k, v in cfg.items() if k in (cache_config or {})}
    if applied:
        res.settings["cache_config"] = applied
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
    from kvtier.cache import TieredKVCache
    from kvtier.report import progress
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
    p.add_argument("--write-policy", default=None,
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="(default: write_through; the config file's write_policy if it "
                   "sets one)")
    p.add_argument("--prefetch-policy", default=None,
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="(default: wait_complete; the config file's prefetch_policy if it "
                   "sets one)")
    p.add_argument("--limit", type=int, default=None,
                   help="replay only the first N requests (N >= 1)")
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


def _l3_settings(args: argparse.Namespace, file: Mapping[str, Any]
                 ) -> tuple[str | None, dict[str, Any] | None]:
    """The L3 store and its config: the flags', else the config file's (its ``l3_config``
    only for its own ``l3_store``, or with no store named there)."""
    from kvtier.config import parse_json
    l3 = args.l3 if args.l3 is not None else file.get("l3_store") or None
    l3_config = None
    if args.l3_config:
        l3_config = parse_json(args.l3_config, "--l3-config")
        if not isinstance(l3_config, dict):
            raise ConfigError(f"--l3-config must be a JSON object, got "
                              f"{show_value(args.l3_config)}", key="l3_config",
                              value=args.l3_config)
    elif l3 is not None and file.get("l3_store") in (None, l3) and file.get("l3_config"):
        l3_config = dict(file["l3_config"])
    if l3 is None and (args.l3_pages is not None or l3_config):
        raise ConfigError("--l3-pages/--l3-config need --l3 NAME", key="l3")
    return l3, l3_config


def run(args: argparse.Namespace) -> int:
    from kvtier.cache.config import CacheConfig
    from kvtier.report import table
    _check_limit(args.limit)
    _check_sizes(args.l1_pages, args.l2_pages, args.l3_pages, args.page_size)
    # `kvtier --config FILE simulate` (or $KVTIER_CONFIG): the file's [cache] table under the
    # flags, checked before the trace is read
    file = CacheConfig.file_settings()
    l3, l3_config = _l3_settings(args, file)
    replay_config(file, l2_pages=args.l2_pages, write_policy=args.write_policy,
                  prefetch_policy=args.prefetch_policy)
    if args.trace is None:
        reqs = sample_trace(args.sample_requests)[:args.limit]
        if not args.json:
            print(f"no --trace: a generated sample workload of {len(reqs)} requests "
                  f"(conversations behind shared system prompts)")
    else:
        reqs = load_trace(args.trace, args.limit)
    common = dict(page_size=args.page_size, write_policy=args.write_policy,
                  prefetch_policy=args.prefetch_policy, cache_config=file)
    results = [("tiers", simulate(reqs, l1_pages=args.l1_pages, l2_pages=args.l2_pages,
                                  l3=l3, l3_pages=args.l3_pages, l3_config=l3_config,
                                  desc="replay (tiers)", **common))]
    if args.baseline:
        results.append(("L1 only", simulate(reqs, l1_pages=args.l1_pages, l2_pages=1,
                                            count_only_l1=True, desc="replay (L1 only)",
                                            **common)))
    if args.plot:
        plot(results, args.plot, f"kvtier simulate: L1 {args.l1_pages}, L2 {args.l2_pages}, "
             f"L3 {l3 or 'none'} (pages of {args.page_size} tokens)")
    if args.json:
        print(json.dumps({name: r.as_dict() for name, r in results}, indent=2, default=str))
        return 0
    res = results[0][1]
    print(f"{res.requests} requests, {res.prompt_tokens} prompt tokens, page {args.page_size} "
          f"tokens; L1 {args.l1_pages} pages, L2 {args.l2_pages} pages, L3 "
          f"{l3 or 'none'}" + (f" {args.l3_pages} pages" if args.l3_pages else ""))
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

