"""The `ascendc` engine's own behaviour over the FAKE torch_npu and memfabric (tests/fakes/):
stream ordering, per-layer events, no hidden synchronisation, staging lifetime, return codes."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, KVSpec
from kvtier.errors import (BackendUnavailableError, ConfigError, LayoutError, PageIndexError,
                           TransferError)
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.testing import fill_random
from kvtier_ascend.host_allocator import MemfabricHostAllocator
from kvtier_ascend.metadata import META_SIZE
from kvtier_ascend.transfer_engine import AscendCTransferEngine

SPEC = KVSpec.mha(num_layers=4, num_kv_heads=2, head_dim=16, page_size=3, dtype="bfloat16")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def device_pool(spec=SPEC, pages=8, device="cpu") -> DeviceKVPool:
    pool = DeviceKVPool.empty(spec, pages, device)
    if device != "meta":
        for comp in pool.layers:
            for t in comp:
                fill_random(t)
    return pool


@pytest.fixture(params=["page_first", "layer_first"])
def pools(request, ascend_fakes):
    alloc = MemfabricHostAllocator({"capacity_bytes": 1 << 26})
    hpool = HostKVPool(SPEC, 10, layout=request.param, allocator=alloc)
    fill_random(hpool.raw)
    dpool = device_pool()
    yield dpool, hpool
    hpool.close()


@pytest.fixture
def engine(pools):
    dpool, hpool = pools
    eng = AscendCTransferEngine(dpool, hpool)
    yield eng
    eng.close()


def landed(dpool, hpool, dev: list[int], host: list[int], layer: int) -> bool:
    return all(torch.equal(raw(dpool.page(c, layer, d)), raw(hpool.view[h, layer, c]))
               for d, h in zip(dev, host) for c in range(SPEC.num_components))


def test_load_waits_per_layer_without_host_sync(ascend_fakes, pools, engine):
    npu, mf = ascend_fakes
    dpool, hpool = pools
    npu.mode = "deferred"
    host, dev = [7, 2, 9], [0, 5, 3]
    before = len(mf.launches)
    h = engine.load(host, dev)
    # Nothing ran: the launch synchronised no stream (every kernel is still queued).
    assert npu.pending() == SPEC.num_layers and not h.done()
    assert not any(landed(dpool, hpool, dev, host, layer) for layer in range(SPEC.num_layers))
    assert engine.inflight == 1, "the pinned staging must be held while the kernels are queued"
    h.wait_layer(1)                      # the caller's stream now waits for layer 1 ...
    assert npu.pending() == SPEC.num_layers, "wait_layer must not block the host"
    npu.module.npu.current_stream().synchronize()   # ... so layers 0 and 1 ran, 2 and 3 not
    assert [landed(dpool, hpool, dev, host, layer) for layer in range(4)] == \
        [True, True, False, False]
    assert not h.done() and engine.inflight == 1
    h.wait()
    npu.module.npu.current_stream().synchronize()
    assert all(landed(dpool, hpool, dev, host, layer) for layer in range(4))
    assert h.done() and engine.inflight == 0
    assert len(mf.launches) - before == SPEC.num_layers


def test_backup_is_one_launch_and_host_waits(ascend_fakes, pools, engine):
    npu, mf = ascend_fakes
    dpool, hpool = pools
    npu.mode = "deferred"
    before = len(mf.launches)
    h = engine.backup([1, 6], [4, 0])
    assert len(mf.launches) - before == 1 and not h.done()
    assert not torch.equal(raw(hpool.view[4, 2, 1]), raw(dpool.page(1, 2, 1)))
    h.wait()                             # the host consumer: blocks until the pages landed
    for layer in range(SPEC.num_layers):
        assert landed(dpool, hpool, [1, 6], [4, 0], layer)
    assert h.done()


def test_transfer_is_ordered_after_the_callers_stream(ascend_fakes, pools, engine):
    """Work the caller queued before load() (here: a fake kernel scribbling on the device
    pages) must run before the load, or it would overwrite what the load brought in."""
    npu, _ = ascend_fakes
    dpool, hpool = pools
    npu.mode = "deferred"
    caller = npu.module.npu.current_stream()
    npu.enqueue(caller, lambda: [fill_random(t) for comp in dpool.layers for t in comp])
    h = engine.load([3, 8], [2, 7])
    h.synchronize()                      # the engine's stream runs first ...
    npu.synchronize()                    # ... then anything still queued anywhere
    for layer in range(SPEC.num_layers):
        assert landed(dpool, hpool, [2, 7], [3, 8], layer)


def test_indices_as_lists_and_device_tensors(ascend_fakes, pools, engine):
    npu, _ = ascend_fakes
    dpool, hpool = pools
    rng = random.Random(5)
    for kind in ("list", "device", "mixed", "int32"):
        host = rng.sample(range(hpool.num_pages), 4)
        dev = rng.sample(range(dpool.num_pages), 4)
        fill_random(hpool.raw)
        pinned = npu.pinned
        if kind == "list":
            h_arg, d_arg = host, dev
        elif kind == "device":
            h_arg, d_arg = torch.tensor(host), torch.tensor(dev)
        elif kind == "mixed":
            h_arg, d_arg = host, torch.tensor(dev)
        else:
            h_arg, d_arg = torch.tensor(host, dtype=torch.int32), dev
        engine.load(h_arg, d_arg).wait()
        assert npu.pinned == pinned + 1, "one pinned staging buffer per call"
        for layer in range(SPEC.num_layers):
            assert landed(dpool, hpool, dev, host, layer), kind


def test_scattered_device_layers_still_round_trip(ascend_fakes):
    """Per-layer tensors at uneven addresses: backup needs one launch per evenly spaced run."""
    _, mf = ascend_fakes
    spec = KVSpec.mla(num_layers=5, kv_lora_rank=20, rope_dim=4, page_size=2, dtype="float16")
    slots = 6 * spec.page_size
    block = torch.empty((3, slots, 1, 24), dtype=torch.float16)
    layers = [block[0], block[1], torch.empty((slots, 1, 24), dtype=torch.float16),
              block[2], torch.empty((slots, 1, 24), dtype=torch.float16)]
    dpool = DeviceKVPool(spec, layers)
    for t in dpool.layers[0]:
        fill_random(t)
    alloc = MemfabricHostAllocator({"capacity_bytes": 1 << 24})
    with HostKVPool(spec, 7, allocator=alloc) as hpool:
        eng = AscendCTransferEngine(dpool, hpool)
        before = len(mf.launches)
        eng.backup([5, 0, 3], [6, 1, 2]).wait()
        assert len(mf.launches) - before == len(eng.plan.segments) > 1
        for d, h in zip([5, 0, 3], [6, 1, 2]):
            for layer in range(5):
                assert torch.equal(raw(hpool.view[h, layer, 0]), raw(dpool.page(0, layer, d)))
        for t in dpool.layers[0]:
            fill_random(t)
        eng.load([6, 1, 2], [1, 2, 4]).wait()
        for d, h in zip([1, 2, 4], [6, 1, 2]):
            for layer in range(5):
                assert torch.equal(raw(hpool.view[h, layer, 0]), raw(dpool.page(0, layer, d)))
        eng.close()


def test_return_codes_become_transfer_errors(ascend_fakes, pools, engine):
    npu, mf = ascend_fakes
    dpool, hpool = pools
    mf.next_kv_rc = [0, 0, -507035]      # the third per-layer launch fails
    with pytest.raises(TransferError) as err:
        engine.load([1, 2], [3, 4])
    assert err.value.code == -507035 and err.value.backend == "ascendc"
    assert "layers 2..2" in str(err.value) and "launch failed, ret: -507035" in str(err.value)
    assert engine.inflight <= 1
    mf.next_kv_rc = [-1]
    with pytest.raises(TransferError) as err:
        engine.backup([0], [0])
    assert err.value.code == -1
    mf.kernel_library_built = False
    with pytest.raises(TransferError, match="load library failed") as err:
        engine.load([0], [0])
    assert err.value.code == -1
    mf.kernel_library_built = True
    engine.load([5], [6]).wait()         # the engine still works afterwards
    assert landed(dpool, hpool, [6], [5], 0)


def test_device_fault_surfaces_as_transfer_error(ascend_fakes, pools, engine):
    _, mf = ascend_fakes
    mf.device_regions = [(1, 2)]         # nothing counts as device memory: the kernel faults
    with pytest.raises(TransferError, match="failed on the NPU"):
        engine.backup([0], [1]).wait()


def test_empty_and_closed(pools, engine):
    h = engine.load([], [])
    h.wait()
    assert h.done()
    engine.close()
    engine.close()
    with pytest.raises(TransferError, match="closed"):
        engine.load([0], [0])


def test_host_pool_must_be_memfabric_memory(ascend_fakes):
    dpool = device_pool()
    with HostKVPool(SPEC, 4, allocator=TorchPinnedAllocator()) as hpool:
        with pytest.raises(ConfigError, match="allocator='memfabric'") as err:
            AscendCTransferEngine(dpool, hpool)
    assert err.value.key == "host_pool.allocator"


def test_device_pool_must_be_on_the_npu(ascend_fakes):
    alloc = MemfabricHostAllocator({"capacity_bytes": 1 << 24})
    with HostKVPool(SPEC, 4, allocator=alloc) as hpool:
        with pytest.raises(LayoutError, match="on the NPU"):
            AscendCTransferEngine(device_pool(device="meta"), hpool)


def test_unknown_config_key(ascend_fakes, pools):
    dpool, hpool = pools
    with pytest.raises(ConfigError, match="device_id"):
        AscendCTransferEngine(dpool, hpool, {"device_id": 0})


def test_metadata_is_one_upload_per_call(ascend_fakes, pools, engine):
    """All launches of a call read their metadata from one device buffer, META_SIZE apart."""
    _, mf = ascend_fakes
    before = len(mf.launches)
    engine.load([0, 1], [2, 3]).wait()
    ptrs = mf.launches[before:]
    assert [p - ptrs[0] for p in ptrs] == [i * META_SIZE * 8 for i in range(SPEC.num_layers)]


def test_unchecked_device_indices_skip_the_range_check(ascend_fakes, pools):
    """validate_device_indices=False: NPU-resident index tensors are taken as they are (no
    host read-back); host-side ones are always checked. ("meta" stands in for the NPU here.)"""
    dpool, hpool = pools
    eng = AscendCTransferEngine(dpool, hpool, {"validate_device_indices": False})
    on_npu = torch.tensor([0, 99], device="meta", dtype=torch.int32)
    assert eng._check(dpool, on_npu, "device page").dtype == torch.int64
    with pytest.raises(PageIndexError):
        eng._check(dpool, torch.zeros(2, device="meta"), "device page")
    with pytest.raises(PageIndexError):
        eng._check(dpool, torch.tensor([0, 99]), "device page")
    eng.close()


def test_missing_runtime_at_construction(failing_import, fake_mf):
    failing_import("torch_npu", ImportError("libascendcl.so: cannot open shared object file"))
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2, dtype="float16")
    with HostKVPool(spec, 2, allocator=TorchPinnedAllocator()) as hpool:
        with pytest.raises(BackendUnavailableError, match="libascendcl.so is missing"):
            AscendCTransferEngine(DeviceKVPool.empty(spec, 2), hpool)
