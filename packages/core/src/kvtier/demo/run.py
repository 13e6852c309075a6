"""The demo run: one workload replayed through three tier setups -- L1 only, L1+L2 and
L1+L2+L3 -- with a real model, and the numbers that compare them.

Each setup has its own engine (device pool, cache, store) and serves the same requests in
the same order, one at a time; the model and its weights are shared. The setups take turns
request by request, so a busy or drifting machine slows all of them alike. TTFT is measured
per request from its arrival at the engine to the logits of its first output token: page
match, loads from L2/L3, and the prefill of whatever was not cached.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from ..config import build_config
from ..errors import ConfigError
from ..keys import PageKeyer
from .engine import DemoEngine, RequestResult
from .model import MODEL_SIZES, CheckFailedError, DemoModel
from .workload import Workload, multiturn

#: Names of the three setups, in the order they run and are shown.
SETUPS = ("L1 only", "L1+L2", "L1+L2+L3")


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run is built from (the CLI flags map one to one onto it)."""

    model_size: str = "small"
    page_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    workload: Literal["multiturn", "trace"] = "multiturn"
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
    l1_pages: int | None = None          # None: sized so that L1 alone thrashes
    l2_pages: int | None = None          # None: half the workload's distinct pages
    l3_bytes: int | None = None          # None: no limit
    host_allocator: str | None = None    # None: mmap on cpu, torch-pinned elsewhere
    l3_store: str = "file"
    l3_config: dict[str, Any] = field(default_factory=dict)
    transfer_engine: str = "torch"
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

    def __post_init__(self) -> None:
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
        for name in ("l1_pages", "l2_pages", "l3_bytes", "threads"):
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
        if self.workload == "trace" and not self.trace:
            raise ConfigError("--workload trace needs --trace PATH (a Mooncake-format JSONL "
                              "file)", key="trace")

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
            "load_mean_ms": 1e3 * float(np.mean([r.load_s for r in res])) if res else 0.0,
            "prefill_mean_ms": 1e3 * float(np.mean([r.prefill_s for r in res])) if res else 0.0,
            "bytes_h2d": int(m.get("bytes_h2d", 0)), "bytes_d2h": int(m.get("bytes_d2h", 0)),
            "bytes_l3_read": int(m.get("bytes_l3_read", 0)),
            "bytes_l3_written": int(m.get("bytes_l3_written", 0)),
            "store_errors": int(m.get("store_errors", 0)),
            "checks_passed": self.checks, "busy_s": self.busy_s,
            "l1_pages": self.l1_pages, "l2_pages": self.l2_pages, "l3": self.l3,
        }

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

    def summaries(self) -> list[dict[str, Any]]:
        rows = [r.summary() for r in self.runs]
        base = next((s for s in rows if s["setup"] == "L1 only"), None)
        for s in rows:
            if base is None:
                s["hit_gain_pts"] = s["ttft_speedup"] = s["p90_speedup"] = None
                continue
            s["hit_gain_pts"] = s["hit_rate_pct"] - base["hit_rate_pct"]
            s["ttft_speedup"] = base["ttft_mean_ms"] / s["ttft_mean_ms"] \
                if s["ttft_mean_ms"] else math.inf
            s["p90_speedup"] = base["ttft_p90_ms"] / s["ttft_p90_ms"] \
                if s["ttft_p90_ms"] else math.inf
        return rows


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


def cache_config(cfg: DemoConfig, setup: str, model: DemoModel, l2_pages: int,
                 l3_root: str | None) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_id": f"kvtier-demo-llama-{model.size.name}-seed{cfg.seed}",
        "host_allocator": host_allocator(cfg), "transfer_engine": cfg.transfer_engine,
        "prefetch_policy": cfg.prefetch_policy, "write_policy": cfg.write_policy,
    }
    if setup == "L1 only":
        # The same controller as a device-only prefix cache: selective write-through whose
        # threshold no page reaches, a one-page host pool, and an engine that reuses L1 hits
        # only (`DemoEngine(lower_tiers=False)`).
        return {**base, "host_pool_pages": 1, "write_policy": "write_through_selective",
                "selective_threshold": 1 << 62}
    base["host_pool_pages"] = l2_pages
    if setup == "L1+L2":
        return base
    l3_config = dict(cfg.l3_config)
    if l3_root is not None:
        l3_config.setdefault("root", l3_root)
    if cfg.l3_bytes is not None:
        l3_config.setdefault("capacity_bytes", cfg.l3_bytes)
    return {**base, "l3_store": cfg.l3_store, "l3_config": l3_config}


