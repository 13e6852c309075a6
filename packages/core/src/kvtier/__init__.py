"""kvtier: tiered KV-cache offloading (device L1, host L2, storage L3) for LLM inference.

Importing kvtier imports no vendor runtime; backends are found through entry points.
"""

from __future__ import annotations

from ._version import __version__
from .device_pool import DeviceKVPool
from .errors import (AllocationError, BackendConflictError, BackendError, BackendNotFoundError,
                     BackendUnavailableError, ConfigError, EntryPointError,
                     InterfaceVersionError, InvalidArgumentError, KVTierError, LayoutError,
                     PageIndexError, PagePinnedError, PoolExhaustedError, SpecError,
                     StoreError, TierFailureError, TokensError, TransferError)
from .host_pool import HostKVPool
from .interfaces import (INTERFACE_VERSION, Availability, Capabilities, HostAllocator,
                         HostBuffer, L3Store, TransferEngine, TransferHandle)
from .keys import PageKeyer
from .registry import (create_host_allocator, create_l3_store, create_transfer_engine,
                       discover)
from .spec import KVSpec

__all__ = [
    "__version__", "INTERFACE_VERSION", "KVSpec", "PageKeyer", "DeviceKVPool", "HostKVPool",
    "Availability", "Capabilities", "HostAllocator", "HostBuffer", "L3Store", "TransferEngine",
    "TransferHandle", "discover", "create_host_allocator", "create_l3_store",
    "create_transfer_engine", "KVTierError", "ConfigError", "SpecError", "LayoutError",
    "PageIndexError", "PoolExhaustedError", "PagePinnedError", "TokensError", "BackendError",
    "BackendNotFoundError", "BackendUnavailableError", "BackendConflictError",
    "InterfaceVersionError", "EntryPointError", "StoreError", "TransferError",
    "TierFailureError", "InvalidArgumentError", "AllocationError",
]
