"""Keys whose L3 read failed in this process: the one definition of "do not offer it again".

An L3 store's existence check and its read can disagree: an index entry whose file cannot be
opened, a slot whose checksum fails, a store that answers ``batch_exists`` and fails every
``batch_get``. Offering such a page again costs a failed load each time, and an engine that
reschedules a request after a failed load (vLLM) then asks again forever. So a key whose read
failed (an I/O error, a checksum or identity mismatch, a short read, a call past its deadline)
is remembered here, and every lookup's L3 run stops before it, until a write of that key
succeeds (the object was replaced). Bounded: the oldest entries go first.

Both halves of the controller use it (`CachePlanner` books its plans' results here,
`TieredKVCache` its reads and writes), so a failed page costs at most one retry in either.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Sequence

__all__ = ["UnreadableKeys"]


class UnreadableKeys:
    """A bounded set of page keys not to offer as L3 hits (see the module doc)."""

    #: Entries kept; beyond it the oldest are forgotten (a forgotten key costs one more retry).
    CAPACITY = 1 << 16

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = int(capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self.marked = 0            # keys added over the life of the set (a metric)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> int:
        """Remember ``keys`` as unreadable; returns how many were new."""
        new = 0
        with self._lock:
            for k in keys:
                if k in self._keys:
                    self._keys.move_to_end(k)
                    continue
                self._keys[k] = None
                new += 1
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
            self.marked += new
        return new

    def discard(self, keys: Iterable[bytes]) -> None:
        """A write of ``keys`` succeeded: their objects are new, offer them again."""
        if not self._keys:
            return
        with self._lock:
            for k in keys:
                self._keys.pop(k, None)

    def readable_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are not known to be unreadable."""
        if not self._keys:
            return len(keys)
        with self._lock:
            for i, k in enumerate(keys):
                if k in self._keys:
                    return i
        return len(keys)
