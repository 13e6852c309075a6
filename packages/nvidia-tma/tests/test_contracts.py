"""kvtier's contract suites against this package's backends (skipped without a GPU, with the
probe's reason)."""

from __future__ import annotations

from kvtier.testing import HostAllocatorContract, TransferEngineContract
from kvtier.testing.contracts import DeviceLayoutContract

DIST = "kvtier-nvidia-tma"


class TestTransferEngines(TransferEngineContract):
    distribution = DIST
    # Engines that move 16-byte units declare capabilities().row_alignment == 16; the suite
    # checks that they refuse other rows with LayoutError and skips those geometries.


class TestHostAllocator(HostAllocatorContract):
    distribution = DIST


class TestDeviceLayouts(DeviceLayoutContract):
    """Every device layout: moved bitwise, or refused with LayoutError when built."""

    distribution = DIST
