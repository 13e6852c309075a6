"""What a prefill of the demo's 8B model costs on the GPU by length (median of 5 after one
untimed), and the calling thread's CPU time beside it. A ratio of 1.00 says the thread never
slept during the prefill; it does not say why (issuing kernels, or a synchronising call that
spins, which CUDA does by default).

python3 records/demo-h100-load/prefill_floor.py   (CUDA; SIZE=tiny DEVICE=cpu to try it on a CPU)"""

import os
import time

import torch

from kvtier_tools.demo.model import DemoModel

dev = os.environ.get("DEVICE", "cuda")
m = DemoModel(os.environ.get("SIZE", "8b"), device=dev,
              dtype="bfloat16" if dev == "cuda" else "float32")
ps = m.page_size
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
pool = m.new_pool(160)
gen = torch.Generator().manual_seed(0)
print(f"{'tokens':>7} {'prefix':>7} {'wall ms':>8} {'thread cpu ms':>14} {'cpu/wall':>8}")
for prefix_pages, n in [(0, 128), (0, 256), (0, 512), (0, 1024), (0, 2048), (0, 4096),
                        (24, 1920), (24, 1600), (8, 1024)]:
    toks = m.as_tokens(torch.randint(0, m.vocab_size, (n + 1,), generator=gen))
    pre = list(range(prefix_pages))
    new = list(range(prefix_pages, (n + 1) // ps))
    if prefix_pages:                       # the prefix pages hold some KV first
        m.prefill(toks[:prefix_pages * ps + 1], pool, [], pre)
    walls, cpus = [], []
    for rep in range(6):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        m.prefill(toks, pool, pre, new)
        c1 = time.thread_time()
        sync()
        t1 = time.perf_counter()
        if rep:
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
    w, c = sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]
    print(f"{n:>7} {prefix_pages * ps:>7} {1e3 * w:>8.1f} {1e3 * c:>14.1f} {c / w:>8.2f}",
          flush=True)
