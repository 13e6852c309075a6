"""The data path's parts built from a config, in one place: the host pool, the transfer engine
and the L3 store (opened in the keyer's namespace, seen as this tensor-parallel rank sees it),
each either given by the caller or created here, the store's in-place path where it has one
(`kvtier.cache.inplace`), and closed together if any step fails.

`TieredKVCache` and `CacheExecutor.from_config` both build theirs here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..device_pool import DeviceKVPool
from ..errors import ConfigError
from ..host_pool import HostKVPool
from ..interfaces import L3Store, TransferEngine
from ..keys import PageKeyer
from .config import CacheConfig
from .inplace import InPlace, open_in_place, says_why_not
from .keying import open_store, rank_view

__all__ = ["Parts", "build_parts"]


@dataclass
class Parts:
    host_pool: HostKVPool
    engine: TransferEngine
    store: L3Store | None          # the rank's view of it, attached to ``host_pool``
    owned: list[Any]               # what was created here, in creation order: close reversed
    in_place: InPlace | None = None           # loads straight from the store's memory
    in_place_why_not: str = ""                # why not ("" when they are)


def build_parts(cfg: CacheConfig, device_pool: DeviceKVPool, keyer: PageKeyer, *,
                num_host_pages: int | None = None, host_pool: HostKVPool | None = None,
                engine: TransferEngine | None = None, store: L3Store | None = None) -> Parts:
    """Create what is not given; on any failure close what was created and raise."""
    from ..registry import create_host_allocator, create_transfer_engine
    spec = device_pool.spec
    owned: list[Any] = []
    try:
        if host_pool is None:
            n = num_host_pages if num_host_pages is not None else \
                cfg.host_pages_for(spec.page_bytes, device_pool.num_pages)
            allocator = create_host_allocator(cfg.host_allocator, cfg.host_allocator_config)
            host_pool = HostKVPool(spec, n, layout=cfg.host_layout, allocator=allocator)
            owned.append(host_pool)
        elif host_pool.spec.fingerprint != spec.fingerprint:
            raise ConfigError(f"host pool spec {host_pool.spec} differs from the device "
                              f"pool's {spec}", key="spec")
        if engine is None:
            engine = create_transfer_engine(cfg.transfer_engine, device_pool, host_pool,
                                            cfg.transfer_config)
            owned.append(engine)
        if store is None:
            store = open_store(cfg, spec, keyer)
            if store is not None:
                owned.append(store)
        if store is not None:
            store = rank_view(store, cfg)
            store.attach(host_pool)
        in_place, why = open_in_place(cfg, store, device_pool, engine.name, owned)
    except BaseException:
        for obj in reversed(owned):
            obj.close()
        raise
    says_why_not(why, store)
    return Parts(host_pool, engine, store, owned, in_place, why)
