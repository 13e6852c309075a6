"""kvtier-ascend: Memfabric host allocator and AscendC page transfers for Ascend NPUs.
Importing this package imports neither torch_npu nor memfabric_hybrid."""

from ._version import __version__

KVTIER_INTERFACE_VERSION = 1

__all__ = ["__version__", "KVTIER_INTERFACE_VERSION"]
