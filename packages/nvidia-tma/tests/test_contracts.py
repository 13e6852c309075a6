"""kvtier's contract suites against this package's backends (skipped without a GPU, with the
probe's reason)."""

from __future__ import annotations

import pytest
from kvtier.testing import HostAllocatorContract, TransferEngineContract
from kvtier.testing.contracts import DeviceLayoutContract
from kvtier.testing.data import random_specs, spec_id

DIST = "kvtier-nvidia-tma"


class TestTransferEngines(TransferEngineContract):
    distribution = DIST

    @pytest.fixture(params=random_specs(), ids=spec_id)
    def spec(self, request, backend_name):
        spec = request.param
        if backend_name != "nvidia-copy-engine" and spec.row_bytes % 16:
            pytest.skip(f"{backend_name} moves 16-byte units; {spec.row_bytes} B rows are "
                        "refused with LayoutError (test_gpu.py::test_misaligned_rows_*)")
        return spec


class TestHostAllocator(HostAllocatorContract):
    distribution = DIST


class TestDeviceLayouts(DeviceLayoutContract):
    """Every device layout: moved bitwise, or refused with LayoutError when built."""

    distribution = DIST
