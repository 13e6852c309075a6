"""DeviceKVPool over engine block layouts: the byte chunks of every layout, checked against
page bytes built independently from the logical K and V (random data, odd geometries)."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import DeviceKVPool, KVSpec, LayoutError
from kvtier.device_pool import BLOCK_LAYOUTS

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "float16"]


def _rand(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def _logical(spec: KVSpec, blocks: int, seed: int) -> tuple[list, list]:
    S, (H, D) = spec.page_size, spec.row_shape
    k = [_rand((blocks, S, H, D), spec.torch_dtype, seed + 2 * i) for i in range(spec.num_layers)]
    v = [_rand((blocks, S, H, D), spec.torch_dtype, seed + 2 * i + 1)
         for i in range(spec.num_layers)]
    return k, v


def _build(layout: str, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    kh, vh = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)       # [b, H, S, D]
    if layout == "vllm_flash":
        return torch.stack([k, v], 0).contiguous()
    if layout == "flashinfer_nhd":
        return torch.stack([k, v], 1).contiguous()
    if layout == "flashinfer_hnd":
        return torch.stack([kh, vh], 1).contiguous()
    if layout == "vllm_cpu":                 # per block and head: K rows, then V rows
        b, h, s, d = kh.shape
        return torch.cat([kh, vh], 2).contiguous().view(b, h, s, 2 * d)
    raise AssertionError(layout)


def _expected_page(order: str, k: list, v: list, p: int) -> torch.Tensor:
    def b(t):
        return t.contiguous().view(-1).view(torch.uint8)
    parts = []
    for kl, vl in zip(k, v):
        if order == "nhd":
            parts += [b(kl[p]), b(vl[p])]
        elif order == "hnd":
            parts += [b(kl[p].permute(1, 0, 2)), b(vl[p].permute(1, 0, 2))]
        else:                                # hkv
            parts.append(b(torch.stack([kl[p].permute(1, 0, 2), vl[p].permute(1, 0, 2)], 1)))
    return torch.cat(parts)


@pytest.mark.parametrize("layout", ["vllm_flash", "flashinfer_nhd", "flashinfer_hnd",
                                    "vllm_cpu"])
@pytest.mark.parametrize("seed", range(3))
def test_block_layout_page_bytes(layout: str, seed: int) -> None:
    rng = random.Random(seed)
    spec = KVSpec.mha(rng.randint(1, 3), rng.choice([1, 2, 3]), rng.choice([4, 6, 8]),
                      rng.choice([1, 3, 4]), dtype=rng.choice(DTYPES))
    blocks = rng.randint(2, 7)
    k, v = _logical(spec, blocks, seed * 100)
    pool = DeviceKVPool.from_blocks(spec, [_build(layout, a, b) for a, b in zip(k, v)], layout)
    assert pool.layout == layout and pool.num_pages == blocks
    assert pool.page_order == BLOCK_LAYOUTS[layout][0]
    assert sum(pool.chunk_nbytes) * spec.num_layers == spec.page_bytes
    for p in rng.sample(range(blocks), blocks):
        want = _expected_page(pool.page_order, k, v, p)
        assert torch.equal(pool.page_bytes(p), want)


def test_chunks_are_views_of_the_engine_buffer() -> None:
    spec = KVSpec.mha(2, 2, 4, 3, dtype="bfloat16")
    k, v = _logical(spec, 5, 7)
    tensors = [_build("flashinfer_nhd", a, b) for a, b in zip(k, v)]
    pool = DeviceKVPool.from_blocks(spec, tensors, "flashinfer_nhd")
    new = _rand((spec.chunk_bytes,), torch.uint8, 99)
    pool.chunks[1][1][3].copy_(new)                    # V chunk of layer 1, page 3
    got = tensors[1][3, 1].contiguous().view(-1).view(torch.uint8)
    assert torch.equal(got, new)


def test_token_major_and_vllm_flash_pages_are_byte_identical() -> None:
    spec = KVSpec.mha(3, 2, 8, 4, dtype="float16")
    k, v = _logical(spec, 6, 11)
    flash = DeviceKVPool.from_blocks(spec, [_build("vllm_flash", a, b) for a, b in zip(k, v)],
                                     "vllm_flash")
    tm = DeviceKVPool(spec, [x.reshape(-1, *spec.row_shape) for x in k],
                      [x.reshape(-1, *spec.row_shape) for x in v])
    assert tm.layout == "token_major" and tm.page_order == flash.page_order == "nhd"
    for p in range(6):
        assert torch.equal(tm.page_bytes(p), flash.page_bytes(p))
    assert flash.layers is not None                   # K and V are contiguous tensors
    assert torch.equal(flash.page(1, 2, 4).view(torch.uint8), v[2][4].view(torch.uint8))


def test_mla_block_layout() -> None:
    spec = KVSpec.mla(2, kv_lora_rank=6, rope_dim=2, page_size=3, dtype="bfloat16")
    lat = [_rand((4, 3, 8), spec.torch_dtype, i) for i in range(2)]
    pool = DeviceKVPool.from_blocks(spec, lat, "mla")
    assert pool.page_order == "nhd" and pool.chunk_nbytes == (spec.chunk_bytes,)
    want = torch.cat([x[2].contiguous().view(-1).view(torch.uint8) for x in lat])
    assert torch.equal(pool.page_bytes(2), want)


def test_block_layout_errors() -> None:
    spec = KVSpec.mha(2, 2, 4, 3, dtype="float32")
    good = [torch.zeros(2, 5, 3, 2, 4) for _ in range(2)]
    with pytest.raises(LayoutError, match="unknown device layout"):
        DeviceKVPool.from_blocks(spec, good, "nope")
    with pytest.raises(LayoutError, match="expects"):
        DeviceKVPool.from_blocks(spec, good, "vllm_cpu")
    with pytest.raises(LayoutError, match="layer tensors"):
        DeviceKVPool.from_blocks(spec, good[:1], "vllm_flash")
    with pytest.raises(LayoutError, match="dtype"):
        DeviceKVPool.from_blocks(spec, [g.half() for g in good], "vllm_flash")
    with pytest.raises(LayoutError, match="contiguous"):
        DeviceKVPool.from_blocks(spec, [torch.zeros(5, 2, 3, 2, 4).transpose(0, 1)] * 2,
                                 "vllm_flash")
    with pytest.raises(LayoutError, match="does not fit"):
        DeviceKVPool.from_blocks(spec, good, "mla")


def test_engines_refuse_layouts_they_cannot_move() -> None:
    from kvtier import HostKVPool
    from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
    from kvtier.transfer_engines.torch_engine import TorchTransferEngine
    spec = KVSpec.mha(2, 2, 4, 3, dtype="float32")
    k, v = _logical(spec, 4, 3)
    pool = DeviceKVPool.from_blocks(spec, [_build("vllm_cpu", a, b) for a, b in zip(k, v)],
                                    "vllm_cpu")
    assert pool.layers is None
    with pytest.raises(LayoutError, match="vllm_cpu"):
        pool.require_layers("some-engine")
    host = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
    try:
        with pytest.raises(LayoutError, match="torch: device layout 'vllm_cpu'"):
            TorchTransferEngine(pool, host)
    finally:
        host.close()
