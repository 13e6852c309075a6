"""The worker-side piece the connector adds to kvtier's `CacheExecutor`: the timer of the
engine's forwards that measures its recompute rate. (Pages move with kvtier's own transfer
engines, which take vLLM's block layouts through `DeviceKVPool.chunks`; each parallel rank's
objects are kept apart by `kvtier.cache.keying.RankKeyStore`.)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any


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
