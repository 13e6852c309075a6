"""The demo run: one workload replayed through the tier setups -- L1 only, L1+L2 and
L1+L2+L3, then L1+L2+L3 loading every hit (the cost-aware split's alternative) and every page
kept in L1 (the measured ideal) -- with a real model, and the numbers that compare them.

Each setup has its own engine (device pool, cache, store) and serves the same requests in
the same order, one at a time; the model and its weights are shared. The setups take turns
request by request, so a busy or drifting machine slows all of them alike. TTFT is measured
per request from its arrival at the engine to the logits of its first output token: page
match, loads from L2/L3, and the prefill of whatever was not cached.
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from kvtier.cache.cost import pairs
from kvtier.config import build_config
from kvtier.errors import ConfigError
from kvtier.keys import PageKeyer
from .digest import load_known, save_known
from .engine import DemoEngine, RequestResult
from .load import mean_ms
from .model import MODEL_SIZES, CheckFailedError, DemoModel
from .workload import Workload, multiturn

#: L1+L2+L3 with the cost-aware fetch off: every L2/L3 hit loaded. With L1+L2 (nothing loaded
#: from L3) it is what the cost-aware split is judged against, in the same run.
LOAD_ALL = "L1+L2+L3 load all"
#: Every page kept in L1: a device pool that holds the whole workload, nothing ever evicted,
#: no L2/L3. Its speedup over L1 only is the measured ideal; every setup's is a fraction of it.
IDEAL = "ideal (all in L1)"
#: Names of the setups, in the order they run and are shown.
SETUPS = ("L1 only", "L1+L2", "L1+L2+L3", LOAD_ALL, IDEAL)
#: The cost-aware split is flagged when its mean TTFT is this much above the better of
#: loading every L3 hit and loading none.
SPLIT_MARGIN = 0.05


def loads_below_l1(setup: str) -> bool:
    """Does the setup load pages from L2/L3 (False: it reuses L1 hits only)?"""
    return setup in ("L1+L2", "L1+L2+L3", LOAD_ALL)


def has_l3(setup: str) -> bool:
    return setup in ("L1+L2+L3", LOAD_ALL)


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run is built from (the CLI flags map one to one onto it)."""

    model_size: str = "small"
    page_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    workload: Literal["multiturn", "trace", "long"] = "multiturn"
    clients: int = 8
    rounds: int = 8
    first_tokens: int = 1024
    turn_tokens: int = 160
    answer_tokens: int = 96
    system_tokens: int = 0
    trace: str | None = None
    trace_block_tokens: int = 16
    trace_requests: int = 400
    trace_start: int = 0
    #: long: document lengths (None: 8K-32K tokens on accelerators, 1K-4K on CPU)
    long_min_tokens: int | None = None
    long_max_tokens: int | None = None
    #: "logits": real-engine prefill (the suffix in one forward), logits compared with a full
    #: recompute within a tolerance; "bitwise": one page per forward, KV and logits compared
    #: bit for bit (CPU float32). Restored pages are checked against digests in both.
    check_mode: Literal["logits", "bitwise"] = "logits"
    max_forward_tokens: int = 8192
    #: the controller's cost-aware fetch (skip hit pages slower to load than to recompute)
    cost_aware: bool = True
    #: the engine's recompute rate given to the controller (None: measured as it runs)
    recompute_tokens_per_s: float | None = None
    l1_pages: int | None = None          # None: sized so that L1 alone thrashes
    l2_pages: int | None = None          # None: half the workload's distinct pages
    l3_bytes: int | None = None          # None: no limit
    host_allocator: str | None = None    # None: mmap on cpu, torch-pinned elsewhere
    l3_store: str = "file"
    l3_config: dict[str, Any] = field(default_factory=dict)
    transfer_engine: str = "auto"
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    setups: tuple[str, ...] = SETUPS
    seed: int = 0
    check: Literal["all", "sample", "none"] = "sample"
    check_rate: float = 0.1
    out: str = "kvtier-demo-out"
    plot: bool = True
    progress: bool = True
    #: Serve every setup's kvtier metrics at http://metrics_host:PORT/metrics while the demo
    #: runs (0: any free port; None: off).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: A file of page digests read at start (if it exists) and merged into at the end, so
    #: that demo processes sharing one L3 check each other's pages bitwise (None: this
    #: process's own digests only).
    digests: str | None = None
    #: Under load (`kvtier_tools.demo.load`), after the serial replay: Poisson arrivals at these
    #: fractions of the L1-only capacity, at these rates (requests/s), and closed loops of
    #: these many users thinking ``think_ms`` between a first token and their next turn.
    loads: tuple[float, ...] = ()
    rates: tuple[float, ...] = ()
    concurrency: tuple[int, ...] = ()
    think_ms: float = 0.0
    #: Under load: load the next queued request's hits into L1 while the request ahead
    #: prefills (`DemoEngine.preload`); False: every request's loads run at its dispatch.
    #: Off by default: on an H100 it gained nothing (records/l3-staging.md, calls 8-9).
    preload: bool = False
    #: The interpreter's thread switch interval for every setup's cache (milliseconds; the
    #: cache's ``switch_interval_s``): the demo's prefill is launched from Python, and
    #: kvtier's threads run Python beside it. 0: leave CPython's (5 ms). On an H100 the
    #: default 0.1 ms took 13 ms off L1+L2+L3's prefill under load (records/l3-staging.md,
    #: call 11).
    switch_interval_ms: float = 0.1

    def __post_init__(self) -> None:
        from .load import check_positive
        for name in ("loads", "rates", "concurrency"):
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)):
                raise ConfigError(f"{name} must be a list, got {values!r}", key=name,
                                  value=values)
            for v in values:
                check_positive(name, v, integer=name == "concurrency")
        check_positive("think_ms", self.think_ms, zero=True)
        check_positive("switch_interval_ms", self.switch_interval_ms, zero=True)
        if self.switch_interval_ms > 1000:
            raise ConfigError(f"switch_interval_ms must be <= 1000, got "
                              f"{self.switch_interval_ms!r}", key="switch_interval_ms",
                              value=self.switch_interval_ms)
        if self.loads and "L1 only" not in self.setups:
            raise ConfigError("loads are fractions of the L1-only capacity: keep 'L1 only' in "
                              "setups, or give rates in requests/s", key="loads",
                              value=self.loads)
        if self.model_size not in MODEL_SIZES:
            raise ConfigError(f"model_size must be one of {sorted(MODEL_SIZES)}, got "
                              f"{self.model_size!r}", key="model_size", value=self.model_size)
        for name in ("page_size", "clients", "rounds", "first_tokens", "turn_tokens",
                     "trace_block_tokens", "trace_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", key=name,
                                  value=getattr(self, name))
        for name in ("answer_tokens", "system_tokens", "trace_start"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0", key=name, value=getattr(self, name))
        for name in ("l1_pages", "l2_pages", "l3_bytes", "threads", "long_min_tokens",
                     "long_max_tokens", "max_forward_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}", key=name, value=v)
        bad = [s for s in self.setups if s not in SETUPS]
        if bad or not self.setups:
            raise ConfigError(f"setups must be a non-empty subset of {list(SETUPS)}, got "
                              f"{list(self.setups)}", key="setups", value=self.setups)
        if not 0.0 <= self.check_rate <= 1.0:
            raise ConfigError(f"check_rate must be in [0, 1], got {self.check_rate}",
                              key="check_rate", value=self.check_rate)
        if self.recompute_tokens_per_s is not None:
            from kvtier.cache.cost import check_rate
            check_rate("recompute_tokens_per_s", self.recompute_tokens_per_s)
        if self.long_min_tokens and self.long_max_tokens and \
                self.long_max_tokens < self.long_min_tokens:
            raise ConfigError("long_max_tokens must be >= long_min_tokens",
                              key="long_max_tokens", value=self.long_max_tokens)
        if self.workload == "trace" and not self.trace:
            raise ConfigError("--workload trace needs --trace PATH (a Mooncake-format JSONL "
                              "file)", key="trace")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port <= 65535):
            raise ConfigError(f"metrics_port must be an int in [0, 65535], got {port!r}",
                              key="metrics_port", value=port)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DemoConfig":
        return build_config(cls, data, section="demo")


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------
@dataclass
class SetupRun:
    """One setup's replay: per-request results plus the cache's own counters."""

    name: str
    l1_pages: int
    l2_pages: int | None
    l3: str | None
    results: list[RequestResult]
    metrics: dict[str, Any]
    busy_s: float            # sum over requests of TTFT + commit (checks and drains excluded)
    checks: int = 0
    store_stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        res = self.results
        tokens = sum(r.tokens for r in res)
        ttft = np.array([r.ttft_s for r in res])
        m = self.metrics
        pct = lambda x: 100.0 * x / tokens if tokens else 0.0  # noqa: E731
        return {
            "setup": self.name, "requests": len(res), "prompt_tokens": tokens,
            "hit_rate_pct": pct(sum(r.hit_tokens for r in res)),
            "l1_hit_pct": pct(sum(r.l1_tokens for r in res)),
            "l2_hit_pct": pct(sum(r.l2_tokens for r in res)),
            "l3_hit_pct": pct(sum(r.l3_tokens for r in res)),
            "computed_tokens": sum(r.computed_tokens for r in res),
            "loaded_tokens": sum(r.l2_tokens + r.l3_tokens for r in res),
            "reused_l1_tokens": sum(r.l1_tokens for r in res),
            "ttft_mean_ms": 1e3 * float(ttft.mean()) if len(ttft) else 0.0,
            "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)) if len(ttft) else 0.0,
            "load_mean_ms": mean_ms(res, "load_s"), "prefill_mean_ms": mean_ms(res, "prefill_s"),
            "bytes_h2d": int(m.get("bytes_h2d", 0)), "bytes_d2h": int(m.get("bytes_d2h", 0)),
            "bytes_l3_read": int(m.get("bytes_l3_read", 0)),
            "bytes_l3_written": int(m.get("bytes_l3_written", 0)),
            "store_errors": int(m.get("store_errors", 0)),
            "l1_evictions": int(m.get("l1_evictions", 0)),
            "checks_passed": self.checks, "busy_s": self.busy_s,
            "l1_pages": self.l1_pages, "l2_pages": self.l2_pages, "l3": self.l3,
            "skipped_tokens": sum(r.skipped_tokens for r in res),
            "skipped_pages_l2": int(m.get("cost_skipped_pages_l2", 0)),
            "skipped_pages_l3": int(m.get("cost_skipped_pages_l3", 0)),
            "restored_pages_checked": sum(r.restored_checked for r in res),
            # the logits checks: largest difference from a full recompute, and largest
            # difference between two recomputes (the rounding noise the check allows)
            "check_logits_max_diff": max((r.check.logits_max_abs_diff for r in res
                                          if r.check is not None), default=None),
            "check_noise_max_diff": max((r.check.noise_max_abs_diff for r in res
                                         if r.check is not None), default=None),
            "recompute_tokens_per_s": self.recompute_rate(),
            "l2_load_bytes_per_s": float(m.get("l2_load_bytes_per_s") or 0.0) or None,
            "l3_read_bytes_per_s": float(m.get("l3_read_bytes_per_s") or 0.0) or None,
            # L3 pages loaded straight from a shared-memory arena (no L3 -> L2 read)
            "l3_in_place_pages": int(m.get("l3_in_place_pages") or 0),
            # L3 pages read layer group by layer group, each group loaded as it landed
            "l3_streamed_pages": int(m.get("l3_streamed_pages") or 0),
            # fetches that failed after the prefill began (computed again without them)
            "load_failures": sum(1 for r in res if r.load_failed),
        }

    def recompute_rate(self) -> float | None:
        """Prefill tokens computed per second of prefill (load waits excluded)."""
        t = sum(r.prefill_s for r in self.results if r.computed_tokens)
        n = sum(r.computed_tokens for r in self.results)
        return n / t if t > 0 else None

    def per_round(self, num_rounds: int) -> dict[str, list[float]]:
        hit, ttft = [], []
        for r in range(num_rounds):
            rs = [x for x in self.results if x.round == r]
            tok = sum(x.tokens for x in rs)
            hit.append(100.0 * sum(x.hit_tokens for x in rs) / tok if tok else math.nan)
            ttft.append(1e3 * float(np.mean([x.ttft_s for x in rs])) if rs else math.nan)
        return {"hit_rate_pct": hit, "ttft_mean_ms": ttft}


