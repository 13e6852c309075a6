"""kvtier's contract suites over the package's backends, running on the FAKE vendor modules.

The suites usually decide at collection time (from the registry's probe) whether a backend can
run; here the fakes are installed per test by a fixture, so the backends are parametrised
without that collection-time probe and the registry is re-probed once the fakes are in place.
The fake NPU's memory is host memory, so the "NPU" device pool is made of CPU tensors.
"""

from __future__ import annotations

import pytest

from kvtier import registry
from kvtier.interfaces import HOST_ALLOCATORS, TRANSFER_ENGINES
from kvtier.testing import HostAllocatorContract, TransferEngineContract
from kvtier_ascend.host_allocator import MemfabricHostAllocator

DIST = "kvtier-ascend"


def _params(group: str) -> list:
    names = [r.name for r in registry.records(group) if r.distribution == DIST]
    assert names, f"no {group} backend registered by {DIST}"
    return [pytest.param(n, id=f"{n}-on-fakes") for n in names]


class TestMemfabricAllocatorContract(HostAllocatorContract):
    distribution = DIST

    def pytest_generate_tests(self, metafunc):
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", _params(HOST_ALLOCATORS))

    @pytest.fixture(autouse=True)
    def _fakes(self, ascend_fakes):
        return ascend_fakes


class TestAscendCEngineContract(TransferEngineContract):
    distribution = DIST

    def pytest_generate_tests(self, metafunc):
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", _params(TRANSFER_ENGINES))

    @pytest.fixture(autouse=True)
    def _fakes(self, ascend_fakes):
        self.fake_npu, self.fake_mf = ascend_fakes
        return ascend_fakes

    def devices(self, backend_name: str) -> list[str]:
        # The fake NPU's streams live on the CPU: that is its device type.
        return [self.fake_npu.module.npu.current_stream().device.type]

    def host_allocator(self, backend_name: str):
        return MemfabricHostAllocator({"capacity_bytes": 1 << 26})
