"""kvtier's contract suites against the umbp backends over the FAKE mori.umbp (amd-mori 1.2.4).

The suites normally decide at collection time, from the registry's probe, which backends run;
here the fake is installed per test, through the suites' hook for fakes: ``fake_backends``
lists the backends and the ``backend_environment`` fixture puts the fake in place. The same
suites run against the real module in test_hardware.py.
"""

from __future__ import annotations

import pytest
from kvtier.testing import HostAllocatorContract, L3StoreContract


class _OverFake:
    distribution = "kvtier-amd-umbp"
    fake_backends = ("umbp",)

    @pytest.fixture(autouse=True)
    def backend_environment(self, fake_umbp):
        yield fake_umbp


class TestUmbpHostAllocatorContract(_OverFake, HostAllocatorContract):
    pass


class TestUmbpStoreContract(_OverFake, L3StoreContract):
    pass