@dataclass
class DemoReport:
    config: DemoConfig
    workload: Workload
    model: dict[str, Any]
    runs: list[SetupRun]
    distinct_pages: int
    files: dict[str, str] = field(default_factory=dict)
    #: the runs under load (None: not asked for)
    load: Any = None

    def summaries(self) -> list[dict[str, Any]]:
        """One row per setup. Measured: ``ttft_speedup`` (L1 only's mean TTFT over the
        setup's) and ``of_ideal_pct`` (that speedup as a % of the measured ideal's, i.e. the
        ideal's mean TTFT over the setup's). Modelled, a diagnostic: ``modelled_speedup`` (the
        best load/recompute split at the run's rates) and ``achieved_of_modelled``."""
        rows = [r.summary() for r in self.runs]
        base = next((s for s in rows if s["setup"] == "L1 only"), None)
        base_run = next((r for r in self.runs if r.name == "L1 only"), None)
        ideal = next((s for s in rows if s["setup"] == IDEAL), None)
        # one cost function for every setup's prefills: their mix of prefix lengths tells the
        # attention term from the per-token one better than full prefills alone
        rate, attn, over = fit_prefill_cost([x for r in self.runs for x in r.results])
        self.prefill_fit = (rate, attn, over)
        ps, pb = self.model["page_size"], self.model["page_bytes"]
        for s, run in zip(rows, self.runs):
            s["of_ideal_pct"] = None
            if ideal is not None:
                s["of_ideal_pct"] = 100.0 * ideal["ttft_mean_ms"] / s["ttft_mean_ms"] \
                    if s["ttft_mean_ms"] else math.inf
            s["modelled_speedup"] = s["achieved_of_modelled"] = s["slower_pct"] = None
            s["slower_loading_pct"] = s["slower_same_work_pct"] = None
            if base_run is None or base is None:
                s["hit_gain_pts"] = s["ttft_speedup"] = s["p90_speedup"] = None
                continue
            if rate > 0:
                s["modelled_speedup"] = modelled_speedup(
                    run.results, base_run.results, recompute_tps=rate, page_size=ps,
                    page_bytes=pb, h2d_bps=s["l2_load_bytes_per_s"],
                    l3_bps=s["l3_read_bytes_per_s"], attn=attn, overhead_s=over,
                    in_place=bool(s.get("l3_in_place_pages")))
            s["slower_pct"] = 100.0 * slower_share(run.results, base_run.results)
            s["slower_same_work_pct"] = 100.0 * slower_share(run.results, base_run.results,
                                                             same_work=True)
            s["slower_loading_pct"] = 100.0 * slower_share(run.results, base_run.results,
                                                           loading_only=True)
            s["hit_gain_pts"] = s["hit_rate_pct"] - base["hit_rate_pct"]
            s["ttft_speedup"] = base["ttft_mean_ms"] / s["ttft_mean_ms"] \
                if s["ttft_mean_ms"] else math.inf
            s["p90_speedup"] = base["ttft_p90_ms"] / s["ttft_p90_ms"] \
                if s["ttft_p90_ms"] else math.inf
            if s["modelled_speedup"]:
                s["achieved_of_modelled"] = s["ttft_speedup"] / s["modelled_speedup"]
        return rows

    def ideal(self) -> dict[str, Any] | None:
        """The measured ideal (the every-page-in-L1 setup): its mean TTFT, its speedup over
        L1 only (None without L1 only), its L1 size and evictions; None if it did not run."""
        rows = {s["setup"]: s for s in self.summaries()}
        s = rows.get(IDEAL)
        if s is None:
            return None
        return {"setup": IDEAL, "ttft_mean_ms": s["ttft_mean_ms"],
                "speedup": s["ttft_speedup"], "hit_rate_pct": s["hit_rate_pct"],
                "l1_pages": s["l1_pages"], "l1_evictions": s["l1_evictions"]}

    def split(self) -> dict[str, Any] | None:
        """The cost-aware split (L1+L2+L3) judged against its alternatives in this run:
        loading every L3 hit (`LOAD_ALL`) and loading none (L1+L2). ``ratio``: its mean TTFT
        over the better alternative's; ``flagged`` when more than `SPLIT_MARGIN` above it.
        None unless all three ran."""
        rows = {s["setup"]: s for s in self.summaries()}
        if not all(n in rows for n in ("L1+L2+L3", LOAD_ALL, "L1+L2")):
            return None
        ours = rows["L1+L2+L3"]["ttft_mean_ms"]
        alts = {LOAD_ALL: rows[LOAD_ALL]["ttft_mean_ms"], "L1+L2": rows["L1+L2"]["ttft_mean_ms"]}
        best = min(alts, key=lambda n: alts[n])
        ratio = ours / alts[best] if alts[best] > 0 else math.inf
        return {"setup": "L1+L2+L3", "ttft_mean_ms": ours,
                "load_all_ttft_mean_ms": alts[LOAD_ALL],
                "load_none_ttft_mean_ms": alts["L1+L2"], "best_alternative": best,
                "ratio": ratio, "margin": SPLIT_MARGIN,
                "flagged": ratio > 1.0 + SPLIT_MARGIN}


