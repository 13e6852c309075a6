"""Random KV data and small pools for tests (never zeros: bugs must show)."""

from __future__ import annotations

import torch

from ..device_pool import DeviceKVPool
from ..host_pool import HostKVPool
from ..interfaces import HostAllocator
from ..spec import KVSpec


def random_specs() -> list[KVSpec]:
    """A handful of odd geometries: MHA and MLA, several dtypes, odd page sizes and dims."""
    return [
        KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16"),
        KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=40, page_size=16, dtype="float32"),
        KVSpec.mla(num_layers=3, kv_lora_rank=48, rope_dim=8, page_size=7, dtype="bfloat16"),
        KVSpec.mla(num_layers=1, kv_lora_rank=20, rope_dim=0, page_size=1, dtype="float16"),
    ]


def spec_id(spec: KVSpec) -> str:
    return f"{spec.kind}-L{spec.num_layers}-p{spec.page_size}-{spec.dtype}"


def fill_random(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` (any dtype, any device) with random bytes that are never all zero."""
    flat = t.view(-1).view(torch.uint8) if t.is_contiguous() else None
    if flat is not None:
        src = torch.randint(1, 256, (flat.numel(),), dtype=torch.uint8, generator=generator)
        flat.copy_(src.to(flat.device))
    else:
        tmp = torch.empty(t.shape, dtype=t.dtype)
        fill_random(tmp, generator)
        t.copy_(tmp.to(t.device))
    if t.dtype.is_floating_point and t.element_size() > 1:
        # no NaN payloads: they would compare unequal to themselves (fp8 has no nan_to_num;
        # compare fp8 as bytes)
        t.nan_to_num_(nan=1.5, posinf=2.5, neginf=-2.5)
    return t


def make_host_pool(spec: KVSpec, num_pages: int, layout: str = "page_first",
                   allocator: HostAllocator | str = "torch-pinned") -> HostKVPool:
    """A host pool of random bytes; ``allocator`` is an instance or a registered name."""
    if isinstance(allocator, str):
        from ..registry import create_host_allocator
        allocator = create_host_allocator(allocator)
    pool = HostKVPool(spec, num_pages, layout=layout, allocator=allocator)
    fill_random(pool.raw)
    return pool


def make_device_pool(spec: KVSpec, num_pages: int, device: str = "cpu") -> DeviceKVPool:
    pool = DeviceKVPool.empty(spec, num_pages, device)
    for comp in pool.require_layers("make_device_pool"):
        for t in comp:
            fill_random(t)
    return pool
