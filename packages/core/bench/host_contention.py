"""Do the host's CPU copies and the DMA engine's host-memory traffic slow each other down?
The `torch` engine's staged path runs both at once (a CPU gather into pinned staging while the
previous batch crosses the link); this times each alone and both together.

    python packages/core/bench/host_contention.py [--json OUT.json]

CPU side: torch gathers (and scatters) of random host rows into a 32 MiB pinned buffer from a
worker thread, as the engine issues them. DMA side: back-to-back 256 MiB copies between pinned
host memory and the device on a stream of their own. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

ROW = 126 << 10          # a staged gather's row (7 MLA layers of 18 KiB)


def cpu_op(src, stage, gather: bool):
    n = stage.shape[0]
    idx = torch.randperm(src.shape[0])[:n]
    if gather:
        return lambda: torch.index_select(src, 0, idx, out=stage)
    return lambda: src.index_copy_(0, idx, stage)


def cpu_rate(fn, nbytes: int, until) -> float:
    """GB/s of ``fn`` called from a worker thread until ``until()`` says stop."""
    out = {}

    def work() -> None:
        fn()
        calls, t0 = 0, time.perf_counter()
        while not until(calls):
            fn()
            calls += 1
        out["gbps"] = calls * nbytes / (time.perf_counter() - t0) / 1e9
    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out["gbps"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=40, help="256 MiB DMA copies per timing")
    p.add_argument("--json")
    args = p.parse_args()
    n = 256 << 20
    host_dma = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(big.data_ptr(), big.numel(), 0)
    big.random_(0, 255)
    src = big[:big.numel() // ROW * ROW].view(torch.int64).view(-1, ROW // 8)
    stage = torch.empty((32 << 20) // ROW, ROW // 8, dtype=torch.int64, pin_memory=True)
    nbytes = stage.numel() * 8
    stream = torch.cuda.Stream()

    def dma(direction: str, copies: int):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            for _ in range(copies):
                if direction == "h2d":
                    dev.copy_(host_dma, non_blocking=True)
                else:
                    host_dma.copy_(dev, non_blocking=True)
            b.record()
        return a, b

    rows = []
    for direction in ("h2d", "d2h"):
        a, b = dma(direction, args.copies)
        b.synchronize()
        dma_alone = args.copies * n / a.elapsed_time(b) / 1e6
        for gather in (True, False):
            fn = cpu_op(src, stage, gather)
            alone = cpu_rate(fn, nbytes, lambda calls: calls >= 60)
            a, b = dma(direction, args.copies)
            together = cpu_rate(fn, nbytes, lambda calls, end=b: end.query())
            b.synchronize()
            dma_with = args.copies * n / a.elapsed_time(b) / 1e6
            rows.append({"dma": direction, "cpu": "gather" if gather else "scatter",
                         "dma_alone": dma_alone, "dma_with_cpu": dma_with,
                         "cpu_alone": alone, "cpu_with_dma": together})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ROW >> 10} KiB rows; "
          "GB/s")
    print("| DMA | CPU op | DMA alone | DMA beside the CPU op | CPU op alone | CPU op beside the "
          "DMA | sum alone | sum together |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dma']} | {r['cpu']} | {r['dma_alone']:.1f} | {r['dma_with_cpu']:.1f} "
              f"| {r['cpu_alone']:.1f} | {r['cpu_with_dma']:.1f} "
              f"| {r['dma_alone'] + r['cpu_alone']:.1f} "
              f"| {r['dma_with_cpu'] + r['cpu_with_dma']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "row_bytes": ROW, "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