def fit_prefill_cost(results: list[RequestResult]) -> tuple[float, float, float]:
    """Least-squares fit of the measured prefills: seconds = overhead + c / rate
    + attn x (n^2 - s^2) / 2 for ``c`` tokens computed at positions ``s..n`` (a fixed cost per
    prefill, a cost per token, and attention over the context), every coefficient >= 0 (the
    best fit over the subsets of terms that keeps them so). Returns (rate in tokens/s, attn
    in s per token pair, overhead in s); rate NaN when nothing was measured."""
    import itertools
    rows = [(1.0, r.computed_tokens,
             pairs(r.tokens, r.computed_tokens), r.prefill_s)
            for r in results if r.computed_tokens and r.prefill_s > 0]
    if not rows:
        return math.nan, 0.0, 0.0
    a = np.array([x[:3] for x in rows], dtype=float)
    t = np.array([x[3] for x in rows], dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for cols in itertools.chain.from_iterable(itertools.combinations((0, 2), k)
                                              for k in (2, 1, 0)):
        use = [1, *cols]                          # the per-token term is always in
        coef, *_ = np.linalg.lstsq(a[:, use], t, rcond=None)
        if coef[use.index(1)] <= 0 or (coef < 0).any():
            continue
        full = np.zeros(3)
        full[use] = coef
        err = float(((a @ full - t) ** 2).sum())
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    if best is None:
        return float(a[:, 1].sum() / t.sum()), 0.0, 0.0
    over, lin, attn = best[1]
    return 1.0 / lin, float(attn), float(over)


def modelled_ttft(*, tokens: int, l1_tokens: int, l2_tokens: int, l3_tokens: int,
                  page_size: int, page_bytes: int, recompute_tps: float,
                  h2d_bps: float | None, l3_bps: float | None, attn: float = 0.0,
                  overhead_s: float = 0.0, in_place: bool = False) -> float:
    """The modelled split, a diagnostic (the measured ideal is the `IDEAL` setup, and a real
    run can beat this model): the least time to the first token of one request at the
    measured rates: over every
    split (the first ``k`` hit pages loaded, the rest recomputed), ``l3(k) + max(h2d(k),
    compute(k))``. L2 -> L1 loads overlap the prefill fully (layer ``i`` of the prefill needs
    only layer ``i`` of the prefix; the pipeline's fill is not counted). An L3 read of the
    same request cannot overlap it: every layer of the suffix attends over the whole prefix
    and an L3 object holds all layers of its page, so the prefill's first layer waits for the
    last page read. L1 hits cost nothing; computing positions ``s..n`` costs ``overhead_s +
    (n - s) / recompute_tps + attn (n^2 - s^2) / 2`` (`fit_prefill_cost`). A rate not
    measured (None) makes its tier's pages unusable (recomputed). ``in_place``: the L3 pages
    load straight from the store's memory, as L2 pages do (`kvtier.cache.inplace`)."""
    n2, n3 = l2_tokens // page_size, l3_tokens // page_size
    if in_place:
        n2, n3 = n2 + n3, 0
    if h2d_bps is None:
        n2 = n3 = 0
    if l3_bps is None:
        n3 = 0
    rest = tokens - l1_tokens - (n2 + n3) * page_size     # computed in every split
    best = math.inf
    for k in range(n2 + n3 + 1):
        h2d = k * page_bytes / h2d_bps if k else 0.0                # type: ignore[operator]
        l3 = max(0, k - n2) * page_bytes / l3_bps if k > n2 else 0.0  # type: ignore
        c = rest + (n2 + n3 - k) * page_size
        comp = c / recompute_tps + attn * pairs(tokens, c)
        best = min(best, l3 + max(h2d, comp))
    return overhead_s + best


def modelled_speedup(results: list[RequestResult], base: list[RequestResult], *,
                     recompute_tps: float, page_size: int, page_bytes: int,
                     h2d_bps: float | None, l3_bps: float | None, attn: float = 0.0,
                     overhead_s: float = 0.0, in_place: bool = False) -> float:
    """Mean modelled TTFT of L1 only over this setup's, both at the measured rates (L1 only:
    its own L1 hits reused, the rest recomputed). A diagnostic, not a bound."""
    ours = sum(modelled_ttft(tokens=r.tokens, l1_tokens=r.l1_tokens,
                             l2_tokens=r.l2_hit_tokens, l3_tokens=r.l3_hit_tokens,
                             page_size=page_size, page_bytes=page_bytes,
                             recompute_tps=recompute_tps, h2d_bps=h2d_bps, l3_bps=l3_bps,
                             attn=attn, overhead_s=overhead_s, in_place=in_place)
               for r in results)
    ref = sum(modelled_ttft(tokens=b.tokens, l1_tokens=b.l1_tokens, l2_tokens=0, l3_tokens=0,
                            page_size=page_size, page_bytes=page_bytes,
                            recompute_tps=recompute_tps, h2d_bps=None, l3_bps=None, attn=attn,
                            overhead_s=overhead_s)
              for b in base)
    return ref / ours if ours > 0 else math.inf


def slower_share(results: list[RequestResult], base: list[RequestResult],
                 margin: float = 0.05, loading_only: bool = False,
                 same_work: bool = False) -> float:
    """Share of requests more than ``margin`` slower (TTFT) than the same request with L1
    only (``loading_only``: of the requests that loaded pages from L2/L3; ``same_work``: of
    those that loaded nothing and reused as much of L1, i.e. computed the same tokens as with
    L1 only -- their share is the run's timing noise plus the controller's own cost)."""
    pairs = [(r.ttft_s, b.ttft_s) for r, b in zip(results, base) if r.index == b.index
             and (not loading_only or r.l2_tokens + r.l3_tokens)
             and (not same_work or (r.l2_tokens + r.l3_tokens == 0
                                    and r.computed_tokens == b.computed_tokens))]
    return sum(1 for t, tb in pairs if t > (1 + margin) * tb) / len(pairs) if pairs else 0.0


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------
class CheckPolicy:
    """Which requests are compared with a full recompute: ``all``; ``none``; or ``sample``:
    the first request of a setup that reused L1 pages, the first that loaded pages from L2/L3,
    and a random ``rate`` of the other requests that reused anything."""

    def __init__(self, mode: str, rate: float, seed: int):
        self.mode = mode
        self.rate = rate
        self._rng = random.Random(seed)
        self._seen_l1 = self._seen_loaded = False

    def __call__(self, l1_pages: int, loaded_pages: int) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "none":
            return False
        first = (loaded_pages and not self._seen_loaded) or (l1_pages and not self._seen_l1)
        self._seen_loaded |= bool(loaded_pages)
        self._seen_l1 |= bool(l1_pages)
        if first:
            return True
        return bool(l1_pages or loaded_pages) and self._rng.random() < self.rate


def build_workload(cfg: DemoConfig, vocab_size: int) -> Workload:
    if cfg.workload == "long":
        from .workload import long_context
        gpu = cfg.device.split(":")[0] != "cpu"
        lo = cfg.long_min_tokens or (8192 if gpu else 1024)
        hi = cfg.long_max_tokens or max(lo, 32768 if gpu else 4096)
        return long_context(cfg.clients, cfg.rounds, min_tokens=lo, max_tokens=hi,
                            question_tokens=cfg.turn_tokens, vocab_size=vocab_size,
                            seed=cfg.seed)
    if cfg.workload == "trace":
        from .trace import trace_workload
        return trace_workload(cfg.trace, block_tokens=cfg.trace_block_tokens,  # type: ignore
                              max_requests=cfg.trace_requests, start=cfg.trace_start,
                              rounds=cfg.rounds,
                              vocab_size=vocab_size, seed=cfg.seed)
    return multiturn(cfg.clients, cfg.rounds, first_tokens=cfg.first_tokens,
                     turn_tokens=cfg.turn_tokens, answer_tokens=cfg.answer_tokens,
                     system_tokens=cfg.system_tokens, vocab_size=vocab_size, seed=cfg.seed)


def distinct_pages(workload: Workload, model: DemoModel) -> int:
    """Full pages of distinct content across the workload (its whole KV working set)."""
    keyer = PageKeyer(model_id="kvtier-demo", spec=model.spec)
    seen: set[bytes] = set()
    for r in workload.requests:
        seen.update(keyer.keys(r.tokens))
    return len(seen)


def tier_sizes(cfg: DemoConfig, workload: Workload, model: DemoModel, distinct: int
               ) -> tuple[int, int]:
    """L1 and L2 pages: given, or sized like the benchmarks we compare with -- L1 a small
    fraction of the working set (it thrashes alone), L2 half of it, L3 unbounded."""
    ps = model.spec.page_size
    need = workload.max_tokens // ps + 2       # one request's pages, pinned while it runs
    l1 = cfg.l1_pages if cfg.l1_pages is not None else max(need, math.ceil(0.15 * distinct))
    if l1 < need:
        raise ConfigError(f"--l1-pages {l1} cannot hold the longest request "
                          f"({workload.max_tokens} tokens = {need - 2} pages + 2)",
                          key="l1_pages", value=l1)
    l2 = cfg.l2_pages if cfg.l2_pages is not None else max(1, math.ceil(0.5 * distinct))
    return l1, l2


def ideal_l1_pages(workload: Workload, model: DemoModel, distinct: int) -> int:
    """A device pool nothing is ever evicted from: every distinct page of the workload (what
    the cache can hold at most) plus the new pages of the longest request."""
    return distinct + workload.max_tokens // model.spec.page_size + 2


def cache_config(cfg: DemoConfig, setup: str, model: DemoModel, l2_pages: int,
                 l3_root: str | None) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_id": _model_id(cfg, model),
        "host_allocator": host_allocator(cfg), "transfer_engine": cfg.transfer_engine,
        "prefetch_policy": cfg.prefetch_policy, "write_policy": cfg.write_policy,
        "cost_aware_fetch": cfg.cost_aware,
    }
    if cfg.recompute_tokens_per_s is not None:
        base["recompute_tokens_per_s"] = cfg.recompute_tokens_per_s
    if cfg.switch_interval_ms:
        base["switch_interval_s"] = cfg.switch_interval_ms / 1e3
    # `kvtier --config FILE demo` (or $KVTIER_CONFIG): the file's [cache] table over the
    # flags; what defines each setup (its tiers and sizes, the model's identity) stays.
    path = os.environ.get("KVTIER_CONFIG")
    if path:
        from kvtier.config import read_config_file
        base.update(read_config_file(path, "cache"))
        base["model_id"] = _model_id(cfg, model)
    if not loads_below_l1(setup):
        # L1 only and the ideal: the same controller as a device-only prefix cache: selective
        # write-through whose threshold no page reaches, a one-page host pool, and an engine
        # that reuses L1 hits only (`DemoEngine(lower_tiers=False)`).
        return {**base, "host_pool_pages": 1, "write_policy": "write_through_selective",
                "selective_threshold": 1 << 62}
    base["host_pool_pages"] = l2_pages
    if setup == "L1+L2":
        return base
    l3_config = {**_shared_memory_config(cfg), **cfg.l3_config}
    if l3_root is not None:
        l3_config.setdefault("root", l3_root)
    if cfg.l3_bytes is not None:
        l3_config.setdefault("capacity_bytes", cfg.l3_bytes)
    out = {**base, "l3_store": cfg.l3_store, "l3_config": l3_config}
    if setup == LOAD_ALL:
        # Its own directory (a store takes one writer) and its own key namespace: a store the
        # two L3 setups share (a distributed one) never serves one the other's pages.
        if "root" in l3_config:
            l3_config["root"] = os.path.join(l3_config["root"], "load-all")
        out.update(cost_aware_fetch=False, salt=f"{out.get('salt', '')}|load-all")
    return out


