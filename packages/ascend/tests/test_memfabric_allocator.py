"""The `memfabric` host allocator over the FAKE memfabric_hybrid (tests/fakes/fake_memfabric.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier import HostKVPool, KVSpec
from kvtier.errors import AllocationError, ConfigError, InvalidArgumentError
from kvtier_ascend import _memfabric
from kvtier_ascend.host_allocator import MemfabricHostAllocator, shutdown

GIB = 1 << 30


def test_buffer_reports_dva_and_is_real_memory(ascend_fakes):
    _, mf = ascend_fakes
    alloc = MemfabricHostAllocator({"capacity_bytes": 3 * GIB // 2, "device_id": 0})
    buf = alloc.allocate(10_000 + 7)
    try:
        assert buf.device_addressable and buf.backing == "memfabric-offload"
        assert buf.nbytes == 10_007 and buf.tensor.numel() == 10_007
        assert buf.ptr in mf.blocks and buf.tensor.data_ptr() == buf.ptr
        assert buf.details["dva"] == mf.get_dva(buf.ptr) != buf.ptr
        assert buf.details["pool_reserved_bytes"] == 2 * GIB       # whole GiB, like memfabric
        cfg = mf.config
        assert (cfg.reserve_size, cfg.alloc_size, cfg.device_id, int(cfg.scene), cfg.flags) \
            == (2 * GIB, 2 * GIB, 0, 0, 0)
        data = torch.randint(0, 256, (10_007,), dtype=torch.uint8)
        buf.tensor.copy_(data)
        # what the NPU sees at the DVA is what the host wrote
        assert mf.read_dva(buf.details["dva"], 10_007) == bytes(data.tolist())
    finally:
        buf.close()
    assert buf.ptr in mf.freed and not mf.blocks


def test_one_session_per_process(ascend_fakes):
    _, mf = ascend_fakes
    inits, uninits = mf.init_calls, mf.uninit_calls           # the probes' trial sessions
    a = MemfabricHostAllocator({"capacity_bytes": GIB})
    b = MemfabricHostAllocator({"capacity_bytes": 8 * GIB})     # shares a's reservation
    x, y = a.allocate(4096), b.allocate(4096)
    try:
        assert mf.init_calls == inits + 1 and x.details["pool_reserved_bytes"] == GIB
        with pytest.raises(AllocationError, match="already initialised for NPU 0"):
            MemfabricHostAllocator({"device_id": 1}).allocate(16)
        with pytest.raises(AllocationError, match="still allocated"):
            shutdown()
    finally:
        x.close()
        y.close()
    shutdown()
    assert mf.uninit_calls == uninits + 1 and not mf.initialized
    z = a.allocate(64)                                         # a fresh session
    assert mf.init_calls == inits + 2
    z.close()


def test_capacity_is_enforced_before_memfabric(ascend_fakes):
    _, mf = ascend_fakes
    alloc = MemfabricHostAllocator({"capacity_bytes": GIB})
    big = alloc.allocate(GIB - 4096)
    with pytest.raises(AllocationError, match="do not fit") as err:
        alloc.allocate(8192)
    assert err.value.nbytes == 8192 and err.value.backend == "memfabric"
    big.close()
    alloc.allocate(8192).close()                               # freed capacity is reusable


def test_initialize_failure_quotes_memfabric(ascend_fakes):
    _, mf = ascend_fakes
    mf.init_failure = mf.NO_DRIVER_LOG
    with pytest.raises(AllocationError) as err:
        MemfabricHostAllocator({"capacity_bytes": GIB}).allocate(100)
    assert err.value.code == -1
    assert "ascend driver does not support mf" in str(err.value)
    assert "returned -1" in str(err.value)
    assert "[OFFLOAD" not in str(err.value)                    # source prefixes stripped


def test_malloc_and_get_dva_failures_are_typed(ascend_fakes):
    _, mf = ascend_fakes
    alloc = MemfabricHostAllocator({"capacity_bytes": GIB})
    mf.fail_malloc = True
    with pytest.raises(AllocationError, match="allocate fail") as err:
        alloc.allocate(100)
    assert err.value.code == 0
    mf.fail_malloc, mf.fail_get_dva = False, True
    with pytest.raises(AllocationError, match="get_dva") as err:
        alloc.allocate(100)
    assert err.value.code == 0
    assert not mf.blocks, "a block whose DVA failed must be freed again"


def test_giant_pages_flag(ascend_fakes):
    _, mf = ascend_fakes
    buf = MemfabricHostAllocator({"giant_pages": True}).allocate(10)
    assert mf.config.flags == 1 and buf.backing == "memfabric-offload-giant"
    buf.close()


@pytest.mark.parametrize("cfg", [{"capacity_bytes": 0}, {"device_id": -1},
                                 {"capacity": 1}, {"capacity_bytes": "1G"}])
def test_bad_config_is_config_error(cfg):
    with pytest.raises(ConfigError):
        MemfabricHostAllocator(cfg)


def test_bad_sizes_touch_nothing(ascend_fakes):
    _, mf = ascend_fakes
    inits = mf.init_calls
    for bad in (0, -5, 2.0, True, "9"):
        with pytest.raises(InvalidArgumentError):
            MemfabricHostAllocator().allocate(bad)
    assert mf.init_calls == inits and not mf.initialized


def test_backs_host_pool_of_both_layouts(ascend_fakes):
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=12, rope_dim=4, page_size=3, dtype="bfloat16")
    alloc = MemfabricHostAllocator({"capacity_bytes": GIB})
    for layout in ("page_first", "layer_first"):
        with HostKVPool(spec, 5, layout=layout, allocator=alloc) as pool:
            assert pool.buffer.details["dva"]
            pool.raw.fill_(7)
            assert int(pool.view.view(torch.uint8).min()) == 7


def test_unusable_memfabric_is_allocation_error(failing_import):
    failing_import("memfabric_hybrid", OSError("libmf_hybm_core.so: cannot open shared "
                                               "object file: No such file or directory"))
    _memfabric._session = None
    with pytest.raises(AllocationError, match="libmf_hybm_core.so"):
        MemfabricHostAllocator().allocate(10)
