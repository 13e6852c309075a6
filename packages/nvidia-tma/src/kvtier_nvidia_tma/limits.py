"""What limits host <-> device page transfers on this GPU: ``kvtier bench limits``
(or ``python -m kvtier_nvidia_tma.limits``).

``kvtier bench transfer`` says how fast each engine is against the pinned-memcpy ceiling; these
probes say why it is not faster. Each prints a table and, with ``--json``, keeps every number.

``gemm``
    A bf16 8192^3 GEMM alone; while a kernel that only *holds* 1, 2, 4, 8 SMs runs
    (``kvt_hold``: a transfer kernel's block and shared memory, or one warp and none; no
    memory traffic); and while an engine's loads, backups or both run back to back. Where a
    hold of the same SMs costs the GEMM what the transfers cost, the slowdown is SM occupancy,
    not memory traffic. The GEMM's own launch shape (grid, block, shared memory, registers)
    comes from the profiler.
``pcie``
    The PCIe byte counters NVML keeps (``nvmlDeviceGetPcieThroughput``: what crossed the link,
    sampled every 20 ms) against the payload moved, for the memcpy ceiling and each engine,
    each direction: link bytes per payload byte, and the reverse direction's traffic (read
    requests during loads).
``latency``
    The round-trip time of one PCIe read (``kvt_read_latency``: one thread following a chain of
    dependent reads through registered host memory) with the link idle and while memcpys or an
    engine's loads and backups run, and the load rate that the reads an engine keeps in flight
    allow at that latency.
``queue``
    The copy engine's copies: host microseconds to queue one (``cuMemcpyBatchAsync``), and
    both directions at once queued one after the other from one thread, from a thread each,
    and queued before either starts; and one direction queued from several threads at once
    (``--issue-threads``), a slice of its copies and a stream each.
``routes``
    ``nvidia-routed``'s calibration, measured again ``--repeat`` times per case (no cache):
    per direction and chunk size, the copy engine's rate against the SM kernel's from an idle
    GPU and behind GPU work, the share of its device time its call holds the host, whether it
    takes that size, and the route the case's chunks get. Routes that differ between runs are
    routes a machine's starts would not agree on.
``ncu``
    Runs Nsight Compute (where installed) over a few transfer launches and reports the
    kernels' system-memory requests at L2 (requests, sectors, bytes per request) and any
    PCIe counters the tool offers for this chip.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

GEMM_N = 8192


def _transfer_bench(*names: str) -> tuple[Any, ...]:
    """``names`` from kvtier-tools' transfer benchmark (``kvtier bench transfer``), whose cases,
    pools and environment these probes share; without kvtier-tools, a one-line error."""
    import importlib

    from kvtier.errors import KVTierError
    try:
        mod = importlib.import_module("kvtier_tools.bench.transfer")
    except ImportError as exc:
        if not (exc.name or "").startswith("kvtier_tools"):
            raise
        raise KVTierError("kvtier bench limits needs kvtier-tools (its transfer cases): pip "
                          "install kvtier-tools (from a clone: pip install packages/tools)"
                          ) from None
    return tuple(getattr(mod, n) for n in names)


# ----------------------------------------------------------------------------------------------
# Shared set-up
# ----------------------------------------------------------------------------------------------
def _setup(mib: int):
    import torch
    from kvtier import registry
    (environment,) = _transfer_bench("environment")
    from kvtier.testing.data import fill_random
    if not torch.cuda.is_available():
        raise SystemExit("kvtier_nvidia_tma.limits: no CUDA device here")
    nbytes = mib << 20
    alloc = registry.create_host_allocator("cuda-host-register")
    host_buf = alloc.allocate(4 * nbytes + (64 << 20))
    fill_random(host_buf.tensor[:4 * nbytes])
    env = {**environment(torch), "host_backing": host_buf.backing, "mib": mib}
    return torch, nbytes, host_buf, env


def _engine(name: str, pools: dict[str, Any], config: dict[str, Any] | None = None):
    """``name`` on the pools, with the keys of ``config`` it has, ``nvidia-routed``'s paths'
    keys under its ``copy_engine`` and ``sm`` (others are ignored)."""
    from kvtier import registry
    from kvtier.config import keys_for
    cls = registry.get_backend_class("kvtier.transfer_engines", name)
    return cls(pools["dpool"], pools["hpool"], keys_for(cls.Config, config or {}))


def footprint(eng, n: int, layers: int) -> tuple[int, int, int]:
    """(grid, threads, dynamic shared memory) of one launch of ``eng``'s kernel."""
    c = eng.config
    if eng.name == "nvidia-tma":
        plan, _ = eng.plan(n, 0, layers)
        return plan.grid, plan.threads, plan.smem_bytes
    if eng.name == "nvidia-register":
        return c.ctas, c.threads, 0
    raise ValueError(f"{eng.name} launches no kernel of its own")


class Hold:
    """Launches ``kvt_hold``: occupies grid x threads x smem for a while, moves nothing."""

    def __init__(self, ordinal: int = 0):
        from . import _driver
        self._drv = _driver
        self._dev = _driver.device(ordinal)
        self._k = _driver.load_kernel(self._dev, "hold.cu", "kvt_hold")

    def launch(self, grid: int, threads: int, smem: int, ms: float, stream: int) -> None:
        self._dev.make_current()
        self._drv.set_dynamic_smem(self._k, smem)
        self._drv.launch(self._k, grid, threads, smem, stream,
                         ctypes.c_uint64(int(ms * 1e6)))


