"""The same contract suites against the real mori.umbp on AMD hardware. Backends whose probe
fails (no amd-mori, a native library missing, no AMD GPU) are SKIPPED with the probe's reason.
"""

from __future__ import annotations

import pytest
from kvtier.testing import HostAllocatorContract, L3StoreContract

pytestmark = pytest.mark.hardware


class TestUmbpHostAllocatorOnHardware(HostAllocatorContract):
    distribution = "kvtier-amd-umbp"


class TestUmbpStoreOnHardware(L3StoreContract):
    distribution = "kvtier-amd-umbp"
