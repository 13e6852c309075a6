"""On a real Ascend NPU (real torch_npu, real memfabric_hybrid, no fakes): skipped with the
probe's reason anywhere else. These have not been run on Ascend hardware by this project yet."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import HostKVPool, KVSpec, registry
from kvtier.interfaces import HOST_ALLOCATORS, TRANSFER_ENGINES
from kvtier.testing import fill_random

pytestmark = pytest.mark.hardware


def require(group: str, name: str) -> None:
    av = registry.probe(registry.get_record(group, name), refresh=True)
    if not av.ok:
        pytest.skip(f"{name}: {av.reason}" + (f" ({av.hint})" if av.hint else ""))


@pytest.fixture
def session_cleanup():
    yield
    from kvtier_ascend import _memfabric
    _memfabric.shutdown()


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8)


def test_memfabric_buffer(session_cleanup):
    require(HOST_ALLOCATORS, "memfabric")
    alloc = registry.create_host_allocator("memfabric", {"capacity_bytes": 1 << 30})
    buf = alloc.allocate((64 << 20) + 3)
    try:
        assert buf.details["dva"] and buf.device_addressable
        data = torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8)
        buf.tensor.copy_(data)
        assert torch.equal(buf.tensor, data)
    finally:
        buf.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("spec", [
    KVSpec.mha(num_layers=4, num_kv_heads=8, head_dim=128, page_size=64, dtype="bfloat16"),
    KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=128, dtype="bfloat16"),
], ids=["mha", "mla"])
def test_round_trip_on_npu(spec, layout, session_cleanup):
    require(TRANSFER_ENGINES, "ascendc")
    import torch_npu

    from kvtier import DeviceKVPool
    dpool = DeviceKVPool.empty(spec, 32, "npu:0")
    for comp in dpool.layers:
        for t in comp:
            fill_random(t)
    alloc = registry.create_host_allocator("memfabric", {"capacity_bytes": 1 << 30})
    with HostKVPool(spec, 40, layout=layout, allocator=alloc) as hpool:
        fill_random(hpool.raw)
        eng = registry.create_transfer_engine("ascendc", dpool, hpool)
        rng = random.Random(0)
        dev, host = rng.sample(range(32), 13), rng.sample(range(40), 13)
        eng.backup(dev, host).wait()
        for layer in range(spec.num_layers):
            for c in range(spec.num_components):
                for d, h in zip(dev, host):
                    assert torch.equal(raw(hpool.view[h, layer, c]), raw(dpool.page(c, layer, d)))
        want = {(h, layer, c): hpool.view[h, layer, c].clone()
                for h in host for layer in range(spec.num_layers)
                for c in range(spec.num_components)}
        for comp in dpool.layers:
            for t in comp:
                fill_random(t)
        dst = torch.tensor(rng.sample(range(32), 13), device="npu:0")
        handle = eng.load(host, dst)
        for layer in range(spec.num_layers):
            handle.wait_layer(layer)
            torch_npu.npu.synchronize()
            for c in range(spec.num_components):
                for d, h in zip(dst.tolist(), host):
                    assert torch.equal(raw(dpool.page(c, layer, d)), raw(want[(h, layer, c)]))
        assert handle.done()
        eng.close()