def _model_id(cfg: DemoConfig, model: DemoModel) -> str:
    return f"kvtier-demo-{model.family}-{model.size.name}-seed{cfg.seed}"


def host_allocator(cfg: DemoConfig) -> str:
    """The host allocator asked for, else: on CPU ``mmap`` (page-aligned memory, so the file
    store can read with O_DIRECT, from the disk rather than the page cache); elsewhere
    ``torch-pinned`` (page-locked memory the accelerator copies from directly)."""
    if cfg.host_allocator:
        return cfg.host_allocator
    return "mmap" if cfg.device.split(":")[0] == "cpu" else "torch-pinned"


def _store_fields(name: str) -> set[str]:
    import dataclasses

    from kvtier.registry import get_backend_class
    cls = get_backend_class("kvtier.l3_stores", name)
    conf = getattr(cls, "Config", None)
    return {f.name for f in dataclasses.fields(conf)} \
        if conf is not None and dataclasses.is_dataclass(conf) else set()


def _store_takes_root(name: str) -> bool:
    """Does the named store keep its objects under a ``root`` directory the demo gives it (a
    temporary one)? Not a shared-memory store (``remove_when_unused``): its root is a tmpfs
    and its arena is named instead (`_shared_memory_config`)."""
    return "root" in _store_fields(name) and not _shared_memory_store(name)


