"""kvtier-core's own backends against the contract suites."""

from kvtier.testing import HostAllocatorContract, L3StoreContract, TransferEngineContract


class TestCoreHostAllocators(HostAllocatorContract):
    distribution = "kvtier-core"


class TestCoreL3Stores(L3StoreContract):
    distribution = "kvtier-core"


class TestCoreTransferEngines(TransferEngineContract):
    distribution = "kvtier-core"


class TestFileStoreObjectsFormat(L3StoreContract):
    """The file store's per-object format through the same contract (the registry's example
    config, used above, runs the default segments format), its pages split in layer groups
    however small (``group_bytes`` 0): the contract's ranged reads run on these pages, which
    are one group each, read whole only, in the segments format above."""

    def pytest_generate_tests(self, metafunc) -> None:
        if "backend_name" in metafunc.fixturenames:
            metafunc.parametrize("backend_name", ["file"])

    def make_config(self, backend_name: str, workdir: str) -> dict:
        return {**super().make_config(backend_name, workdir), "format": "objects",
                "group_bytes": 0}
