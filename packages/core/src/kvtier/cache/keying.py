"""The one page keyer of a cache, and the per-rank view of a store that goes with it.

Every path that names pages -- `TieredKVCache` in one process, `CachePlanner` in a scheduler,
the engine integrations -- builds its keys with `make_keyer` from the same `CacheConfig`, the
device layout's byte order and whatever else the engine knows changes a page's bytes, so a
config gives one namespace wherever it runs and an L3 written by one path is read by the others.

The chain is the same on every tensor-parallel rank: ``tp_size`` is in the namespace, the rank
is not. Each rank's shard of a page is stored under `rank_key` (`RankKeyStore`, built where
``tp_size > 1``), so a planner that knows no rank and its workers agree on every page.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from ..interfaces import INTERFACE_VERSION, Availability, InPlaceReads, L3Store
from ..keys import PageKeyer
from ..spec import KVSpec
from .config import CacheConfig

__all__ = ["make_keyer", "open_store", "rank_key", "RankKeyStore", "rank_view"]


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def make_keyer(config: CacheConfig, spec: KVSpec, *, device_layout: str,
               engine: Mapping[str, Any] | None = None) -> PageKeyer:
    """The page keyer of ``config`` for pages of ``spec`` in a device layout whose page byte
    order is ``device_layout`` (`DeviceKVPool.page_order`). ``engine``: further fields the
    engine knows change a page's bytes (its dtype, KV-cache dtype, quantization, RoPE, ...),
    folded into the namespace as canonical JSON beside ``config.salt``."""
    salt = config.salt
    if engine:
        salt = json.dumps({"salt": config.salt, "engine": _plain(engine)}, sort_keys=True,
                          separators=(",", ":"))
    return PageKeyer(model_id=config.model_id, spec=spec, tp_rank=0, tp_size=config.tp_size,
                     salt=salt, device_layout=device_layout, **config.key_identity())


def open_store(config: CacheConfig, spec: KVSpec, keyer: PageKeyer) -> L3Store | None:
    """The L3 store ``config`` names (None without one), in ``keyer``'s namespace: a store
    whose Config has a ``namespace`` field (it keeps key namespaces apart and records its
    own, e.g. the file store's manifest) gets the keyer's unless the config gives one. Every
    path opens its store here, so they all open the same one."""
    if config.l3_store is None:
        return None
    import dataclasses

    from ..interfaces import L3_STORES
    from ..registry import create_l3_store, get_backend_class
    l3_config = dict(config.l3_config)
    cls = get_backend_class(L3_STORES, config.l3_store)
    names = {f.name for f in dataclasses.fields(cls.Config)} \
        if dataclasses.is_dataclass(cls.Config) else set()
    if "namespace" in names and "namespace" not in l3_config:
        l3_config["namespace"] = keyer.namespace_id
    return create_l3_store(config.l3_store, l3_config, spec=spec)


def rank_key(key: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The stored key of one tensor-parallel rank's shard of a page (the key itself on one
    rank): every rank writes its own object, the chain stays rank-free."""
    if tp_size == 1:
        return key
    return hashlib.sha256(f"kvtier.tp:{tp_rank}/{tp_size}:".encode() + key).digest()


class RankKeyStore(L3Store):
    """An L3 store seen through `rank_key` (built only when tensor parallelism is on)."""

    name = "rank-view"
    interface_version = INTERFACE_VERSION

    def __init__(self, inner: L3Store, tp_rank: int, tp_size: int):
        self.inner = inner
        self.spec = inner.spec
        self.config = inner.config
        self.host_pool = inner.host_pool
        self._map = lambda keys: [rank_key(k, tp_rank, tp_size) for k in keys]

    @classmethod
    def probe(cls) -> Availability:
        return Availability.available()

    def attach(self, host_pool: Any) -> None:
        self.inner.attach(host_pool)
        self.host_pool = host_pool

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        return self.inner.batch_exists(self._map(keys))

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        return self.inner.batch_get(self._map(keys), host_pages)

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        return self.inner.batch_set(self._map(keys), host_pages)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(self._map(keys))

    def clear(self) -> None:
        self.inner.clear()

    def in_place_reads(self) -> InPlaceReads | None:
        inner = self.inner.in_place_reads()
        return None if inner is None else _RankInPlace(inner, self._map)

    def stage(self, keys: Sequence[bytes]) -> Any:
        return self.inner.stage(self._map(keys))

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class _RankInPlace(InPlaceReads):
    def __init__(self, inner: InPlaceReads, key_map: Any):
        self.inner, self._map = inner, key_map
        self.buffer, self.num_slots = inner.buffer, inner.num_slots

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        return self.inner.pin(self._map(keys))

    def unpin(self, slots: Sequence[int]) -> None:
        self.inner.unpin(slots)


def rank_view(store: L3Store, config: CacheConfig) -> L3Store:
    """``store`` as rank ``config.tp_rank`` of ``config.tp_size`` sees it."""
    if config.tp_size == 1:
        return store
    return RankKeyStore(store, config.tp_rank, config.tp_size)