def _shared_memory_store(name: str) -> bool:
    """Is the named store a shared-memory arena (named, not given a directory)?"""
    return "remove_when_unused" in _store_fields(name)


def _shared_memory_config(cfg: "DemoConfig") -> dict[str, Any]:
    """A shared-memory store's settings for this run: an arena of its own, removed at the
    end, unless the user named one (``name`` or ``root``: to share it with another process,
    which then keeps it)."""
    if not _shared_memory_store(cfg.l3_store) or {"name", "root"} & set(cfg.l3_config):
        return {}
    return {"name": f"kvtier-demo-{os.getpid()}-{os.urandom(3).hex()}",
            "remove_when_unused": True}


def _check_failed(name: str, req: Any, res: RequestResult) -> CheckFailedError:
    c = res.check
    assert c is not None
    how = "bitwise equality" if c.tolerance == 0 else f"relative tolerance {c.tolerance:g}"
    if c.noise_max_abs_diff:
        how += f" or twice the {c.noise_max_abs_diff:.3g} two recomputes differ by"
    logits = "logits equal" if c.logits_max_abs_diff == 0 else \
        f"logits differ by up to {c.logits_max_abs_diff:.3g}"
    return CheckFailedError(
        f"{name}: request {req.index} (round {req.round}, {res.tokens} tokens, "
        f"{res.l1_tokens} from L1, {res.l2_tokens} from L2, {res.l3_tokens} from L3) does not "
        f"match a full recompute ({how} required): {logits}, {c.kv_pages_differing} KV "
        f"page(s) differ by up to {c.kv_max_abs_diff:.3g}", request=req.index,
        max_abs_diff=c.logits_max_abs_diff)