def host_allocator(cfg: DemoConfig) -> str:
    """The host allocator asked for, else: on CPU ``mmap`` (page-aligned memory, so the file
    store can read with O_DIRECT, from the disk rather than the page cache); elsewhere
    ``torch-pinned`` (page-locked memory the accelerator copies from directly)."""
    if cfg.host_allocator:
        return cfg.host_allocator
    return "mmap" if cfg.device.split(":")[0] == "cpu" else "torch-pinned"


def _store_takes_root(name: str) -> bool:
    """Does the named store's Config have a ``root`` directory field?"""
    import dataclasses

    from ..registry import get_backend_class
    cls = get_backend_class("kvtier.l3_stores", name)
    conf = getattr(cls, "Config", None)
    return conf is not None and dataclasses.is_dataclass(conf) and \
        "root" in {f.name for f in dataclasses.fields(conf)}


def _check_failed(name: str, req: Any, res: RequestResult) -> CheckFailedError:
    c = res.check
    assert c is not None
    how = "bitwise equality" if c.tolerance == 0 else f"relative tolerance {c.tolerance:g}"
    logits = "logits equal" if c.logits_max_abs_diff == 0 else \
        f"logits differ by up to {c.logits_max_abs_diff:.3g}"
    return CheckFailedError(
        f"{name}: request {req.index} (round {req.round}, {res.tokens} tokens, "
        f"{res.l1_tokens} from L1, {res.l2_tokens} from L2, {res.l3_tokens} from L3) does not "
        f"match a full recompute ({how} required): {logits}, {c.kv_pages_differing} KV "
        f"page(s) differ by up to {c.kv_max_abs_diff:.3g}", request=req.index,
        max_abs_diff=c.logits_max_abs_diff)


