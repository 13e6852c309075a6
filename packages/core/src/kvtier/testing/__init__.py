"""Contract suites every backend must pass, and helpers for backend tests.

A package's tests subclass the suites and name the distribution whose backends they cover::

    from kvtier.testing import L3StoreContract

    class TestMyStores(L3StoreContract):
        distribution = "kvtier-my-vendor"

Every discovered backend of that distribution is a parameter; unavailable ones are SKIPPED
with the registry's reason. Hardware-only tests should carry the ``hardware`` marker.
"""

from .contracts import (HostAllocatorContract, L3StoreContract, TransferEngineContract,
                        backend_params)
from .data import fill_random, make_device_pool, make_host_pool, random_specs

__all__ = ["HostAllocatorContract", "L3StoreContract", "TransferEngineContract",
           "backend_params", "fill_random", "make_device_pool", "make_host_pool",
           "random_specs"]