def _digest_failed(name: str, req: Any, res: RequestResult) -> CheckFailedError:
    return CheckFailedError(
        f"{name}: request {req.index} (round {req.round}, {res.tokens} tokens, "
        f"{res.l2_tokens} from L2, {res.l3_tokens} from L3): {res.restored_bad} restored KV "
        f"page(s) match no digest recorded when they were committed (bitwise)",
        request=req.index)


class SetupExporter:
    """The demo's metrics exporter. It binds when built, before the model is (a port in use
    fails the run at once, not after minutes of building), and serves each setup's cache
    from the moment `run_setups` adds it until it is taken away again."""

    def __init__(self, names: list[str], port: int, host: str = "127.0.0.1"):
        from kvtier.prometheus import Source, serve
        #: setup name -> its cache while the setup's engine lives
        self.caches: dict[str, Any] = {}
        self._server = serve([Source(functools.partial(self._metrics, n), {"setup": n})
                              for n in names], port=port, host=host)

    def _metrics(self, name: str) -> Any:
        cache = self.caches.get(name)
        return None if cache is None else cache.metrics_registry

    @property
    def url(self) -> str:
        return self._server.url

    def close(self) -> None:
        self.caches.clear()
        self._server.close()


def run_setups(names: list[str], model: DemoModel, workload: Workload,
               cache_cfgs: dict[str, dict[str, Any]], l1_pages: int | dict[str, int],
               checks: dict[str, CheckPolicy], *, progress: bool = True,
               corrupt_restore: bool = False, metrics_port: int | None = None,
               prefill_mode: str = "fast",
               metrics_host: str = "127.0.0.1",
               on_metrics: Callable[[str], None] | None = None,
               exporter: SetupExporter | None = None,
               digests: dict[bytes, set[int]] | None = None) -> list[SetupRun]:
    """Serve every request on every setup, interleaved request by request (in a rotating
    order), so that all setups see the same machine load; after each request the setup's
    background work (backups, L3 writes) is drained, untimed, so that it never runs during
    another setup's request. ``l1_pages``: every setup's device pool, or one per setup.
    Metrics are served by ``exporter`` (the caller's, bound already) or, given
    ``metrics_port``, by one this call starts and closes."""
    from kvtier.report import progress as bar
    engines: dict[str, DemoEngine] = {}
    results: dict[str, list[RequestResult]] = {n: [] for n in names}
    passed = dict.fromkeys(names, 0)
    busy = dict.fromkeys(names, 0.0)
    own = None
    if exporter is None and metrics_port is not None:
        exporter = own = SetupExporter(names, metrics_port, metrics_host)
    l1 = l1_pages if isinstance(l1_pages, dict) else dict.fromkeys(names, l1_pages)
    try:
        for name in names:
            engines[name] = eng = DemoEngine(model, cache_cfgs[name], l1_pages=l1[name],
                                             lower_tiers=loads_below_l1(name),
                                             prefill_mode=prefill_mode, digests=digests)
            eng.corrupt_restore = corrupt_restore
            eng.warm_up(model.vocab_size)
        if exporter is not None:
            exporter.caches.update({n: engines[n].cache for n in names})
            if on_metrics is not None:
                on_metrics(exporter.url)
        steps = bar(range(len(workload) * len(names)), total=len(workload) * len(names),
                    desc="requests x setups", disable=not progress)
        it = iter(steps)
        for i, req in enumerate(workload.requests):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                res = engines[name].serve(req, checks[name])
                if res.restored_bad:
                    raise _digest_failed(name, req, res)
                if res.check is not None:
                    if not res.check.passed:
                        raise _check_failed(name, req, res)
                    passed[name] += 1
                results[name].append(res)
                busy[name] += res.ttft_s + res.commit_s
                engines[name].cache.wait_idle(timeout=600)
                next(it, None)
        runs = []
        for name in names:
            cache = engines[name].cache
            stats = dict(cache.store.stats()) if cache.store is not None else {}
            cc = cache_cfgs[name]
            runs.append(SetupRun(name, l1[name],
                                 cc.get("host_pool_pages") if loads_below_l1(name) else None,
                                 cc.get("l3_store"), results[name], cache.metrics(),
                                 busy[name], passed[name], stats))
        close = getattr(steps, "close", None)
        if close is not None:
            close()
        return runs
    finally:
        if exporter is not None:
            exporter.caches.clear()          # no scrape of a cache being closed
        if own is not None:
            own.close()
        for eng in engines.values():
            eng.close()


