"""Worker-side pieces the connector adds to kvtier's `CacheExecutor`: a store view that gives
each parallel rank its own objects, and the timer of the engine's forwards that measures its
recompute rate. (Pages move with kvtier's own transfer engines, which take vLLM's block
layouts through `DeviceKVPool.chunks`.)
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
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


class StepTimer:
    """Times the engine's forward of one step, from ``start`` (``bind_connector_metadata``,
    which vLLM calls before the forward) to ``stop`` (``wait_for_save``). On a host device by
    the wall clock; on CUDA by events on the current stream (the forward is queued, not run,
    when ``wait_for_save`` returns), read once they have completed and never waited for.
    `finished` hands back ``(tokens, pairs, seconds)`` of each timed step; a step never
    stopped is dropped."""

    #: Steps whose events may be pending at once (older ones are dropped, not waited for).
    MAX_PENDING = 64

    def __init__(self, cuda: bool = False):
        self.cuda = bool(cuda)
        self._open: tuple[int, float, Any] | None = None
        self._pending: deque[tuple[int, float, Any, Any]] = deque()
        self._done: list[tuple[int, float, float]] = []

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self, tokens: int, pairs: float) -> None:
        self._open = (int(tokens), float(pairs), self._mark())

    def stop(self) -> None:
        if self._open is None:
            return
        tokens, pairs, t0 = self._open
        self._open = None
        t1 = self._mark()
        if not self.cuda:
            self._done.append((tokens, pairs, t1 - t0))
            return
        self._pending.append((tokens, pairs, t0, t1))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()

    def finished(self) -> list[tuple[int, float, float]]:
        while self._pending and self._pending[0][3].query():
            tokens, pairs, t0, t1 = self._pending.popleft()
            self._done.append((tokens, pairs, t0.elapsed_time(t1) / 1e3))
        out, self._done = self._done, []
        return out