# ----------------------------------------------------------------------------------------------
# gemm: slowdown from transfers vs from SM occupancy alone
# ----------------------------------------------------------------------------------------------
def gemm_shape(torch, a, b, c) -> dict[str, Any]:
    """Name and launch shape of the kernel(s) one ``torch.matmul`` runs, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    if not kernels:
        return {}
    k = max(kernels, key=lambda e: e.get("dur", 0))
    args = k.get("args", {})
    return {"kernel": k.get("name", "")[:120], "grid": args.get("grid"),
            "block": args.get("block"), "shared_memory": args.get("shared memory"),
            "registers": args.get("registers per thread"),
            "blocks_per_sm": args.get("blocks per SM"), "us": k.get("dur")}


def probe_gemm(args) -> dict[str, Any]:
    from kvtier.timing import median_ms
    CASES, indices, make_pools = _transfer_bench("CASES", "indices", "make_pools")
    torch, nbytes, host_buf, env = _setup(args.mib)
    with torch.cuda.stream(torch.cuda.Stream()):
        a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
        c = torch.empty_like(a)
        reps = 20
        gstream = torch.cuda.Stream()

        def timed() -> float:
            def gemms() -> None:
                for _ in range(reps):
                    torch.matmul(a, b, out=c)
            with torch.cuda.stream(gstream):
                return median_ms(torch, gemms, 5) / reps
        shape = gemm_shape(torch, a, b, c)
        base = min(timed() for _ in range(3))
        window_ms = base * reps * 6 * 3            # the timed GEMMs fit well inside
        hold = Hold()
        rows: list[dict[str, Any]] = [{"case": "-", "engine": "none", "load": "-",
                                       "gemm_ms": base, "slowdown": 0.0}]
        hs = torch.cuda.Stream()
        # SM occupancy alone: CTAs that hold an SM each and move nothing
        for ctas in [int(x) for x in args.hold_ctas.split(",") if x]:
            for threads, smem in ((512, 192 << 10), (32, 0)):
                hold.launch(ctas, threads, smem, window_ms, hs.cuda_stream)
                g = timed()
                torch.cuda.synchronize()
                rows.append({"case": "-", "engine": "kvt_hold", "load": "hold",
                             "gemm_ms": g, "slowdown": g / base - 1,
                             "footprint": [[ctas, threads, smem]]})
        pools: dict[str, Any] = {}
        for case in args.cases.split(","):
            make_pools(torch, pools, case, nbytes, host_buf, "random")
            spec = CASES[case]
            for name in args.engines.split(","):
                eng = _engine(name, pools, args.engine_config)
                h, d = indices(pools, name, "load")
                h2, d2 = indices(pools, name, "backup")
                ls, bs = torch.cuda.Stream(), torch.cuda.Stream()
                one = median_ms(torch, lambda eng=eng, h=h, d=d: eng.load(h, d).wait(), 3)
                k = int(window_ms / one) + 2
                L = spec.num_layers
                fp_load = footprint(eng, pools["n"], 1 if eng.config.layerwise_load else L)
                fp_back = footprint(eng, pools["n"], 1 if eng.config.layerwise_backup else L)
                # the engine's own loads and/or backups, back to back on their own streams
                for ops in args.ops.split(","):
                    if ops in ("loads", "both"):
                        with torch.cuda.stream(ls):
                            for _ in range(k):
                                eng.load(h, d).wait()
                    if ops in ("backups", "both"):
                        with torch.cuda.stream(bs):
                            for _ in range(k):
                                eng.backup(d2, h2).wait()
                    g = timed()
                    torch.cuda.synchronize()
                    fps = {"loads": [fp_load], "backups": [fp_back],
                           "both": [fp_load, fp_back]}[ops]
                    rows.append({"case": case, "engine": name, "load": ops, "gemm_ms": g,
                                 "slowdown": g / base - 1, "footprint": [list(x) for x in fps],
                                 "config": dict(args.engine_config)})
                eng.close()
        torch.cuda.synchronize()
    out = {"env": env, "gemm_shape": shape, "gemm_base_ms": base, "rows": rows}
    from kvtier.report import table
    print(f"GEMM: {shape}; engine settings: {args.engine_config or 'defaults'}")
    print(table(["case", "engine", "running beside the GEMM", "launch (grid x threads, smem)",
                 "GEMM ms", "slowdown"],
                [[r["case"], r["engine"], r["load"],
                  " + ".join(f"{g}x{t}, {s // 1024} KiB" for g, t, s in r.get("footprint", []))
                  or "-", f"{r['gemm_ms']:.3f}", f"{100 * r['slowdown']:+.1f}%"] for r in rows]))
    return out


# ----------------------------------------------------------------------------------------------
# pcie: NVML link byte counters against payload
# ----------------------------------------------------------------------------------------------
class Nvml:
    TX, RX = 0, 1          # nvmlPcieUtilCounter_t: bytes the GPU sent / received

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self.h = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.h)) != 0:
            raise OSError("nvmlDeviceGetHandleByIndex failed")

    def throughput(self, counter: int) -> float:
        """GB/s over the counter's 20 ms window."""
        v = ctypes.c_uint()
        rc = self.lib.nvmlDeviceGetPcieThroughput(self.h, counter, ctypes.byref(v))
        if rc != 0:
            raise OSError(f"nvmlDeviceGetPcieThroughput: error {rc}")
        return v.value * 1e3 / 1e9           # KB/s -> GB/s