def run_demo(cfg: DemoConfig, *, corrupt_restore: bool = False,
             log=lambda *a: print(*a, file=sys.stderr),
             on_metrics: Callable[[str], None] | None = None) -> DemoReport:
    """Replay the workload through every setup and return the report (files not written)."""
    import torch
    threads = cfg.threads
    if threads is None and cfg.device.split(":")[0] == "cpu":
        # One compute thread on CPU: the model stands in for an accelerator, and kvtier's
        # background threads (backups, L3 I/O) get the other cores, as they would beside a
        # GPU. On a busy 2-core machine, 2 intra-op threads were also ~10x slower for
        # page-sized chunks (OpenMP threads contending with everything else).
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    names = [s for s in SETUPS if s in cfg.setups]
    if not cfg.cost_aware and "L1+L2+L3" in names and LOAD_ALL in names:
        names.remove(LOAD_ALL)      # L1+L2+L3 loads every hit already
    # Bound first: a port in use is a one-line error now, not after the model is built.
    exporter = (SetupExporter(names, cfg.metrics_port, cfg.metrics_host)
                if cfg.metrics_port is not None else None)
    # every setup's cache sets the switch interval (``switch_interval_s``): the caller's
    # comes back after the run
    switch = sys.getswitchinterval()
    try:
        return _run_demo(cfg, names, exporter, corrupt_restore=corrupt_restore, log=log,
                         on_metrics=on_metrics)
    finally:
        sys.setswitchinterval(switch)
        if exporter is not None:
            exporter.close()


def _run_demo(cfg: DemoConfig, names: list[str], exporter: SetupExporter | None, *,
              corrupt_restore: bool, log: Callable[..., None],
              on_metrics: Callable[[str], None] | None) -> DemoReport:
    import torch
    model = DemoModel(cfg.model_size, page_size=cfg.page_size, device=cfg.device,
                      dtype=cfg.dtype, seed=cfg.seed, max_forward_tokens=cfg.max_forward_tokens)
    workload = build_workload(cfg, model.vocab_size)
    distinct = distinct_pages(workload, model)
    l1, l2 = tier_sizes(cfg, workload, model, distinct)
    l1_of = {n: ideal_l1_pages(workload, model, distinct) if n == IDEAL else l1 for n in names}
    if IDEAL in names and model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        need = sum(l1_of.values()) * model.spec.page_bytes
        if need > free:
            raise ConfigError(
                f"the device pools ({need / 2**30:.1f} GiB, the ideal's {l1_of[IDEAL]} pages "
                f"hold the whole workload) do not fit in the device's {free / 2**30:.1f} GiB "
                f"free: a smaller workload, or --setups without '{IDEAL}'", key="setups",
                value=tuple(names))
    minfo = {**model.describe(),
             "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
             "page_size": model.spec.page_size, "page_bytes": model.spec.page_bytes,
             "threads": torch.get_num_threads(),
             # what every setup's cache will set (a config file's [cache] over the flag)
             "switch_interval_ms": 1e3 * (cache_config(cfg, names[0], model, l2, None).get(
                 "switch_interval_s") or sys.getswitchinterval())}
    kv = f", KV {model.spec.page_bytes // model.spec.page_size} B per token" + \
        (f" (MLA latent {model.spec.dim} per layer)" if model.mla else "")
    log(f"kvtier demo: {model.label} ({minfo['params_m']}M params, random weights{kv}) "
        f"on {model.device} {minfo['dtype']}, {minfo['threads']} threads, thread switch interval "
        f"{minfo['switch_interval_ms']:g} ms; {workload.description}"
        f"; {len(workload)} requests, {workload.total_tokens} prompt tokens, {distinct} "
        f"distinct pages of {model.spec.page_size} tokens ({model.spec.page_bytes} B each); "
        f"L1 {l1} pages, L2 {l2} pages ({host_allocator(cfg)}), L3 {cfg.l3_store} "
        f"({'no limit' if cfg.l3_bytes is None else f'{cfg.l3_bytes} B'})"
        + (f"; the ideal: L1 {l1_of[IDEAL]} pages" if IDEAL in names else ""))
    digests = load_known(cfg.digests) if cfg.digests else None
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-l3-") as tmp:
        root = tmp if any(map(has_l3, names)) and _store_takes_root(cfg.l3_store) else None
        cfgs = {n: cache_config(cfg, n, model, l2, root) for n in names}
        for n in names:
            if has_l3(n) and "root" in cfgs[n]["l3_config"]:
                os.makedirs(cfgs[n]["l3_config"]["root"], exist_ok=True)
        if LOAD_ALL in names and "L1+L2+L3" in names and \
                not cfgs["L1+L2+L3"].get("cost_aware_fetch", True):
            names.remove(LOAD_ALL)     # a config file turned the cost-aware fetch off
        checks = {n: CheckPolicy(cfg.check, cfg.check_rate, cfg.seed * 1000 + i)
                  for i, n in enumerate(names)}
        runs = run_setups(names, model, workload, cfgs, l1_of, checks, progress=cfg.progress,
                          corrupt_restore=corrupt_restore, exporter=exporter,
                          prefill_mode="paged" if cfg.check_mode == "bitwise" else "fast",
                          metrics_host=cfg.metrics_host, digests=digests,
                          on_metrics=on_metrics or (lambda url: log(
                              f"kvtier demo: metrics of every setup at {url}")))
        sweep = None
        if cfg.loads or cfg.rates or cfg.concurrency:
            sweep = run_loads(cfg, [n for n in names if n != LOAD_ALL], model, workload,
                              l1_of, l2, tmp, runs, corrupt_restore=corrupt_restore, log=log,
                              digests=digests)
        if cfg.digests:
            save_known(cfg.digests, digests or {})
    return DemoReport(cfg, workload, minfo, runs, distinct, load=sweep)


