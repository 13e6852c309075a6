"""Host <-> device page transfers: every named transfer engine against the pinned-memcpy
ceiling measured in the same run.

For each case (a KV geometry: MLA 1152 B rows, MHA chunks from 256 B to 128 KiB, page sizes
1..128) the benchmark moves ``--mib`` of randomly scattered pages between a CUDA
``DeviceKVPool`` (layer_first) and a page_first ``HostKVPool``: loads (H2D), backups (D2H) and
both at once, with per-layer or all-layer launches, over a sweep of engine settings (e.g.
``--sweep ctas=1,2,4``). The ceilings are one pinned ``cudaMemcpyAsync`` of the same size in
each direction and both directions at once, measured at the start and again at the end of the
run; ratios use the higher of the two, and a difference over 5% is reported. ``--gemm``
also times a bf16 8192^3 matmul alone and while transfers run. Results print as a table of
GB/s and ratios; ``--json`` keeps them and ``--plot`` draws GB/s against chunk size per engine
(``--replot`` redraws from a JSON file).

Two controls separate the engines' own limits from the access pattern's: ``--order
sequential`` moves pages 0..n-1 in order (the host side becomes one contiguous run per layer
instead of scattered pages), and the ``flat-*`` cases are one layer of one component, so in
sequential order both sides are a single contiguous block (what the ceiling copies).
``--mixed LOAD+BACKUP`` runs loads on one engine and backups on another at the same time (e.g.
``nvidia-tma+nvidia-copy-engine``), against the bidirectional ceiling. ``--host-layout
layer_first`` puts the host pool in layer_first order (one layer of every page together), the
layout whose per-layer transfers read one compact region per layer instead of a slice of every
page. Page indices are handed over where each engine reads them (``indices_on_host``: on the
host for engines that build copy addresses there, else on the device); ``--indices host`` or
``--indices device`` puts them on one side for every engine.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from kvtier.report import progress, table
from kvtier.spec import KVSpec
from kvtier.timing import median_ms, timed_ms

#: name -> (spec, description); page sizes 1..128, chunk = page_size x row bytes.
CASES: dict[str, KVSpec] = {
    "mla-p1": KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=1),
    "mla-p16": KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=16),
    "mla-p64": KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=64),
    "mha-256": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=1),
    "mha-512": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=2),
    "mha-1k": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=4),
    "mha-2k": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=8),
    "mha-8k": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=32),
    "mha-32k": KVSpec.mha(num_layers=32, num_kv_heads=1, head_dim=128, page_size=128),
    "mha-128k": KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64),
    # one layer, one component: a page is one chunk (controls; see --order sequential)
    "flat-72k": KVSpec.mla(num_layers=1, kv_lora_rank=512, rope_dim=64, page_size=64),
    "flat-1m": KVSpec.mla(num_layers=1, kv_lora_rank=512, rope_dim=64, page_size=910),
}
#: Cases run by default (the flat controls only when named).
DEFAULT_CASES = [c for c in CASES if not c.startswith("flat-")]
MODES = ("layer", "all", "default")
DIRECTIONS = ("h2d", "d2h", "both")
MODE_LABELS = {"layer": "per-layer", "all": "all-layer", "default": "engine's defaults"}
BOTH_ORDERS = ("load-first", "backup-first")
DEFAULT_ENGINES = "torch,nvidia-routed,nvidia-tma,nvidia-register,nvidia-copy-engine"


#: No cache is built here (it builds transfer engines from its own flags):
#: `kvtier --config FILE` says the file does not apply (`kvtier.cli`).
BUILDS_CACHE = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default=DEFAULT_ENGINES, help="comma-separated engine names")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated cases (default: {','.join(DEFAULT_CASES)}; also "
                        f"{','.join(c for c in CASES if c not in DEFAULT_CASES)})")
    p.add_argument("--order", choices=["random", "sequential"], default="random",
                   help="page indices: randomly scattered (default) or 0..n-1 in order")
    p.add_argument("--host-layout", choices=["page_first", "layer_first"], default="page_first",
                   help="the host pool's layout (default page_first: a page's layers together)")
    p.add_argument("--indices", choices=["engine", "host", "device"], default="engine",
                   help="where page indices are handed over: where each engine reads them "
                        "(default; engine.indices_on_host), or on the host / on the device "
                        "for every engine (what the other placement costs)")
    p.add_argument("--mixed", action="append", default=[], metavar="LOAD+BACKUP",
                   help="also run loads on engine LOAD and backups on engine BACKUP at once")
    p.add_argument("--mib", type=int, default=512, help="MiB moved per timed transfer")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--directions", default="h2d,d2h,both", help="h2d, d2h, both")
    p.add_argument("--modes", default="layer,all",
                   help="layer: loads and backups per layer; all: one launch each; default: "
                        "the engine's own (per-layer loads, all-layer backups for most: what "
                        "both directions at once are in use)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="engine config values to sweep (engines without KEY ignore it)")
    p.add_argument("--set", action="append", default=[], metavar="ENGINE.KEY=V",
                   help="fixed engine config value")
    p.add_argument("--config", action="append", default=[], metavar="ENGINE:K=V,K=V",
                   help="an explicit engine configuration (repeatable; crossed with --sweep)")
    p.add_argument("--both-order", choices=BOTH_ORDERS, default="load-first",
                   help="both directions at once: the load called first, then the backup "
                        "(default), or the backup first (an engine backing up at the end of "
                        "one step and loading at the start of the next)")
    p.add_argument("--behind-ms", type=float, default=0.0, metavar="MS",
                   help="queue each timed transfer (and the ceilings' copies) behind MS of GPU "
                        "work on its stream, timed from when that work ends: the host's "
                        "queuing and launch overlap the GPU's work, as in an engine whose "
                        "stream is busy when it calls (default 0: timed from an idle GPU, the "
                        "host's part included)")
    p.add_argument("--both-sweep", action="store_true",
                   help="sweep settings for bidirectional runs too (default: first values)")
    p.add_argument("--host-allocator", default="cuda-host-register",
                   help="host allocator for the pools and the ceiling (default "
                        "cuda-host-register, falling back to torch-pinned)")
    p.add_argument("--gemm", action="store_true", help="time a concurrent bf16 GEMM")
    p.add_argument("--gemm-cases", default="mla-p1,mha-32k")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--plot", help="save a PNG of GB/s vs chunk size here")
    p.add_argument("--replot", help="read results from this JSON instead of running")
    p.add_argument("--plot-engines", help="comma-separated engines to draw (default: all)")
    p.add_argument("--plot-split", metavar="KEY",
                   help="one line per value of this engine config key (a --sweep key) instead "
                        "of each engine's best setting")


def parse_value(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def environment(torch) -> dict[str, Any]:
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                              "pcie.link.width.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        drv, gen, width = [x.strip() for x in out.splitlines()[0].split(",")]
        env.update(driver=drv, pcie=f"Gen{gen} x{width}")
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    return env


def ceilings(torch, host_raw, nbytes: int, repeat: int,
             behind_ms: float = 0.0) -> dict[str, float]:
    """GB/s of one pinned block copy each way and of both directions at once."""
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h_a, h_b = host_raw[:nbytes], host_raw[nbytes:2 * nbytes]
    s1 = torch.cuda.Stream()
    out = {"h2d": nbytes / median_ms(torch, lambda: dev_a.copy_(h_a, non_blocking=True),
                                      repeat, behind_ms=behind_ms) / 1e6,
           "d2h": nbytes / median_ms(torch, lambda: h_b.copy_(dev_b, non_blocking=True),
                                      repeat, behind_ms=behind_ms) / 1e6}

    def both() -> None:
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        dev_a.copy_(h_a, non_blocking=True)
        with torch.cuda.stream(s1):
            h_b.copy_(dev_b, non_blocking=True)
        cur.wait_stream(s1)
    out["both"] = 2 * nbytes / median_ms(torch, both, repeat, behind_ms=behind_ms) / 1e6
    return out


#: A ceiling that differs by more than this between the start and the end of a run is
#: reported (the link, or what shares it, changed while the engines were measured).
CEILING_DRIFT = 0.05


def settle_ceilings(data: dict[str, Any], end: dict[str, float]) -> float:
    """Take the ceilings measured again at the end of a run: each direction's ceiling becomes
    the higher of the start and end figures (a ratio is never taken against a link that ran
    slow for a while), every result's ratio follows it, and both measurements are kept
    (``ceiling_start``, ``ceiling_end``). Returns the largest relative difference between
    them."""
    start = data["ceiling"]
    data["ceiling_start"], data["ceiling_end"] = dict(start), dict(end)
    data["ceiling"] = {k: max(v, end.get(k, 0.0)) for k, v in start.items()}
    for r in data["results"]:
        r["ratio"] = r["gbps"] / data["ceiling"][r["direction"]]
    return max((abs(v - end[k]) / max(v, end[k]) for k, v in start.items()
                if k in end and max(v, end[k]) > 0), default=0.0)


def _gbps_text(ce: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f} GB/s" for k, v in ce.items())


def host_copies(torch, host_raw, nbytes: int, repeat: int, row: int = 128 << 10,
                staging: int = 32 << 20) -> dict[str, float]:
    """GB/s of the staged path's CPU side: torch's CPU index ops gathering random rows of the
    host buffer into a pinned staging buffer (and scattering them back), called from a thread
    of their own as the `torch` engine's worker calls them: what bounds that path."""
    import threading
    rows = max(1, nbytes // row)
    per = max(1, staging // row)
    src = host_raw[:rows * row].view(torch.int64).view(rows, row // 8)
    stage = torch.empty((per, row // 8), dtype=torch.int64,
                        pin_memory=torch.cuda.is_available())
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(rows, generator=g)
    out: dict[str, float] = {}

    def timed(gather: bool) -> float:
        times = []
        for i in range(repeat + 1):
            t = time.perf_counter()
            for s in range(0, rows, per):
                idx = order[s:s + per]
                if gather:
                    torch.index_select(src, 0, idx, out=stage[:len(idx)])
                else:
                    src.index_copy_(0, idx, stage[:len(idx)])
            if i:
                times.append(time.perf_counter() - t)
        return rows * row / statistics.median(times) / 1e9

    def work() -> None:
        out["gather"] = timed(True)
        out["scatter"] = timed(False)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    out["threads"] = torch.get_num_threads()
    return out


def _configs(cls, sweeps: dict[str, list], fixed: dict[str, Any],
             explicit: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each engine's configs: the sweeps' and fixed values it takes (a composed config's
    paths take theirs: `keys_for`), crossed with its explicit configs."""
    from kvtier.config import keys_for
    own = {k: v for k, v in sweeps.items() if keys_for(cls.Config, {k: None})}
    combos = [dict(zip(own, vals)) for vals in itertools.product(*own.values())] or [{}]
    bases = explicit or [{}]
    return [{**keys_for(cls.Config, fixed), **b, **keys_for(cls.Config, c)}
            for b in bases for c in combos]


def _check_args(args: argparse.Namespace) -> str | None:
    bad = [c for c in args.cases.split(",") if c and c not in CASES]
    if bad:
        return f"unknown case(s) {', '.join(bad)}; have {', '.join(CASES)}"
    for m in args.mixed:
        if m.count("+") != 1 or not all(m.split("+")):
            return f"--mixed {m!r}: expected LOAD_ENGINE+BACKUP_ENGINE"
    if args.mib <= 0 or args.repeat <= 0:
        return "--mib and --repeat must be positive"
    if not 0 <= args.behind_ms <= 10_000:      # NaN fails both comparisons
        return f"--behind-ms {args.behind_ms}: expected 0 to 10000 (milliseconds)"
    for flag, given, known in (("--modes", args.modes, MODES),
                               ("--directions", args.directions, DIRECTIONS)):
        bad = [x for x in given.split(",") if x and x not in known]
        if bad:
            return f"{flag}: unknown {', '.join(bad)}; have {', '.join(known)}"
    return None


def make_pools(torch, pools: dict[str, Any], case: str, nbytes: int, host_buf,
               order: str, host_layout: str = "page_first") -> None:
    """Device and host pools for ``case`` and four index sets of ``n`` pages each: loads
    read ``host`` into ``dev``, backups write ``dev2`` to ``host2`` (disjoint, so a load and a
    backup at once never touch the same page)."""
    from kvtier.device_pool import DeviceKVPool
    from kvtier.host_pool import HostKVPool
    from kvtier.testing.data import fill_random
    spec = CASES[case]
    pools.clear()
    torch.cuda.empty_cache()
    n = max(1, nbytes // spec.page_bytes)
    hp = min(4 * nbytes // spec.page_bytes, 2 * n + n // 2)
    dp = 2 * n + 1 if order == "sequential" else n + n // 4 + 1
    dpool = DeviceKVPool.empty(spec, dp, "cuda")
    for comp in dpool.require_layers("bench transfer"):
        for t in comp:
            fill_random(t)
    hpool = HostKVPool(spec, hp, buffer=host_buf, layout=host_layout)
    if order == "sequential":
        seq = torch.arange(2 * n)
        dev, dev2, host, host2 = seq[:n], seq[n:], seq[:n], seq[n:]
    else:
        g = torch.Generator().manual_seed(7)
        hperm = torch.randperm(hp, generator=g)
        dev = torch.randperm(dp, generator=g)[:n]
        dev2 = torch.randperm(dp, generator=g)[:n]
        host, host2 = hperm[:n], hperm[n:2 * n]
    pools.update(case=case, n=n, dpool=dpool, hpool=hpool, dev=dev.cuda(), dev2=dev2.cuda(),
                 host=host.cuda(), host2=host2.cuda())


def run(args: argparse.Namespace) -> int:
    err = _check_args(args)
    if err:
        print(f"kvtier bench transfer: {err}", file=sys.stderr)
        return 2
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        print(render(data))
        if args.plot:
            plot(data, args.plot, engines=args.plot_engines, split=args.plot_split)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("kvtier bench transfer: no CUDA device here", file=sys.stderr)
        return 2
    with torch.cuda.stream(torch.cuda.Stream()):   # as engines run: never the legacy stream
        return _run(args, torch)


def _run(args: argparse.Namespace, torch) -> int:
    from kvtier import registry
    from kvtier.errors import BackendUnavailableError, KVTierError
    from kvtier.testing.data import fill_random
    sweeps = {}
    for s in args.sweep:
        k, _, v = s.partition("=")
        sweeps[k] = [parse_value(x) for x in v.split(",") if x]
    fixed: dict[str, dict[str, Any]] = {}
    for s in args.set:
        k, _, v = s.partition("=")
        eng, _, key = k.partition(".")
        fixed.setdefault(eng, {})[key] = parse_value(v)
    explicit: dict[str, list[dict[str, Any]]] = {}
    for s in args.config:
        eng, _, kvs = s.partition(":")
        explicit.setdefault(eng, []).append(
            {k: parse_value(v) for k, _, v in (x.partition("=") for x in kvs.split(",") if x)})
    engines = []
    for name in [e for e in args.engines.split(",") if e]:
        try:
            engines.append((name, registry.get_backend_class("kvtier.transfer_engines", name)))
        except BackendUnavailableError as exc:
            print(f"skipping {name}: {exc.reason}", file=sys.stderr)
    nbytes = args.mib << 20
    try:
        alloc = registry.create_host_allocator(args.host_allocator)
    except KVTierError as exc:
        print(f"{args.host_allocator} unavailable ({exc}); using torch-pinned", file=sys.stderr)
        alloc = registry.create_host_allocator("torch-pinned")
    host_buf = alloc.allocate(4 * nbytes + (64 << 20))
    fill_random(host_buf.tensor[:4 * nbytes])
    data: dict[str, Any] = {"env": environment(torch),
                            "command": " ".join(["kvtier", *sys.argv[1:]]),
                            "host_backing": host_buf.backing, "mib": args.mib,
                            "repeat": args.repeat, "results": [], "gemm": []}
    data.update(order=args.order, host_layout=args.host_layout, indices=args.indices,
                both_order=args.both_order, behind_ms=args.behind_ms)
    data["ceiling"] = ceilings(torch, host_buf.tensor, nbytes, args.repeat, args.behind_ms)
    print(f"ceiling (pinned cudaMemcpyAsync, {args.mib} MiB; measured again at the end): "
          + _gbps_text(data["ceiling"]), file=sys.stderr)
    data["host_copies"] = host_copies(torch, host_buf.tensor[3 * nbytes:4 * nbytes], nbytes,
                                      args.repeat)
    print(_host_copies_text(data["host_copies"]), file=sys.stderr)
    directions = [d for d in args.directions.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    work = [(c, e, cfg) for c in cases for e in engines
            for cfg in _configs(e[1], sweeps, fixed.get(e[0], {}), explicit.get(e[0]))]
    bar = progress(work, desc="transfer cases")
    pools: dict[str, Any] = {}
    for case, (name, cls), cfg in bar:
        spec = CASES[case]
        if pools.get("case") != case:
            _save(data, args.json)         # keep what is measured if the run is cut short
            make_pools(torch, pools, case, nbytes, host_buf, args.order, args.host_layout)
        n, dpool, hpool = pools["n"], pools["dpool"], pools["hpool"]
        moved = n * spec.page_bytes
        first_cfg = cfg == _configs(cls, sweeps, fixed.get(name, {}), explicit.get(name))[0]
        for mode in _modes(cls, modes):
            full = _with_mode(cls, cfg, mode)
            try:
                eng = cls(dpool, hpool, full)
            except KVTierError as exc:
                print(f"{name} {case} {full}: {exc}", file=sys.stderr)
                continue
            side = torch.cuda.Stream()
            h, d = indices(pools, eng, "load", args.indices)
            h2, d2 = indices(pools, eng, "backup", args.indices)
            fns = {"h2d": lambda eng=eng, h=h, d=d: eng.load(h, d).wait(),
                   "d2h": lambda eng=eng, h=h, d=d: eng.backup(d, h).wait(),
                   "both": lambda eng=eng, side=side, h=h, h2=h2, d=d, d2=d2: _both(
                       torch, eng, eng, side, h, d, h2, d2, args.both_order)}
            for direction in directions:
                if direction == "both" and not (first_cfg or args.both_sweep):
                    continue
                ms, call_ms = timed_ms(torch, fns[direction], args.repeat,
                                       behind_ms=args.behind_ms)
                total = moved * (2 if direction == "both" else 1)
                gbps = total / ms / 1e6
                data["results"].append({
                    "case": case, "kind": spec.kind, "chunk_bytes": spec.chunk_bytes,
                    "page_size": spec.page_size, "layers": spec.num_layers,
                    "engine": name, "config": cfg, "mode": mode, "direction": direction,
                    "bytes": total, "ms": ms, "call_ms": call_ms, "gbps": gbps,
                    "ratio": gbps / data["ceiling"][direction],
                    "info": eng.describe() if hasattr(eng, "describe") else {},
                    "ctas": getattr(eng, "ctas", None) if direction != "both"
                    else (2 * eng.ctas if getattr(eng, "ctas", None) else None)})
            eng.close()
    _save(data, args.json)
    for pair in args.mixed:
        _mixed(torch, data, pair, cases, modes, fixed, nbytes, host_buf, pools, args)
    _save(data, args.json)
    if args.gemm:
        data["gemm"] = gemm_slowdown(torch, engines, sweeps, fixed, args, host_buf, pools)
    end = ceilings(torch, host_buf.tensor, nbytes, args.repeat, args.behind_ms)
    moved_by = settle_ceilings(data, end)
    if moved_by > CEILING_DRIFT:
        print("the link's ceiling moved during the run by up to "
              f"{100 * moved_by:.0f}% (start: " + _gbps_text(data["ceiling_start"]) + "; end: "
              + _gbps_text(end) + "): ratios use the higher of the two", file=sys.stderr)
    _save(data, args.json)
    print(render(data))
    if args.plot:
        plot(data, args.plot, engines=args.plot_engines, split=args.plot_split)
    return 0


def indices(pools: dict[str, Any], eng: Any, op: str, where: str = "engine") -> tuple[Any, Any]:
    """(host, device) indices for a load or a backup, where the engine reads them (on the host
    where ``eng.indices_on_host`` says so for the direction, else on the device), or where
    ``where`` ("host" or "device") puts them for every engine."""
    h, d = (pools["host"], pools["dev"]) if op == "load" else (pools["host2"], pools["dev2"])
    on_host = where == "host" if where != "engine" \
        else eng.indices_on_host("h2d" if op == "load" else "d2h")
    if on_host:
        h, d = h.cpu(), d.cpu()
    return h, d


def _layer_keys(cls: type[Any]) -> bool:
    keys = getattr(cls.Config, "__dataclass_fields__", {})
    return "layerwise_load" in keys and "layerwise_backup" in keys


def _modes(cls: type, modes: list[str]) -> list[str]:
    """Launch modes an engine has: engines without the layerwise switches run per layer."""
    if _layer_keys(cls):
        return modes
    return ["layer"] if modes else []


def _with_mode(cls: type, cfg: dict[str, Any], mode: str) -> dict[str, Any]:
    """``cfg`` with the mode's layerwise switches ("default": the engine's own, or the
    sweep's)."""
    if not _layer_keys(cls) or mode == "default":
        return dict(cfg)
    lw = mode == "layer"
    return {**cfg, "layerwise_load": lw, "layerwise_backup": lw}


def _both(torch, load_eng, backup_eng, side, h, d, h2, d2, order: str = "load-first") -> None:
    """A load on the current stream and a backup on ``side`` at the same time, called in
    ``order`` (see ``BOTH_ORDERS``)."""
    if order not in BOTH_ORDERS:
        raise ValueError(f"order must be one of {BOTH_ORDERS}, got {order!r}")
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    if order == "backup-first":
        with torch.cuda.stream(side):
            b = backup_eng.backup(d2, h2)
        a = load_eng.load(h, d)
    else:
        a = load_eng.load(h, d)
        with torch.cuda.stream(side):
            b = backup_eng.backup(d2, h2)
    with torch.cuda.stream(side):
        b.wait()
    a.wait()
    cur.wait_stream(side)


def _mixed(torch, data, pair, cases, modes, fixed, nbytes, host_buf, pools, args) -> None:
    """Loads on one engine, backups on another, at once (engine defaults plus --set)."""
    from kvtier import registry
    from kvtier.errors import KVTierError
    names = pair.split("+")
    try:
        classes = [registry.get_backend_class("kvtier.transfer_engines", n) for n in names]
    except KVTierError as exc:
        print(f"skipping --mixed {pair}: {exc}", file=sys.stderr)
        return
    for case in progress(cases, desc=f"mixed {pair}"):
        spec = CASES[case]
        if pools.get("case") != case:
            make_pools(torch, pools, case, nbytes, host_buf, args.order, args.host_layout)
        moved = 2 * pools["n"] * spec.page_bytes
        for mode in modes:
            engs = []
            try:
                for n, cls in zip(names, classes):
                    cfg = _configs(cls, {}, fixed.get(n, {}))[0]
                    engs.append(cls(pools["dpool"], pools["hpool"], _with_mode(cls, cfg, mode)))
            except KVTierError as exc:
                print(f"--mixed {pair} {case}: {exc}", file=sys.stderr)
                for e in engs:
                    e.close()
                continue
            h, d = indices(pools, engs[0], "load", args.indices)
            h2, d2 = indices(pools, engs[1], "backup", args.indices)
            side = torch.cuda.Stream()
            run_both = functools.partial(_both, torch, engs[0], engs[1], side, h, d, h2, d2,
                                         args.both_order)
            ms, call_ms = timed_ms(torch, run_both, args.repeat, behind_ms=args.behind_ms)
            gbps = moved / ms / 1e6
            data["results"].append({
                "case": case, "kind": spec.kind, "chunk_bytes": spec.chunk_bytes,
                "page_size": spec.page_size, "layers": spec.num_layers, "engine": pair,
                "config": {}, "mode": mode, "direction": "both", "bytes": moved, "ms": ms,
                "call_ms": call_ms, "gbps": gbps, "ratio": gbps / data["ceiling"]["both"],
                "info": {}, "ctas": sum(getattr(e, "ctas", 0) or 0 for e in engs) or None})
            for e in engs:
                e.close()


def _save(data: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def gemm_slowdown(torch, engines, sweeps, fixed, args, host_buf, pools) -> list[dict[str, Any]]:
    """bf16 8192^3 matmul time alone vs while an engine runs loads and backups back to back
    on two other streams; the GEMM on a normal- and on a high-priority stream."""
    from kvtier.device_pool import DeviceKVPool
    from kvtier.host_pool import HostKVPool
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    reps = 20
    streams = {"normal": torch.cuda.Stream(), "high": torch.cuda.Stream(priority=-1)}

    def gemms() -> None:
        for _ in range(reps):
            torch.matmul(a, b, out=c)

    def timed(prio: str) -> float:
        with torch.cuda.stream(streams[prio]):
            return median_ms(torch, gemms, 5) / reps
    base = {p: min(timed(p) for _ in range(2)) for p in streams}
    out: list[dict[str, Any]] = [{"engine": "none", "case": "", "priority": p,
                                  "gemm_ms": base[p], "transfer_gbps": None} for p in streams]
    nbytes = args.mib << 20
    for case in [x for x in args.gemm_cases.split(",") if x]:
        spec = CASES[case]
        pools.clear()
        torch.cuda.empty_cache()
        n = max(1, nbytes // spec.page_bytes)
        dpool = DeviceKVPool.empty(spec, 2 * n, "cuda")
        hpool = HostKVPool(spec, min(2 * n, 4 * nbytes // spec.page_bytes), buffer=host_buf,
                           layout=args.host_layout)
        idx = torch.arange(n, device="cuda")
        idx2 = idx + n
        for name, cls in engines:
            cfg = _configs(cls, {}, fixed.get(name, {}))[0]
            eng = cls(dpool, hpool, cfg)
            gp = {"host": idx, "dev": idx, "host2": idx2, "dev2": idx2}
            hi, di = indices(gp, eng, "load", args.indices)
            hi2, di2 = indices(gp, eng, "backup", args.indices)
            for prio in streams:
                load_s, back_s = torch.cuda.Stream(), torch.cuda.Stream()
                # enough transfers to cover the GEMM window, on their own streams
                window_ms = base[prio] * reps * 6 * 1.5
                k = int(window_ms / max(1.0, nbytes / 40e6)) + 2
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(load_s):
                    t0.record()
                    for _ in range(k):
                        eng.load(hi, di).wait()
                with torch.cuda.stream(back_s):
                    for _ in range(k):
                        eng.backup(di2, hi2).wait()
                g = timed(prio)
                with torch.cuda.stream(load_s):
                    load_s.wait_stream(back_s)
                    t1.record()
                t1.synchronize()
                moved = 2 * k * n * spec.page_bytes
                out.append({"engine": name, "case": case, "priority": prio, "gemm_ms": g,
                            "slowdown": g / base[prio] - 1,
                            "transfer_gbps": moved / t0.elapsed_time(t1) / 1e6,
                            "config": cfg,
                            "info": eng.describe() if hasattr(eng, "describe") else {}})
            eng.close()
        del dpool, hpool
    return out


def _cfg_text(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def _host_copies_text(h: dict[str, float]) -> str:
    return (f"host index copies (the staged path's CPU side; 128 KiB rows in random order, "
            f"{h['threads']} torch threads): gather {h['gather']:.1f} GB/s, scatter "
            f"{h['scatter']:.1f} GB/s")


def _timing_text(data: dict[str, Any]) -> str:
    behind = data.get("behind_ms") or 0
    when = (f"timed from the end of {behind:g} ms of GPU work queued before each call "
            "(the host's queuing overlaps it)" if behind else
            "timed from an idle GPU (the host's queuing and launch included)")
    return f"{when}; both directions called {data.get('both_order', 'load-first')}"


def render(data: dict[str, Any]) -> str:
    env = data.get("env", {})
    ce = data["ceiling"]
    where = data.get("indices", "engine")
    where = "where each engine reads them" if where == "engine" else f"on the {where}"
    lines = [f"{env.get('gpu', '?')}  driver {env.get('driver', '?')}  {env.get('pcie', '')}  "
             f"host memory: {data.get('host_backing', '?')}  {data.get('mib')} MiB per transfer  "
             f"pages in {data.get('order', 'random')} order, host pool "
             f"{data.get('host_layout', 'page_first')}, page indices {where}",
             _timing_text(data),
             "ceiling (one pinned cudaMemcpyAsync): " + _gbps_text(ce)]
    if data.get("ceiling_end"):
        lines[-1] += (" (the higher of the run's start: " + _gbps_text(data["ceiling_start"])
                      + "; and end: " + _gbps_text(data["ceiling_end"]) + ")")
    if data.get("host_copies"):
        lines.append(_host_copies_text(data["host_copies"]))
    routed = any(_route_text(r.get("info")) != "-"
                 for r in [*data["results"], *data.get("gemm", [])])
    rows = [[r["case"], r["chunk_bytes"], r["engine"], _cfg_text(r["config"]), r["mode"],
             r["direction"], r.get("ctas") or "-", f"{r['gbps']:.1f}", f"{100 * r['ratio']:.1f}%",
             f"{r['call_ms']:.2f} / {r['ms']:.2f}" if "call_ms" in r else "-",
             *([_route_text(r.get("info"))] if routed else [])]
            for r in data["results"]]
    lines.append(table(["case", "chunk B", "engine", "config", "launch", "dir", "CTAs", "GB/s",
                        "of ceiling", "call / GPU ms", *(["routes"] if routed else [])], rows))
    if routed:
        lines.append("routes: where a routing engine sent loads / backups (CE: copy engine, "
                     "SM: SM kernel; 'moved': a direction its in-use check moved)")
    if data.get("gemm"):
        g = [[x["engine"], x["case"] or "-", x.get("priority", "normal"), f"{x['gemm_ms']:.3f}",
              f"{100 * x['slowdown']:+.1f}%" if "slowdown" in x else "-",
              f"{x['transfer_gbps']:.1f}" if x.get("transfer_gbps") else "-",
              *([_route_text(x.get("info"))] if routed else [])]
             for x in data["gemm"]]
        lines.append("bf16 8192^3 GEMM while loads and backups run on other streams")
        lines.append(table(["engine", "case", "GEMM stream", "GEMM ms", "slowdown",
                            "transfer GB/s", *(["routes"] if routed else [])], g))
    return "\n".join(lines)


def _route_text(info: Any) -> str:
    """A routing engine's routes as its describe() gave them: "CE / SM" (loads / backups),
    with the directions its in-use check moved; "-" for other engines."""
    route = info.get("route") if isinstance(info, dict) else None
    if not isinstance(route, dict) or not {"h2d", "d2h"} <= set(route):
        return "-"
    short = {"copy_engine": "CE", "sm": "SM"}
    text = " / ".join(short.get(route[d], str(route[d])) for d in ("h2d", "d2h"))
    moved = info.get("rerouted") or {}
    if moved:
        text += " (moved: " + ", ".join(sorted(moved)) + ")"
    return text


def plot(data: dict[str, Any], path: str, max_series: int = 8, engines: str | None = None,
         split: str | None = None) -> None:
    """% of the same-run ceiling vs chunk size: one panel per direction, one line per engine
    and launch mode (its best setting at each size; with ``split``, one per value of that
    config key), the legend below the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dirs = [d for d in ("h2d", "d2h", "both") if any(r["direction"] == d
                                                     for r in data["results"])]
    order: list[str] = []
    keep = set(engines.split(",")) if engines else None
    for r in data["results"]:
        if r["engine"] not in order and (keep is None or r["engine"] in keep):
            order.append(r["engine"])
    # one panel still gets room for a legend of two columns of engine names
    fig, axes = plt.subplots(1, len(dirs), figsize=(max(5.2 * len(dirs), 8.0), 4.4),
                             squeeze=False, sharey=True)
    ncol = 4 if len(dirs) > 1 else 2
    handles: dict[str, Any] = {}
    colors: dict[tuple[str, str], int] = {}
    for ax, d in zip(axes[0], dirs):
        series: dict[tuple[str, str, str], dict[int, float]] = {}
        for r in data["results"]:
            if r["direction"] != d or r["engine"] not in order:
                continue
            value = f"{split}={r['config'][split]}" \
                if split and split in r.get("config", {}) else ""
            cur = series.setdefault((r["engine"], r["mode"], value), {})
            cur[r["chunk_bytes"]] = max(cur.get(r["chunk_bytes"], 0), 100 * r["ratio"])
        keys = sorted(series, key=lambda k: (order.index(k[0]), k[2], k[1] != "all")
                      )[:max_series]
        for key in keys:
            pts = series[key]
            xs = sorted(pts)
            label = f"{key[0]} ({MODE_LABELS.get(key[1], key[1])}" \
                    + (f", {key[2]})" if key[2] else ")")
            if not split:
                color = plt.cm.tab10(order.index(key[0]) % 10)
            else:                           # a colour per engine and split value
                color = plt.cm.tab10(colors.setdefault(key[::2], len(colors)) % 10)
            (line,) = ax.plot(xs, [pts[x] for x in xs], marker="o", ms=3, color=color,
                              ls={"layer": "--", "default": ":"}.get(key[1], "-"), lw=1.2)
            handles.setdefault(label, line)
        for y, style in ((92, ":"), (50, "-.")):
            ax.axhline(y, color="gray", ls=style, lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk bytes (page_size x row)")
        ax.set_title(f"{d}: ceiling {data['ceiling'][d]:.1f} GB/s")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("% of the same-run ceiling (dotted 92%, dash-dot 50%)")
    fig.legend(list(handles.values()), list(handles), loc="lower center",
               ncol=min(ncol, len(handles)), fontsize=8, frameon=False)
    env = data.get("env", {})
    behind = data.get("behind_ms") or 0
    when = f"queued behind {behind:g} ms of GPU work" if behind else "from an idle GPU"
    fig.suptitle(f"kvtier page transfers, {env.get('gpu', '')}, driver {env.get('driver', '')},"
                 f" {env.get('date', '')}; timed {when}, both ways called "
                 f"{data.get('both_order', 'load-first')}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(handles) - 1) // ncol), 1, 1))
    fig.savefig(path, dpi=130)
