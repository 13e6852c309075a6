"""Host time to queue a per-layer copy-engine transfer: a batch call per layer given NumPy
slices (``BatchCopier.__call__``, as `nvidia-copy-engine` queued per-layer transfers before;
both ways now share the driver call itself, so only the slicing differs) against
``BatchCopier.queue_layers`` (one pass, addresses by offset), with an event recorded after
each layer either way. The two alternate in one process, so both see the same host;
the ratio is the median of the paired runs. Needs CUDA and kvtier-tools (the transfer
benchmark's cases).

    python packages/nvidia-tma/bench/queue_layers.py [--cases mla-p16,mha-32k,mla-p64,mha-128k]
        [--mib 256] [--repeat 20] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="mla-p16,mha-32k,mla-p64,mha-128k")
    p.add_argument("--mib", type=int, default=256, help="MiB per transfer")
    p.add_argument("--repeat", type=int, default=20, help="timed pairs (after 4 warm-up pairs)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    import torch
    from kvtier import registry
    from kvtier_tools.bench.transfer import CASES
    from kvtier.testing.data import fill_random
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad or args.mib < 1 or args.repeat < 1:
        p.error(f"unknown case(s) {', '.join(bad)}" if bad else "--mib and --repeat must be >= 1")
    if not torch.cuda.is_available():
        p.error("no CUDA device here")
    nbytes = args.mib << 20
    buf = registry.create_host_allocator("cuda-host-register").allocate(4 * nbytes + (64 << 20))
    fill_random(buf.tensor[:4 * nbytes])
    rows = []
    print("| case | layers | copies | slices ms | queue_layers ms | ratio (paired median) |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        row = measure(torch, case, nbytes, buf, args.repeat)
        rows.append(row)
        print(f"| {case} | {row['layers']} | {row['copies']} | {row['slices_ms']:.2f} | "
              f"{row['queue_layers_ms']:.2f} | {row['ratio']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "packages/nvidia-tma/bench/queue_layers.py",
                                            *sys.argv[1:]]), "rows": rows}, f, indent=1)
    return 0


def measure(torch, case: str, nbytes: int, buf, repeat: int) -> dict:
    """One case: ``repeat`` timed pairs after 4 warm-up pairs, alternating which goes first."""
    from kvtier import registry
    from kvtier_tools.bench.transfer import indices, make_pools
    from kvtier_nvidia_tma.transfer_engine import layer_copy_lists
    cls = registry.get_backend_class("kvtier.transfer_engines", "nvidia-copy-engine")
    pools: dict = {}
    make_pools(torch, pools, case, nbytes, buf, "random")
    eng = cls(pools["dpool"], pools["hpool"], {})
    h, d = indices(pools, eng, "load")
    stream = torch.cuda.Stream()
    L = eng.spec.num_layers
    src, dst, sizes, bounds = layer_copy_lists(eng._runs, eng._host_dptr, h.numpy(), d.numpy(),
                                               False, L)
    cp, mb = eng._copier, eng.config.max_batch

    def mark(_layer: int = 0) -> None:
        torch.cuda.Event().record(stream)

    def slices() -> None:
        for layer in range(L):
            a, b = int(bounds[layer]), int(bounds[layer + 1])
            cp(dst[a:b], src[a:b], sizes[a:b], stream.cuda_stream, mb, 0)
            mark()

    def one_pass() -> None:
        cp.queue_layers(dst, src, sizes, bounds.tolist(), stream.cuda_stream, mb, 0, mark)
    t: dict[str, list[float]] = {"slices": [], "queue_layers": []}
    for i in range(repeat + 4):
        pair = [("slices", slices), ("queue_layers", one_pass)]
        for name, fn in (pair if i % 2 else pair[::-1]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if i >= 4:
                t[name].append(time.perf_counter() - t0)
            torch.cuda.synchronize()
    eng.close()
    return {"case": case, "layers": L, "copies": len(src),
            "slices_ms": 1e3 * statistics.median(t["slices"]),
            "queue_layers_ms": 1e3 * statistics.median(t["queue_layers"]),
            "ratio": statistics.median(n / o for n, o in zip(t["queue_layers"], t["slices"]))}


if __name__ == "__main__":
    raise SystemExit(main())