def run_loads(cfg: DemoConfig, names: list[str], model: DemoModel, workload: Workload,
              l1_of: dict[str, int], l2: int, tmp: str, serial: list[SetupRun], *,
              corrupt_restore: bool = False, log: Callable[..., None] = lambda *a: None,
              digests: dict[bytes, set[int]] | None = None):
    """Every load level on every setup (`kvtier_tools.demo.load`), each on a fresh engine and cache
    (an L3 store of its own). The load fractions are of L1 only's capacity saturated: one
    request over its mean service time when every conversation sends at once (a closed loop,
    no think time), measured first. (The serial replay's busy time is not it: there the
    setups take turns request by request, and on the H200 a prefill after another setup's
    took up to 1.9x as long per token as under load, so fractions of it offered 0.5-0.6 of
    the engine at a nominal 0.8-0.95.)"""
    from .load import Level, LoadSweep, levels, serial_summary, serve_queue

    def serve(name: str, lv: Any, tag: str, seed: int, check_seed: int) -> Any:
        root = os.path.join(tmp, f"load-{tag}-{names.index(name)}")
        if has_l3(name) and _store_takes_root(cfg.l3_store):
            os.makedirs(root, exist_ok=True)
        else:
            root = None  # type: ignore[assignment]
        cc = cache_config(cfg, name, model, l2, root)
        if has_l3(name) and _shared_memory_store(cfg.l3_store):
            # a shared-memory arena of this level's own, as a store root of its own is
            lc = cc["l3_config"]
            lc.update(name=f"{lc.get('name', 'kvtier')}-load{tag}", remove_when_unused=True)
        if has_l3(name):
            # and keys of its own: a store the user placed (a root or arena named in
            # --l3-config, a chain's members) is shared with the serial replay, whose pages
            # of the same prefix may differ in their last bits (another split into chunks)
            cc["salt"] = f"{cc.get('salt', '')}|load{tag}"
        eng = DemoEngine(model, cc, l1_pages=l1_of[name], lower_tiers=loads_below_l1(name),
                         prefill_mode="paged" if cfg.check_mode == "bitwise" else "fast",
                         digests=digests)
        eng.corrupt_restore = corrupt_restore
        try:
            eng.warm_up(model.vocab_size)
            # under load the checks are the digests of every restored page and a full
            # recompute of the first L1 reuse and the first load: a check's time is real
            # time the queue does not count, and reads in flight would gain it
            check = CheckPolicy(cfg.check, 0.0, check_seed)

            def verify(req: Any, res: RequestResult,
                       where: str = f"{name} at {lv.label}") -> None:
                if res.restored_bad:
                    raise _digest_failed(where, req, res)
                if res.check is not None and not res.check.passed:
                    raise _check_failed(where, req, res)

            run = serve_queue(eng, workload, lv, check, seed=seed, name=name,
                              on_result=verify, preload=cfg.preload)
            stats = getattr(eng.cache.engine, "stats", None)
            run.engine_stats = dict(stats()) if callable(stats) else {}
            return run
        finally:
            eng.close()

    capacity = cal = None
    if cfg.loads and "L1 only" in names:
        cal = serve("L1 only", Level("closed", users=len(workload)), "capacity", cfg.seed,
                    cfg.seed * 1000)
        service = cal.summary()["service_mean_ms"] / 1e3
        capacity = 1.0 / service if service > 0 else None
    lvls = levels(cfg.loads, cfg.rates, cfg.concurrency, cfg.think_ms, capacity)
    if capacity is not None:
        base = next((r for r in serial if r.name == "L1 only"), None)
        was = f"; the serial replay's busy time gave {len(base.results) / base.busy_s:.2f}" \
            if base is not None and base.busy_s > 0 else ""
        log(f"kvtier demo: L1-only capacity {capacity:.2f} requests/s (saturated{was}); under "
            f"load: {', '.join(lv.label for lv in lvls)}")
    runs = []
    for i, lv in enumerate(lvls):
        for name in names:
            runs.append(serve(name, lv, str(i), cfg.seed + i, cfg.seed * 1000 + i))
            s = runs[-1].summary()
            log(f"kvtier demo: {lv.label}: {name}: TTFT mean {s['ttft_mean_ms']:.1f} ms, "
                f"utilisation {s['utilisation']:.2f}"
                + (" (OVERLOADED)" if s["overloaded"] else ""))
    ser = [serial_summary(r.name, r.results, r.busy_s) for r in serial if r.name in names]
    return LoadSweep(capacity, lvls, ser, runs, cal)
