"""The `torch` engine's staged CPU side by gather op, on the engine's own views: every batch of
a 256 MiB transfer gathered (host rows into pinned staging) with each of the ops
``_cpu_gather`` chooses among, and scattered back, for both host layouts.

    python packages/core/bench/torch_staged_ops.py [--mib 256] [--json OUT.json]

``select``: one ``index_select`` per host run; ``parts``: the rows cut into parts under torch's
CPU grain, one ``index_select`` each; ``index``: torch's advanced-index kernel; ``default``:
the engine's own choice. Needs CUDA (the staging buffers are pinned) and kvtier-tools (the
transfer benchmark's cases).
"""

from __future__ import annotations

import json
from functools import partial

import torch
from _staged import host_copies, median_s, parse, pinned_allocator

from kvtier_tools.bench.transfer import CASES
from kvtier.device_pool import DeviceKVPool
from kvtier.host_pool import HostKVPool
from kvtier.testing.data import fill_random
from kvtier.transfer_engines import torch_engine
from kvtier.transfer_engines.torch_engine import TorchTransferEngine

OPS = ("default", "select", "parts", "index")


def main() -> None:
    args = parse(__doc__, repeat=5)
    alloc = pinned_allocator()
    real_op = torch_engine._gather_op
    out = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GB/s")
    print("| case | host layout | " + " | ".join(f"gather {o}" for o in OPS) + " | scatter |")
    print("|---|---|" + "---|" * (len(OPS) + 1))
    for case in args.cases.split(","):
        spec = CASES[case]
        n = (args.mib << 20) // spec.page_bytes
        moved = n * spec.page_bytes
        dpool = DeviceKVPool.empty(spec, n + 8, "cuda")
        for layout in ("page_first", "layer_first"):
            hpool = HostKVPool(spec, 2 * n, allocator=alloc, layout=layout)
            fill_random(hpool.raw)
            h = torch.randperm(2 * n, generator=torch.Generator().manual_seed(1))[:n].numpy()
            eng = TorchTransferEngine(dpool, hpool, {"zero_copy": False})
            row = {"case": case, "host_layout": layout, "bytes": moved}
            try:
                for op in OPS:
                    if op != "default":
                        torch_engine._gather_op = lambda r, rows, op=op: op  # type: ignore
                    eng._plans.clear()
                    row[f"gather_{op}"] = moved / median_s(
                        partial(host_copies, eng, h, True), args.repeat) / 1e9
                    torch_engine._gather_op = real_op
                eng._plans.clear()
                row["scatter"] = moved / median_s(partial(host_copies, eng, h, False),
                                                  args.repeat) / 1e9
            finally:
                torch_engine._gather_op = real_op
                eng.close()
                hpool.close()
            out.append(row)
            print(f"| {case} | {layout} | " + " | ".join(f"{row[f'gather_{o}']:.1f}" for o in OPS)
                  + f" | {row['scatter']:.1f} |", flush=True)
        del dpool
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "mib": args.mib, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
