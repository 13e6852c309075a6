# ruff: noqa: F401
"""Contract suites every backend must pass, and helpers for backend tests.

A package's tests subclass the suites and name the distribution whose backends they cover::

    from kvtier.testing import L3StoreContract, PackageContract

    class TestMyStores(L3StoreContract):
        distribution = "kvtier-my-vendor"

    class TestMyPackage(PackageContract):
        distribution = "kvtier-my-vendor"
        module = "kvtier_my_vendor"

Every discovered backend of that distribution is a parameter; unavailable ones are SKIPPED
with the registry's reason. Suites over FAKE vendor modules list their backends in
``fake_backends`` and put the fakes in place in the ``backend_environment`` fixture (see
`kvtier.testing.contracts`). Hardware-only tests carry the ``hardware`` marker.

The suites need pytest; `kvtier.testing.data` (random KV data, small pools) does not, and
importing this package loads neither until a name is used. `kvtier.testing.hostile` has the
helpers of hostile-input tests (a FIFO where a file should be, bounded calls and commands).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "HostAllocatorContract": "contracts", "L3StoreContract": "contracts",
    "TransferEngineContract": "contracts", "PackageContract": "contracts",
    "backend_params": "contracts",
    "fill_random": "data", "make_device_pool": "data", "make_host_pool": "data",
    "random_specs": "data",
}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover
    from .contracts import (HostAllocatorContract, L3StoreContract, PackageContract,
                            TransferEngineContract, backend_params)
    from .data import fill_random, make_device_pool, make_host_pool, random_specs
