"""kvtier's contract suites over the package's backends, running on the FAKE vendor modules.

The suites usually decide at collection time (from the registry's probe) whether a backend can
run; here the fakes are installed per test, through the suites' hook for fakes: the backends
are listed in ``fake_backends`` and the ``backend_environment`` fixture installs the fakes (and
re-probes the registry).
The fake NPU's memory is host memory, so the "NPU" device pool is made of CPU tensors.
"""

from __future__ import annotations

import pytest

from kvtier.testing import HostAllocatorContract, TransferEngineContract
from kvtier_ascend.host_allocator import MemfabricHostAllocator

DIST = "kvtier-ascend"


class TestMemfabricAllocatorContract(HostAllocatorContract):
    distribution = DIST

    fake_backends = ("memfabric",)

    @pytest.fixture(autouse=True)
    def backend_environment(self, ascend_fakes):
        return ascend_fakes


class TestAscendCEngineContract(TransferEngineContract):
    distribution = DIST

    fake_backends = ("ascendc",)

    @pytest.fixture(autouse=True)
    def backend_environment(self, ascend_fakes):
        self.fake_npu, self.fake_mf = ascend_fakes
        return ascend_fakes

    def devices(self, backend_name: str) -> list[str]:
        # The fake NPU's streams live on the CPU: that is its device type.
        return [self.fake_npu.module.npu.current_stream().device.type]

    def host_allocator(self, backend_name: str):
        return MemfabricHostAllocator({"capacity_bytes": 1 << 26})
