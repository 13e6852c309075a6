"""Where the `torch` engine's staged path spends its time: per transfer, the worker's CPU
gathers (loads) or scatters (backups), its waits for a staging slot, and the whole transfer.
Where CPU time plus the link's time add up to the whole, the two do not overlap.

    python packages/core/bench/torch_staged_timeline.py [--mib 256] [--json OUT.json]

Needs CUDA (the staged path's other half is a device copy), kvtier-tools (the transfer
benchmark's cases) and kvtier-nvidia-tma for the `cuda-host-register` host pool (else
`torch-pinned`).
"""

from __future__ import annotations

import json
import time
from functools import partial

import torch
from _staged import host_copies, median_s, parse, pinned_allocator

from kvtier_tools.bench.transfer import CASES
from kvtier.device_pool import DeviceKVPool
from kvtier.host_pool import HostKVPool
from kvtier.testing.data import fill_random
from kvtier.transfer_engines.torch_engine import TorchTransferEngine


def timeline(eng: TorchTransferEngine, direction: str, h, d, repeat: int) -> dict:
    log: list[tuple[str, float]] = []
    real_rows, real_slot = eng._host_rows, eng._slot

    def rows(*a, **k):
        t = time.perf_counter()
        real_rows(*a, **k)
        log.append(("cpu", time.perf_counter() - t))

    def slot():
        t = time.perf_counter()
        s = real_slot()
        log.append(("slot", time.perf_counter() - t))
        return s
    eng._host_rows, eng._slot = rows, slot      # type: ignore[method-assign]
    runs = []
    for i in range(repeat + 1):
        log.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (eng.load(h, d) if direction == "h2d" else eng.backup(d, h)).wait()
        torch.cuda.synchronize()
        if i:
            runs.append({"s": time.perf_counter() - t0,
                         "cpu_s": sum(v for k, v in log if k == "cpu"),
                         "slot_wait_s": sum(v for k, v in log if k == "slot"),
                         "cpu_ops": sum(1 for k, _ in log if k == "cpu")})
    eng._host_rows, eng._slot = real_rows, real_slot   # type: ignore[method-assign]
    mid = sorted(runs, key=lambda r: r["s"])[len(runs) // 2]
    # the same CPU copies with nothing else running: the transfer's groups, one slot
    mid["cpu_alone_s"] = median_s(partial(host_copies, eng, h.numpy(), direction == "h2d"),
                                  repeat)
    return mid


def main() -> None:
    args = parse(__doc__, repeat=3)
    alloc = pinned_allocator()
    nbytes = args.mib << 20
    link = {}
    probe_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    probe_d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for direction, (dst, src) in (("h2d", (probe_d, probe_h)), ("d2h", (probe_h, probe_d))):
        def copy(dst=dst, src=src) -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        link[direction] = median_s(copy, args.repeat)
    del probe_h, probe_d
    out = []
    print("| case | dir | transfer ms | GB/s | CPU copies ms | the same copies alone ms "
          "| slot waits ms | the link alone ms | CPU + link ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        spec = CASES[case]
        n = nbytes // spec.page_bytes
        dpool = DeviceKVPool.empty(spec, n + 8, "cuda")
        hpool = HostKVPool(spec, 2 * n, allocator=alloc)
        fill_random(hpool.raw)
        g = torch.Generator().manual_seed(1)
        h = torch.randperm(2 * n, generator=g)[:n]
        d = torch.randperm(n + 8, generator=g)[:n].cuda()
        eng = TorchTransferEngine(dpool, hpool, {"zero_copy": False})
        try:
            for direction in ("h2d", "d2h"):
                r = timeline(eng, direction, h, d, args.repeat)
                moved = n * spec.page_bytes
                alone = link[direction] * moved / nbytes
                out.append({"case": case, "direction": direction, "bytes": moved,
                            "link_alone_s": alone, **r})
                print(f"| {case} | {direction} | {1e3 * r['s']:.2f} | {moved / r['s'] / 1e9:.1f} "
                      f"| {1e3 * r['cpu_s']:.2f} | {1e3 * r['cpu_alone_s']:.2f} "
                      f"| {1e3 * r['slot_wait_s']:.2f} "
                      f"| {1e3 * alone:.2f} | {1e3 * (r['cpu_s'] + alone):.2f} |", flush=True)
        finally:
            eng.close()
            hpool.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "mib": args.mib, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
