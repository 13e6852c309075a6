"""Worker-side pieces the connector adds to kvtier's `CacheExecutor`: a store view that gives
each parallel rank its own objects. (Pages move with kvtier's own transfer engines, which take
vLLM's block layouts through `DeviceKVPool.chunks`.)
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence


from ...interfaces import INTERFACE_VERSION, Availability, L3Store


def rank_key(key: bytes, tp_rank: int, tp_size: int) -> bytes:
    """The stored key of one tensor-parallel rank's shard of a page (the key itself on one
    rank): every rank writes its own object, the scheduler's chain stays rank-free."""
    if tp_size == 1:
        return key
    return hashlib.sha256(f"kvtier.tp:{tp_rank}/{tp_size}:".encode() + key).digest()


class RankKeyStore(L3Store):
    """An L3 store seen through `rank_key` (only built when tensor parallelism is on)."""

    name = "vllm-rank-view"
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

    def attach(self, host_pool) -> None:
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

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