def run_setups(names: list[str], model: DemoModel, workload: Workload,
               cache_cfgs: dict[str, dict[str, Any]], l1_pages: int,
               checks: dict[str, CheckPolicy], *, progress: bool = True,
               corrupt_restore: bool = False, metrics_port: int | None = None,
               metrics_host: str = "127.0.0.1",
               on_metrics: Callable[[str], None] | None = None) -> list[SetupRun]:
    """Serve every request on every setup, interleaved request by request (in a rotating
    order), so that all setups see the same machine load; after each request the setup's
    background work (backups, L3 writes) is drained, untimed, so that it never runs during
    another setup's request."""
    from ..report import progress as bar
    engines: dict[str, DemoEngine] = {}
    results: dict[str, list[RequestResult]] = {n: [] for n in names}
    passed = dict.fromkeys(names, 0)
    busy = dict.fromkeys(names, 0.0)
    exporter = None
    try:
        for name in names:
            engines[name] = eng = DemoEngine(model, cache_cfgs[name], l1_pages=l1_pages,
                                             lower_tiers=name != "L1 only")
            eng.corrupt_restore = corrupt_restore
            eng.warm_up(model.vocab_size)
        if metrics_port is not None:
            from ..prometheus import Source, serve
            exporter = serve([Source(engines[n].cache.metrics_registry, {"setup": n})
                              for n in names], port=metrics_port, host=metrics_host)
            if on_metrics is not None:
                on_metrics(exporter.url)
        steps = bar(range(len(workload) * len(names)), total=len(workload) * len(names),
                    desc="requests x setups", disable=not progress)
        it = iter(steps)
        for i, req in enumerate(workload.requests):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                res = engines[name].serve(req, checks[name])
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
            runs.append(SetupRun(name, l1_pages,
                                 cc.get("host_pool_pages") if name != "L1 only" else None,
                                 cc.get("l3_store"), results[name], cache.metrics(),
                                 busy[name], passed[name], stats))
        close = getattr(steps, "close", None)
        if close is not None:
            close()
        return runs
    finally:
        if exporter is not None:
            exporter.close()
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
    model = DemoModel(cfg.model_size, page_size=cfg.page_size, device=cfg.device,
                      dtype=cfg.dtype, seed=cfg.seed)
    workload = build_workload(cfg, model.vocab_size)
    distinct = distinct_pages(workload, model)
    l1, l2 = tier_sizes(cfg, workload, model, distinct)
    minfo = {"size": model.size.name, "params_m": round(model.num_params / 1e6, 2),
             "layers": model.size.layers, "hidden": model.size.hidden,
             "heads": model.size.heads, "kv_heads": model.size.kv_heads,
             "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
             "page_size": model.spec.page_size, "page_bytes": model.spec.page_bytes,
             "threads": torch.get_num_threads()}
    log(f"kvtier demo: Llama-{model.size.name} ({minfo['params_m']}M params, random weights) "
        f"on {model.device} {minfo['dtype']}, {minfo['threads']} threads; {workload.description}"
        f"; {len(workload)} requests, {workload.total_tokens} prompt tokens, {distinct} "
        f"distinct pages of {model.spec.page_size} tokens ({model.spec.page_bytes} B each); "
        f"L1 {l1} pages, L2 {l2} pages ({host_allocator(cfg)}), L3 {cfg.l3_store} "
        f"({'no limit' if cfg.l3_bytes is None else f'{cfg.l3_bytes} B'})")
    names = [s for s in SETUPS if s in cfg.setups]
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-l3-") as tmp:
        root = tmp if "L1+L2+L3" in names and _store_takes_root(cfg.l3_store) else None
        cfgs = {n: cache_config(cfg, n, model, l2, root) for n in names}
        checks = {n: CheckPolicy(cfg.check, cfg.check_rate, cfg.seed * 1000 + i)
                  for i, n in enumerate(names)}
        runs = run_setups(names, model, workload, cfgs, l1, checks, progress=cfg.progress,
                          corrupt_restore=corrupt_restore, metrics_port=cfg.metrics_port,
                          metrics_host=cfg.metrics_host,
                          on_metrics=on_metrics or (lambda url: log(
                              f"kvtier demo: metrics of every setup at {url}")))
    return DemoReport(cfg, workload, minfo, runs, distinct)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _ratio(x: float | None) -> str:
    return "" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def tables(report: DemoReport) -> str:
    """The comparison table and the details table (markdown)."""
    from ..report import table
    rows = report.summaries()
    main = table(
        ["setup", "hit rate %", "L1 %", "L2 %", "L3 %", "vs L1 only (pts)", "TTFT mean ms",
         "TTFT p90 ms", "mean speedup", "p90 speedup", "computed tok", "loaded tok"],
        [[s["setup"], f"{s['hit_rate_pct']:.1f}", f"{s['l1_hit_pct']:.1f}",
          f"{s['l2_hit_pct']:.1f}", f"{s['l3_hit_pct']:.1f}",
          "" if s["hit_gain_pts"] is None else f"{s['hit_gain_pts']:+.1f}",
          f"{s['ttft_mean_ms']:.1f}", f"{s['ttft_p90_ms']:.1f}", _ratio(s["ttft_speedup"]),
          _ratio(s["p90_speedup"]), s["computed_tokens"], s["loaded_tokens"]] for s in rows])
    details = table(
        ["setup", "L1 pages", "L2 pages", "load ms (mean)", "prefill ms (mean)",
         "L2->L1 MiB", "L1->L2 MiB", "L3 read MiB", "L3 written MiB", "store errors",
         "checked ok", "busy s"],
        [[s["setup"], s["l1_pages"], s["l2_pages"] or "-", f"{s['load_mean_ms']:.2f}",
          f"{s['prefill_mean_ms']:.1f}", _mib(s["bytes_h2d"]), _mib(s["bytes_d2h"]),
          _mib(s["bytes_l3_read"]), _mib(s["bytes_l3_written"]), s["store_errors"],
          s["checks_passed"], f"{s['busy_s']:.1f}"] for s in rows])
    return main + "\n\n" + details


def write_outputs(report: DemoReport, out_dir: str) -> dict[str, str]:
    """results.json, tables.md and (if enabled) demo.png under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    data = {
        "config": asdict(report.config), "model": report.model,
        "workload": {"name": report.workload.name, "description": report.workload.description,
                     "requests": len(report.workload), "rounds": report.workload.num_rounds,
                     "prompt_tokens": report.workload.total_tokens,
                     "distinct_pages": report.distinct_pages},
        "summary": report.summaries(),
        "per_round": {r.name: r.per_round(report.workload.num_rounds) for r in report.runs},
        "cache_metrics": {r.name: r.metrics for r in report.runs},
        "l3_store_stats": {r.name: r.store_stats for r in report.runs if r.store_stats},
    }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    files["json"] = path
    path = os.path.join(out_dir, "tables.md")
    with open(path, "w") as fh:
        fh.write(tables(report) + "\n")
    files["tables"] = path
    if report.config.plot:
        from .plot import plot_rounds
        files["plot"] = plot_rounds(report, os.path.join(out_dir, "demo.png"))
    report.files = files
    return files