def _sampled(torch, nvml: Nvml, fn, seconds: float) -> dict[str, float]:
    """Run ``fn`` back to back for ``seconds``; payload rate from events, link rates from
    NVML samples taken in the middle 80% of the window."""
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            samples.append((t, nvml.throughput(Nvml.TX), nvml.throughput(Nvml.RX)))
    fn()
    torch.cuda.synchronize()
    th = threading.Thread(target=sampler, daemon=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    th.start()
    start.record()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.current_stream().synchronize()
    end.record()
    end.synchronize()
    t1 = time.perf_counter()
    stop.set()
    th.join()
    lo, hi = t0 + 0.1 * (t1 - t0), t1 - 0.1 * (t1 - t0)
    mid = [s for s in samples if lo <= s[0] <= hi] or samples
    return {"calls": calls, "ms": start.elapsed_time(end),
            "tx": statistics.median(s[1] for s in mid),
            "rx": statistics.median(s[2] for s in mid), "samples": len(mid)}


def _memcpy_rows(torch, nvml: Nvml, host, seconds: float) -> list[dict[str, Any]]:
    block = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    rows = []
    for direction, fn in (("h2d", lambda: block.copy_(host, non_blocking=True)),
                          ("d2h", lambda: host.copy_(block, non_blocking=True))):
        r = _sampled(torch, nvml, fn, seconds)
        rows.append({"what": "pinned memcpy (ceiling)", "case": "-", "direction": direction,
                     "payload": r["calls"] * host.numel() / r["ms"] / 1e6, **r})
    return rows


def pcie_config(bus_id: str) -> dict[str, Any]:
    """Max payload and max read request sizes of a PCI device, from its configuration space
    (PCI Express capability: Device Capabilities bits 2:0, Device Control bits 7:5 and 14:12)."""
    m = re.match(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.(\d)$",
                 bus_id.strip())
    if not m:
        return {"error": f"cannot parse bus id {bus_id!r}"}
    dom = int(m.group(1) or "0", 16)
    path = (f"/sys/bus/pci/devices/{dom:04x}:{m.group(2).lower()}:{m.group(3).lower()}"
            f".{m.group(4)}")
    try:
        with open(os.path.join(path, "config"), "rb") as f:
            cfg = f.read(256)
    except OSError as exc:
        return {"error": str(exc)}
    return {"path": path, **parse_pcie_config(cfg)}


def parse_pcie_config(cfg: bytes) -> dict[str, Any]:
    """The PCI Express capability's sizes from the first 256 bytes of configuration space."""
    if len(cfg) < 64 or not cfg[6] & 0x10:           # status: capabilities list
        return {"error": "no capability list readable"}
    ptr, seen = cfg[0x34] & 0xFC, set()
    while ptr and ptr not in seen and ptr + 12 <= len(cfg):
        seen.add(ptr)
        if cfg[ptr] == 0x10:                         # PCI Express capability
            devcap = int.from_bytes(cfg[ptr + 4:ptr + 8], "little")
            devctl = int.from_bytes(cfg[ptr + 8:ptr + 10], "little")
            return {"max_payload_supported": 128 << (devcap & 7),
                    "max_payload": 128 << ((devctl >> 5) & 7),
                    "max_read_request": 128 << ((devctl >> 12) & 7)}
        ptr = cfg[ptr + 1] & 0xFC
    return {"error": "no PCI Express capability found"}


def _gpu_bus_id() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return ""


def probe_pcie(args) -> dict[str, Any]:
    CASES, indices, make_pools = _transfer_bench("CASES", "indices", "make_pools")
    torch, nbytes, host_buf, env = _setup(args.mib)
    env["pcie_config"] = pcie_config(_gpu_bus_id())
    print(f"GPU PCIe configuration: {env['pcie_config']}")
    nvml = Nvml()
    rows: list[dict[str, Any]] = []
    with torch.cuda.stream(torch.cuda.Stream()):
        rows += _memcpy_rows(torch, nvml, host_buf.tensor[:nbytes], args.seconds)
        pools: dict[str, Any] = {}
        for case in args.cases.split(","):
            make_pools(torch, pools, case, nbytes, host_buf, args.order)
            moved = pools["n"] * CASES[case].page_bytes
            for name in args.engines.split(","):
                eng = _engine(name, pools, {"layerwise_load": name == "nvidia-copy-engine",
                                            "layerwise_backup": name == "nvidia-copy-engine"})
                hi, di = indices(pools, name, "load")
                for direction, fn in (("h2d", lambda eng=eng, h=hi, d=di: eng.load(h, d)),
                                      ("d2h", lambda eng=eng, h=hi, d=di: eng.backup(d, h))):
                    r = _sampled(torch, nvml, fn, args.seconds)
                    rows.append({"what": name, "case": case, "direction": direction,
                                 "payload": r["calls"] * moved / r["ms"] / 1e6, **r})
                eng.close()
    for row in rows:    # data flows in (RX) for loads, out (TX) for backups
        data, other = ((row["rx"], row["tx"]) if row["direction"] == "h2d"
                       else (row["tx"], row["rx"]))
        row["link_per_payload"] = data / row["payload"] if row["payload"] else None
        row["reverse_per_payload"] = other / row["payload"] if row["payload"] else None
    from kvtier.report import table
    print(table(["engine", "case", "dir", "payload GB/s", "NVML data-direction GB/s",
                 "NVML reverse GB/s", "link / payload", "reverse / payload"],
                [[r["what"], r["case"], r["direction"], f"{r['payload']:.1f}",
                  f"{r['rx'] if r['direction'] == 'h2d' else r['tx']:.1f}",
                  f"{r['tx'] if r['direction'] == 'h2d' else r['rx']:.1f}",
                  f"{r['link_per_payload']:.3f}", f"{r['reverse_per_payload']:.3f}"]
                 for r in rows]))
    return {"env": env, "order": args.order, "rows": rows}


# ----------------------------------------------------------------------------------------------
# latency: one PCIe read's round trip, idle and under other traffic
# ----------------------------------------------------------------------------------------------
CHAIN_STRIDE = 4096          # bytes between chain elements: every read its own page and line


def make_chain(words, slots: int, seed: int = 1):
    """Write into ``words`` (an int64 tensor of >= slots * CHAIN_STRIDE / 8 elements) one cycle
    through ``slots`` elements CHAIN_STRIDE bytes apart, in random order, starting at 0: the
    element at word ``w`` holds the word index of the next."""
    import torch
    step = CHAIN_STRIDE // 8
    if slots < 2 or words.numel() < slots * step:
        raise ValueError(f"need >= 2 slots and {slots * step} words, have {words.numel()}")
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.zeros(1, dtype=torch.int64),
                       torch.randperm(slots - 1, generator=g) + 1])
    nxt = torch.roll(order, -1)
    words[order * step] = nxt * step
    return order


