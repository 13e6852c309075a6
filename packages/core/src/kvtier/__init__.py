# ruff: noqa: F401
"""kvtier: tiered KV-cache offloading (device L1, host L2, storage L3) for LLM inference.

Importing kvtier imports no vendor runtime, no torch and no tool: the names below are loaded
from their modules on first use, and backends are found through entry points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__

#: Public name -> the module that defines it (imported on first access).
_EXPORTS = {
    "INTERFACE_VERSION": "interfaces", "Availability": "interfaces",
    "Capabilities": "interfaces", "HostAllocator": "interfaces", "HostBuffer": "interfaces",
    "L3Store": "interfaces", "TransferEngine": "interfaces", "TransferHandle": "interfaces",
    "check_keys": "interfaces", "check_nbytes": "interfaces",
    "KVSpec": "spec", "PageKeyer": "keys", "DeviceKVPool": "device_pool",
    "HostKVPool": "host_pool",
    "TieredKVCache": "cache", "CacheConfig": "cache", "CachePlanner": "cache",
    "CacheExecutor": "cache",
    "discover": "registry", "create_host_allocator": "registry", "create_l3_store": "registry",
    "create_transfer_engine": "registry",
    **{name: "errors" for name in (
        "KVTierError", "ConfigError", "SpecError", "LayoutError", "PageIndexError",
        "PoolExhaustedError", "PagePinnedError", "TokensError", "BackendError",
        "BackendNotFoundError", "BackendUnavailableError", "BackendConflictError",
        "InterfaceVersionError", "EntryPointError", "StoreError", "TransferError",
        "TierFailureError", "InvalidArgumentError", "AllocationError", "InputError")},
}

__all__ = ["__version__", *_EXPORTS]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover  -- what type checkers and IDEs see (ruff: the names are
    # exported through __all__)
    from .cache import CacheConfig, CacheExecutor, CachePlanner, TieredKVCache
    from .device_pool import DeviceKVPool
    from .errors import (AllocationError, BackendConflictError, BackendError,
                         BackendNotFoundError, BackendUnavailableError, ConfigError,
                         EntryPointError, InputError, InterfaceVersionError,
                         InvalidArgumentError, KVTierError, LayoutError, PageIndexError,
                         PagePinnedError, PoolExhaustedError, SpecError, StoreError,
                         TierFailureError, TokensError, TransferError)
    from .host_pool import HostKVPool
    from .interfaces import (INTERFACE_VERSION, Availability, Capabilities, HostAllocator,
                             HostBuffer, L3Store, TransferEngine, TransferHandle, check_keys,
                             check_nbytes)
    from .keys import PageKeyer
    from .registry import (create_host_allocator, create_l3_store, create_transfer_engine,
                           discover)
    from .spec import KVSpec
