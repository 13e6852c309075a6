"""Small core pieces the vendor packages lean on: error codes, test-data helpers, contract hooks."""

import pytest
import torch

from kvtier.errors import AllocationError, TransferError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.spec import KVSpec
from kvtier.testing import TransferEngineContract, fill_random, make_host_pool


def test_runtime_codes_ride_on_errors():
    err = AllocationError("malloc returned 0", backend="x", nbytes=8, code=0)
    assert (err.code, err.backend, err.nbytes) == (0, "x", 8)
    assert AllocationError("plain").code is None
    assert TransferError("launch", code=-1).code == -1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16,
                                   torch.float32, torch.int8])
def test_fill_random_every_dtype(dtype):
    t = torch.zeros(4096, dtype=dtype)
    fill_random(t)
    assert int(t.view(torch.uint8).max()) > 0
    if dtype.itemsize > 1 and dtype.is_floating_point:
        assert not torch.isnan(t).any()


def test_make_host_pool_takes_an_allocator_instance():
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2, dtype="float16")
    with make_host_pool(spec, 3, "layer_first", TorchPinnedAllocator()) as pool:
        assert pool.layout == "layer_first" and int(pool.raw.max()) > 0


def test_engine_contract_host_allocator_default():
    assert TransferEngineContract().host_allocator("torch") == "torch-pinned"
