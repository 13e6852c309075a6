"""kvtier-core's own backends against the contract suites."""

from kvtier.testing import HostAllocatorContract, L3StoreContract, TransferEngineContract


class TestCoreHostAllocators(HostAllocatorContract):
    distribution = "kvtier-core"


class TestCoreL3Stores(L3StoreContract):
    distribution = "kvtier-core"


class TestCoreTransferEngines(TransferEngineContract):
    distribution = "kvtier-core"