def probe_latency(args) -> dict[str, Any]:
    CASES, indices, make_pools = _transfer_bench("CASES", "indices", "make_pools")
    from kvtier.report import progress
    from . import _driver
    torch, nbytes, host_buf, env = _setup(args.mib)
    dev = _driver.device(0)
    k = _driver.load_kernel(dev, "hold.cu", "kvt_read_latency")
    tail = host_buf.tensor[4 * nbytes:]                 # the 64 MiB the pools never use
    words = tail[:(tail.numel() // 8) * 8].view(torch.int64)
    slots = min(16384, words.numel() * 8 // CHAIN_STRIDE)
    make_chain(words, slots)
    chain = _driver.host_device_pointer(words.data_ptr())
    if chain is None:
        raise SystemExit("kvtier bench limits latency: the host buffer is not registered with "
                         "CUDA (no device address for it)")
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    n = args.reads
    rows: list[dict[str, Any]] = []
    with torch.cuda.stream(torch.cuda.Stream()):
        lat_stream, bg1, bg2 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host_a, host_b = host_buf.tensor[:nbytes], host_buf.tensor[nbytes:2 * nbytes]
        pools: dict[str, Any] = {}
        make_pools(torch, pools, args.cases.split(",")[0], nbytes, host_buf, "random")
        spec = CASES[pools["case"]]
        eng = _engine("nvidia-tma", pools)
        hl, dl = indices(pools, type(eng), "load")
        hb, db = indices(pools, type(eng), "backup")
        moved = pools["n"] * spec.page_bytes
        c = eng.config
        in_flight = c.ctas * c.warps * (c.stages - 1 - c.stores_in_flight) * c.stage_bytes

        def measure() -> list[float]:
            per = []
            for _ in range(args.repeat):
                with torch.cuda.stream(lat_stream):
                    _driver.launch(k, 1, 32, 0, lat_stream.cuda_stream, ctypes.c_uint64(chain),
                                   ctypes.c_uint32(n), ctypes.c_uint64(out.data_ptr()))
                lat_stream.synchronize()
                per.append(int(out[0].item()) / n)
            return per

        reps = max(2, int(1.5 * 55e9 / nbytes))          # ~1.5 s of background traffic
        backgrounds = {
            "idle": [],
            "memcpy D2H": [(bg1, lambda: host_b.copy_(block, non_blocking=True))],
            "memcpy H2D": [(bg1, lambda: block.copy_(host_a, non_blocking=True))],
            "memcpy both": [(bg1, lambda: block.copy_(host_a, non_blocking=True)),
                            (bg2, lambda: host_b.copy_(block, non_blocking=True))],
            "nvidia-tma backups": [(bg2, lambda: eng.backup(db, hb))],
            "nvidia-tma loads": [(bg1, lambda: eng.load(hl, dl))],
            "nvidia-tma both": [(bg1, lambda: eng.load(hl, dl)), (bg2, lambda: eng.backup(db, hb))],
        }
        measure()                                         # warm-up: module load, TLBs
        for label, work in progress(backgrounds.items(), desc="read latency"):
            for stream, fn in work:
                with torch.cuda.stream(stream):
                    for _ in range(reps):
                        fn()
            per = measure()
            torch.cuda.synchronize()
            ns = statistics.median(per)
            rows.append({"background": label, "ns_per_read": ns, "min": min(per),
                         "max": max(per), "reads": n,
                         "rate_in_flight_gbps": in_flight / ns})
        eng.close()
    from kvtier.report import table
    print(f"one thread, {n} dependent 8-byte reads of registered host memory "
          f"{CHAIN_STRIDE} B apart; nvidia-tma keeps {in_flight // 1024} KiB of loads in flight "
          f"({c.ctas} CTAs x {c.warps} pipelines x {c.stages - 1 - c.stores_in_flight} stages "
          f"x {c.stage_bytes} B); background engines on {pools['case']} ({moved >> 20} MiB)")
    print(table(["traffic on the link", "ns per read (median)", "min", "max",
                 "GB/s that many loads in flight allow"],
                [[r["background"], f"{r['ns_per_read']:.0f}", f"{r['min']:.0f}",
                  f"{r['max']:.0f}", f"{r['rate_in_flight_gbps']:.1f}"] for r in rows]))
    return {"env": env, "in_flight_bytes": in_flight, "case": pools["case"], "rows": rows}


# ----------------------------------------------------------------------------------------------
# ncu: the kernels' system-memory requests
# ----------------------------------------------------------------------------------------------
def _find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for dirpath, _, files in os.walk(root):
            if "ncu" in files:
                return os.path.join(dirpath, "ncu")
    return None


def _metric_names(ncu: str) -> list[str]:
    """Counters this chip offers about PCIe and system-memory traffic at L2."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True,
                         timeout=300).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        name = parts[0]
        if re.match(r"^pcie__", name) or re.match(
                r"^lts__t_(requests|sectors)_(srcunit_\w+_)?aperture_sysmem(_op_(read|write))?$",
                name):
            names.append(name + ".sum")
    return names


def workload(args) -> None:
    """A few transfer launches for the profiler: TMA and register, loads and backups."""
    indices, make_pools = _transfer_bench("indices", "make_pools")
    torch, nbytes, host_buf, _ = _setup(args.mib)
    pools: dict[str, Any] = {}
    with torch.cuda.stream(torch.cuda.Stream()):
        for case in args.cases.split(","):
            make_pools(torch, pools, case, nbytes, host_buf, "random")
            for name in args.engines.split(","):
                eng = _engine(name, pools, {"layerwise_load": False})
                h, d = indices(pools, name, "load")
                eng.load(h, d).wait()
                eng.backup(d, h).wait()
                eng.close()
        torch.cuda.synchronize()


def probe_ncu(args) -> dict[str, Any]:
    ncu = _find_ncu()
    if ncu is None:
        print("ncu (Nsight Compute) is not installed here; nothing to measure")
        return {"ncu": None}
    names = _metric_names(ncu)
    names += ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"]
    with tempfile.TemporaryDirectory() as d:
        rep = os.path.join(d, "out.csv")
        cmd = [ncu, "--clock-control", "none", "-k", "regex:kvt_", "--csv", "--log-file", rep,
               "--metrics", ",".join(names), sys.executable, "-m", "kvtier_nvidia_tma.limits",
               "workload", "--mib", str(args.mib), "--cases", args.cases,
               "--engines", args.engines]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        text = open(rep).read() if os.path.exists(rep) else ""
    rows = [r for r in _parse_ncu_csv(text)]
    if not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
    by_launch: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = r["ID"]
        e = by_launch.setdefault(key, {"kernel": r["Kernel Name"][:40], "metrics": {}})
        try:
            e["metrics"][r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            e["metrics"][r["Metric Name"]] = r["Metric Value"]
    from kvtier.report import table
    print(table(NCU_COLUMNS, ncu_rows(by_launch)))
    return {"ncu": ncu, "metrics": names, "launches": by_launch, "returncode": proc.returncode}


NCU_COLUMNS = ["launch", "kernel", "dir", "payload MB", "SM sysmem requests", "bytes/request",
               "PCIe bytes (data dir)", "header B/request", "PCIe bytes (reverse)",
               "reverse B/request", "payload GB/s"]


def ncu_rows(by_launch: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Per launch: the SMs' system-memory requests at L2 (source unit tex: each counted once)
    and the PCIe bytes the GPU counted in the data's direction and the reverse one, per
    request: TLP header bytes per payload TLP, and read-request bytes for loads."""
    rows = []
    for key, e in by_launch.items():
        m = e["metrics"]
        for op, data_dir, rev_dir in (("read", "pcie__read_bytes.sum", "pcie__write_bytes.sum"),
                                      ("write", "pcie__write_bytes.sum", "pcie__read_bytes.sum")):
            req = m.get(f"lts__t_requests_srcunit_tex_aperture_sysmem_op_{op}.sum")
            sec = m.get(f"lts__t_sectors_srcunit_tex_aperture_sysmem_op_{op}.sum")
            if not (isinstance(req, float) and isinstance(sec, float) and req > 1000):
                continue
            payload = 32 * sec
            data, rev = m.get(data_dir), m.get(rev_dir)
            ns = m.get("gpu__time_duration.sum")
            ok = isinstance(data, float) and isinstance(rev, float)
            rows.append([key, e["kernel"], "h2d" if op == "read" else "d2h",
                         f"{payload / 1e6:.2f}", f"{req:.0f}", f"{payload / req:.1f}",
                         f"{data:.0f}" if ok else "-",
                         f"{(data - payload) / req:.1f}" if ok else "-",
                         f"{rev:.0f}" if ok else "-", f"{rev / req:.1f}" if ok else "-",
                         f"{payload / ns:.1f}" if isinstance(ns, float) and ns else "-"])
    return rows


def _parse_ncu_csv(text: str) -> list[dict[str, str]]:
    import csv
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    return list(csv.DictReader(lines))


# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# queue: the copy engine's two directions, queued one after the other, side by side, or before
# they start
# ----------------------------------------------------------------------------------------------
def _gate(torch, stream, ms: float):
    """A spin kernel of ``ms`` on ``stream``; its end event (others wait on it)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1.9e6))
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
    return ev


def probe_queue(args) -> dict[str, Any]:
    """Per chunk size: host microseconds to queue one copy (``cuMemcpyBatchAsync``), and
    GB/s of 256 MiB each way and both ways at once -- queued one direction after the other
    from one thread (an engine's load, then its backup), from a thread per direction (the
    copy engine's ``issue_thread``), and both queued before either starts (what the DMA
    engines do once the host is out of the way)."""
    import numpy as np
    import torch
    (CASES,) = _transfer_bench("CASES")
    from . import _driver
    if not torch.cuda.is_available():
        raise SystemExit("kvtier_nvidia_tma.limits: no CUDA device here")
    total = args.mib << 20
    ha = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    hb = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    da = torch.empty(total, dtype=torch.uint8, device="cuda")
    db = torch.empty(total, dtype=torch.uint8, device="cuda")
    sa, sb, sg = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    copiers = {id(sa): _driver.BatchCopier(), id(sb): _driver.BatchCopier()}
    T_max = max(args.issue_threads, default=1)
    split_streams = [torch.cuda.Stream() for _ in range(T_max)]
    split_copiers = [_driver.BatchCopier() for _ in range(T_max)]
    rng = np.random.default_rng(1)

    def timed(fn, gate_ms: float = 0.0) -> float:
        """Seconds from the start (the gate's end, or the call) to both streams done."""
        vals = []
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            g = _gate(torch, sg, gate_ms) if gate_ms else None
            if g is not None:
                sa.wait_event(g)
                sb.wait_event(g)
            t0 = time.perf_counter()
            fn()
            if g is None:
                torch.cuda.synchronize()
                vals.append(time.perf_counter() - t0)
                continue
            ends = []
            for s in (sa, sb):
                e = torch.cuda.Event(enable_timing=True)
                e.record(s)
                ends.append(e)
            torch.cuda.synchronize()
            vals.append(max(g.elapsed_time(e) for e in ends) / 1e3)
        return statistics.median(vals)

    ceil = {"h2d": total / timed(lambda: da.copy_(ha, non_blocking=True)) / 1e9,
            "d2h": total / timed(lambda: hb.copy_(db, non_blocking=True)) / 1e9}

    def memcpy_both() -> None:
        with torch.cuda.stream(sa):
            da.copy_(ha, non_blocking=True)
        with torch.cuda.stream(sb):
            hb.copy_(db, non_blocking=True)
    ceil["both"] = 2 * total / timed(memcpy_both, gate_ms=5) / 1e9
    def measure(chunk: int) -> dict[str, Any]:
        n = total // chunk
        off = [rng.permutation(n).astype(np.uint64) * np.uint64(chunk) for _ in range(4)]
        sizes = np.full(n, chunk, dtype=np.uint64)
        load = (np.uint64(da.data_ptr()) + off[0], np.uint64(ha.data_ptr()) + off[1], sa)
        back = (np.uint64(hb.data_ptr()) + off[2], np.uint64(db.data_ptr()) + off[3], sb)

        def queue(job) -> None:
            dst, src, s = job
            copiers[id(s)](dst, src, sizes, s.cuda_stream, args.max_batch)

        def in_turn() -> None:                   # one thread: the load, then the backup
            queue(load)
            queue(back)

        def together(fns) -> None:               # each on a thread of its own, at once
            bar = threading.Barrier(len(fns))

            def run(fn) -> None:
                torch.cuda.set_device(0)
                bar.wait()
                fn()
            ts = [threading.Thread(target=run, args=(fn,)) for fn in fns]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        def threads() -> None:
            together([lambda: queue(load), lambda: queue(back)])

        def split(job, T: int) -> None:          # one direction, a slice per thread
            dst, src, _ = job

            def part(t: int) -> None:
                lo, hi = n * t // T, n * (t + 1) // T
                split_copiers[t](dst[lo:hi], src[lo:hi], sizes[lo:hi],
                                 split_streams[t].cuda_stream, args.max_batch)
            together([lambda t=t: part(t) for t in range(T)])
        t_q = []
        for _ in range(args.repeat):                 # queuing alone: behind a long gate
            torch.cuda.synchronize()
            sa.wait_event(_gate(torch, sg, 50 + n * 2e-3))
            t0 = time.perf_counter()
            queue(load)
            t_q.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        gbps = {"h2d": total / timed(lambda: queue(load)) / 1e9,
                "d2h": total / timed(lambda: queue(back)) / 1e9,
                "both, one after the other": 2 * total / timed(in_turn) / 1e9,
                "both, a thread each": 2 * total / timed(threads) / 1e9,
                "both, queued before they start": 2 * total / timed(
                    in_turn, gate_ms=50 + n * 4e-3) / 1e9}
        calls: dict[int, float] = {}
        for T in args.issue_threads:
            call: list[float] = []

            def job(T=T, call=call) -> None:
                t0 = time.perf_counter()
                split(load, T)
                call.append(time.perf_counter() - t0)
                for s in split_streams[:T]:             # timed() waits for sa and sb
                    ev = torch.cuda.Event()
                    ev.record(s)
                    sa.wait_event(ev)
            gbps[f"h2d, {T} threads"] = total / timed(job) / 1e9
            calls[T] = 1e3 * statistics.median(call)
        row = {"chunk_bytes": chunk, "copies": n,
               "issue_threads_call_ms": {str(T): v for T, v in calls.items()},
               "queue_us_per_copy": 1e6 * statistics.median(t_q) / n,
               **{k: {"gbps": v, "of_ceiling": v / ceil[k.split(",")[0] if k.split(",")[0]
                                                          in ceil else "both"]}
                  for k, v in gbps.items()}}
        return row

    rows = []
    for chunk in sorted({CASES[c].chunk_bytes for c in args.cases.split(",")}):
        row = measure(chunk)
        rows.append(row)
        print(f"{chunk // 1024} KiB chunks done", file=sys.stderr, flush=True)
    names = ["h2d", "d2h", "both, one after the other", "both, a thread each",
             "both, queued before they start"] + [f"h2d, {T} threads" for T in args.issue_threads]
    print(f"ceiling (pinned memcpy, {args.mib} MiB): h2d {ceil['h2d']:.1f} GB/s, d2h "
          f"{ceil['d2h']:.1f}, both {ceil['both']:.1f}; batches of {args.max_batch} copies")
    print("| chunk | queue us/copy | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['chunk_bytes'] // 1024} KiB | {r['queue_us_per_copy']:.2f} | " + " | ".join(
            f"{r[k]['gbps']:.1f} ({100 * r[k]['of_ceiling']:.1f}%)" for k in names) + " |")
    if args.issue_threads:
        print("\nhost ms to queue the load from T threads: " + "; ".join(
            f"{r['chunk_bytes'] // 1024} KiB " + ", ".join(
                f"{T}: {ms:.2f}" for T, ms in r["issue_threads_call_ms"].items())
            for r in rows))
    return {"ceiling": ceil, "rows": rows, "max_batch": args.max_batch, "mib": args.mib,
            "issue_threads": args.issue_threads}


def probe_routes(args) -> dict[str, Any]:
    """``nvidia-routed`` calibrated ``args.repeat`` times over each case's pools (no cache):
    its tables, crossovers and routes, and a table of CE/SM ratios per chunk size."""
    import torch
    from kvtier import DeviceKVPool, HostKVPool
    (CASES,) = _transfer_bench("CASES")
    from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
    from .transfer_engine import RoutedTransferEngine
    if not torch.cuda.is_available():
        raise SystemExit("kvtier_nvidia_tma.limits: no CUDA device here")
    from kvtier.config import keys_for
    cfg = keys_for(RoutedTransferEngine.Config,
                   {**args.engine_config, "cache_file": "none", "calibrate_mib": args.mib})
    runs: list[dict[str, Any]] = []
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        spec = CASES[case]
        dpool = DeviceKVPool.empty(spec, 4, "cuda")
        hpool = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
        try:
            for r in range(args.repeat):
                t0 = time.perf_counter()
                eng = RoutedTransferEngine(dpool, hpool, cfg)
                c = eng.config
                runs.append({"case": case, "run": r, "chunk_bytes": spec.chunk_bytes,
                             "layers": spec.num_layers, "route": dict(eng.route),
                             "crossover": dict(eng.crossover),
                             "calibration": eng.calibration,
                             "prefer_copy_within": c.prefer_copy_within,
                             "idle_shortfall": c.idle_shortfall,
                             "seconds": time.perf_counter() - t0})
                eng.close()
                print(f"routes: {case} run {r + 1}/{args.repeat}: loads -> {eng.route['h2d']}, "
                      f"backups -> {eng.route['d2h']} ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
        finally:
            hpool.close()
    print(routes_table(runs))
    return {"runs": runs, "config": cfg}


def routes_table(runs: list[dict[str, Any]]) -> str:
    """The routes probe's table: per case, run and direction, each calibrated chunk size's
    CE/SM ratio from an idle GPU and behind GPU work and the copy engine's call share, marked
    where the copy engine takes the size (from the crossover the rule picks); and the route
    the case's chunks got."""
    from ._plan import PathRates, choose_crossover
    from .transfer_engine import CALIBRATION_CHUNKS
    lines = ["CE/SM from an idle GPU / behind GPU work / the copy engine's call time over its "
             "device time; * where the copy engine takes the size",
             "| case | run | dir | " + " | ".join(f"{k // 1024 or k} {'KiB' if k >= 1024 else 'B'}"
                                                for k in CALIBRATION_CHUNKS) + " | route |",
             "|---|---|---|" + "---|" * (len(CALIBRATION_CHUNKS) + 1)]
    for run in runs:
        for d in ("h2d", "d2h"):
            table = run["calibration"][d]["table"]
            cross = choose_crossover({int(k): v for k, v in table.items()},
                                     run["prefer_copy_within"], run["idle_shortfall"])
            cells = []
            for k in CALIBRATION_CHUNKS:
                if str(k) not in table:
                    cells.append("-")
                    continue
                v = PathRates.of(table[str(k)])
                take = cross is not None and k >= cross
                cells.append(f"{v.copy / v.sm:.2f} / {v.copy_device / v.sm_device:.2f} / "
                             f"{v.copy_call_share:.2f}{' *' if take else ''}")
            lines.append(f"| {run['case']} | {run['run'] + 1} | {d} | " + " | ".join(cells)
                         + f" | {run['route'][d]} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The probes as sub-commands of ``p`` (``kvtier bench limits`` or ``python -m``)."""
    sub = p.add_subparsers(dest="probe", metavar="PROBE", required=True)
    for name, cases, engines, help_ in (
            ("gemm", "mla-p1,mha-32k", "nvidia-tma,nvidia-register",
             "GEMM slowdown from transfers vs from SMs merely held"),
            ("pcie", "mla-p1,mha-8k,mla-p64", "nvidia-tma,nvidia-register,nvidia-copy-engine",
             "NVML PCIe link bytes per payload byte"),
            ("ncu", "mla-p1,mla-p64", "nvidia-tma,nvidia-register",
             "Nsight Compute system-memory and PCIe counters of a few launches"),
            ("latency", "mla-p64", "nvidia-tma", "PCIe read round trip, idle and under load"),
            ("workload", "mla-p1,mla-p64", "nvidia-tma,nvidia-register",
             "the transfers the ncu probe profiles (run under Nsight Compute)"),
            ("queue", "mha-32k,mla-p64,mha-128k", "nvidia-copy-engine",
             "copy-engine copies: host cost of queuing, both directions queued in turn, "
             "side by side, or before they start"),
            ("routes", "mla-p64,mha-32k,mha-128k", "nvidia-routed",
             "nvidia-routed's calibration measured again per case: CE/SM rates idle and "
             "behind GPU work, call time, routes")):
        s = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        s.add_argument("--mib", type=int, default=128 if name == "routes" else 256,
                       help="MiB per transfer")
        s.add_argument("--cases", default=cases, help="transfer cases (kvtier bench transfer's)")
        s.add_argument("--engines", default=engines, help="engines to measure")
        s.add_argument("--json", help="write the results here")
        if name == "gemm":
            s.add_argument("--ops", default="loads,backups,both",
                           help="transfers beside the GEMM: loads, backups, both")
            s.add_argument("--hold-ctas", default="1,2,4,8",
                           help="SMs held by kvt_hold (no traffic), one run each ('' for none)")
        if name in ("gemm", "routes"):
            s.add_argument("--config", dest="engine_config", default="", metavar="K=V,K=V",
                           help="engine settings (each engine takes the keys it has)")
        if name == "routes":
            s.add_argument("--repeat", type=int, default=3, help="calibrations per case")
        if name == "latency":
            s.add_argument("--reads", type=int, default=2048, help="dependent reads per launch")
            s.add_argument("--repeat", type=int, default=9, help="launches per background")
        if name == "queue":
            s.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
            s.add_argument("--max-batch", type=int, default=256, help="copies per batch call")
            s.add_argument("--issue-threads", default="1,2,4", metavar="T,T",
                           help="also time a load queued from T threads at once, a slice of "
                                "its copies and a stream each ('' for none)")
        if name == "pcie":
            s.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
            s.add_argument("--order", choices=["random", "sequential"], default="random")


def check_arguments(args: argparse.Namespace) -> None:
    """Reject bad values before any GPU work (InvalidArgumentError naming the flag)."""
    CASES, parse_value = _transfer_bench("CASES", "parse_value")
    from kvtier.errors import InvalidArgumentError
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad:
        raise InvalidArgumentError(f"unknown case(s) {', '.join(bad)}; have {', '.join(CASES)}",
                                   argument="cases")
    if args.probe == "gemm":
        bad = [o for o in args.ops.split(",") if o not in ("loads", "backups", "both")]
        if bad:
            raise InvalidArgumentError(f"--ops: {', '.join(bad)}: expected loads, backups or "
                                       "both", argument="ops")
    if args.probe == "queue" and isinstance(args.issue_threads, str):
        try:
            args.issue_threads = [int(x) for x in args.issue_threads.split(",") if x.strip()]
        except ValueError:
            args.issue_threads = [0]
        if any(t < 1 or t > 64 for t in args.issue_threads):
            raise InvalidArgumentError(f"--issue-threads: expected thread counts in 1-64, "
                                       f"got {args.issue_threads!r}", argument="issue-threads")
    if args.probe == "routes" and args.repeat < 1:
        raise InvalidArgumentError(f"--repeat must be at least 1, got {args.repeat}",
                                   argument="repeat")
    if args.probe in ("gemm", "routes"):
        if isinstance(args.engine_config, str):
            pairs = [x.partition("=") for x in args.engine_config.split(",") if x]
            if any(not k or not sep for k, sep, _ in pairs):
                raise InvalidArgumentError(f"--config {args.engine_config!r}: expected "
                                           "KEY=VALUE[,KEY=VALUE]", argument="config")
            args.engine_config = {k: parse_value(v) for k, _, v in pairs}


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.probe == "workload":
        workload(args)
        return 0
    out = {"gemm": probe_gemm, "pcie": probe_pcie, "ncu": probe_ncu,
           "latency": probe_latency, "queue": probe_queue,
           "routes": probe_routes}[args.probe](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier_nvidia_tma.limits``: the same as ``kvtier bench limits``."""
    from kvtier.errors import KVTierError
    p = argparse.ArgumentParser(prog="python -m kvtier_nvidia_tma.limits",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        check_arguments(args)
    except KVTierError as exc:
        p.error(str(exc))
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
