"""Hardware smoke check (run by hand, not collected): one small load and backup per engine,
bitwise against torch, printing what was checked. ``python smoke_gpu.py``"""

from __future__ import annotations

import sys
import traceback

import torch
from kvtier import DeviceKVPool, HostKVPool, KVSpec, registry
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.testing.data import fill_random


def main() -> int:
    ok = True
    for spec in (KVSpec.mla(num_layers=4, kv_lora_rank=512, rope_dim=64, page_size=1),
                 KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16)):
        for name in ("nvidia-register", "nvidia-tma", "nvidia-copy-engine"):
            for layout in ("page_first", "layer_first"):
                try:
                    dpool = DeviceKVPool.empty(spec, 40, "cuda")
                    hpool = HostKVPool(spec, 30, layout=layout, allocator=TorchPinnedAllocator())
                    fill_random(hpool.raw)
                    for comp in dpool.layers:
                        for t in comp:
                            fill_random(t)
                    eng = registry.create_transfer_engine(name, dpool, hpool)
                    host, dev = [3, 1, 29, 7, 7], [0, 39, 5, 6, 20]
                    eng.load(host, dev).wait()
                    torch.cuda.synchronize()
                    good = all(torch.equal(
                        dpool.pages_view(c, layer)[d].view(torch.uint8).cpu(),
                        hpool.view[h, layer, c].view(torch.uint8))
                        for layer in range(spec.num_layers) for c in range(spec.num_components)
                        for h, d in zip(host, dev))
                    fill_random(hpool.raw)
                    eng.backup([39, 5], [11, 12]).wait()
                    torch.cuda.synchronize()
                    good2 = all(torch.equal(
                        dpool.pages_view(c, layer)[d].view(torch.uint8).cpu(),
                        hpool.view[h, layer, c].view(torch.uint8))
                        for layer in range(spec.num_layers) for c in range(spec.num_components)
                        for h, d in zip([11, 12], [39, 5]))
                    print(f"{name:20s} {spec.kind} chunk {spec.chunk_bytes:6d} {layout:11s} "
                          f"load {'ok' if good else 'WRONG'} backup {'ok' if good2 else 'WRONG'}",
                          flush=True)
                    ok &= good and good2
                    eng.close()
                    hpool.close()
                except Exception:
                    traceback.print_exc()
                    print(f"{name} {spec.kind} {layout}: FAILED", flush=True)
                    ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
