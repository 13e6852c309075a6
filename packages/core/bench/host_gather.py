"""Which of torch's CPU ops gathers (and scatters) host rows fastest, by row size: the staged
path of the `torch` transfer engine moves pages through them.

    python packages/core/bench/host_gather.py [--gib 1] [--json OUT.json]

Rows of 8 KiB to 2 MiB in random order, 32 MiB per call, median of 5, from the main thread and
from a worker thread (the engine calls them from one). With CUDA the buffers are pinned
(registered), as the engine's are.
"""

from __future__ import annotations

import argparse
import json
import threading

import torch
from _staged import median_s

ROWS = (8 << 10, 72 << 10, 126 << 10, 504 << 10, 2 << 20)


def methods(src: torch.Tensor, idx: torch.Tensor, st: torch.Tensor) -> dict:
    rows = idx.tolist()
    src16, st16 = src.view(torch.complex128), st.view(torch.complex128)   # 16-byte words

    def row_loop() -> None:
        for i, j in enumerate(rows):
            st[i].copy_(src[j])
    return {
        "index_select": lambda: torch.index_select(src, 0, idx, out=st),
        "aten_index": lambda: torch.ops.aten.index.Tensor_out(src, [idx], out=st),
        "row_loop": row_loop,
        "index_copy (scatter)": lambda: src.index_copy_(0, idx, st),
        "index_copy 16 B (scatter)": lambda: src16.index_copy_(0, idx, st16),
        "index_put (scatter)": lambda: src.index_put_((idx,), st),
    }


def gbps(fn, nbytes: int, repeat: int = 5) -> float:
    return nbytes / median_s(fn, repeat) / 1e9


def run(buf: torch.Tensor, stage: torch.Tensor, where: str, out: dict) -> None:
    for row in ROWS:
        n = stage.numel() // row
        P = buf.numel() // row
        src = buf[:P * row].view(torch.int64).view(P, row // 8)
        idx = torch.randperm(P)[:n]
        st = stage[:n * row].view(torch.int64).view(n, row // 8)
        for name, fn in methods(src, idx, st).items():
            if name == "row_loop" and n > 2000:
                continue
            out[(where, row, name)] = gbps(fn, n * row)
        print(f"{where}: {row >> 10} KiB rows done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="host buffer the rows come from")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()
    n = int(args.gib * (1 << 30))
    cuda = torch.cuda.is_available()
    buf = torch.empty(n, dtype=torch.uint8)
    if cuda:
        torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), n, 0)
    buf.random_(0, 255)
    stage = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=cuda)
    out: dict = {}
    run(buf, stage, "main thread", out)
    t = threading.Thread(target=run, args=(buf, stage, "worker thread", out))
    t.start()
    t.join()
    names = list(methods(buf[:16].view(torch.int64).view(1, 2), torch.zeros(1, dtype=torch.long),
                         torch.empty(1, 2, dtype=torch.int64)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GB/s")
    print("| thread | row | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for where in ("main thread", "worker thread"):
        for row in ROWS:
            cells = [f"{out[(where, row, m)]:.1f}" if (where, row, m) in out else "-"
                     for m in names]
            print(f"| {where} | {row >> 10} KiB | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "gbps": [{"thread": w, "row_bytes": r, "op": m, "gbps": v}
                                for (w, r, m), v in out.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
