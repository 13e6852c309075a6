"""kvtier's contract suites against the umbp backends over the FAKE mori.umbp (amd-mori 1.2.4).

The suites normally decide at collection time, from the registry's probe, which backends run;
here the fake is installed per test (fixture), so the backends are listed explicitly and the
fake is put in place before each test. The same suites run against the real module in
test_hardware.py.
"""

from __future__ import annotations

import pytest
from kvtier.testing import HostAllocatorContract, L3StoreContract


class _OverFake:
    distribution = "kvtier-amd-umbp"

    def pytest_generate_tests(self, metafunc):
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", ["umbp"])

    @pytest.fixture(autouse=True)
    def _fake(self, fake_umbp):
        yield fake_umbp


class TestUmbpHostAllocatorContract(_OverFake, HostAllocatorContract):
    pass


class TestUmbpStoreContract(_OverFake, L3StoreContract):
    pass
