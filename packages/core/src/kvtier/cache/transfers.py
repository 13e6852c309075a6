"""L1 <-> L2 transfer bookkeeping: waiting for copies on the host, and the completion thread.

`host_wait` blocks until a `TransferHandle`'s copies have really landed (``synchronize()`` when
the handle has it, else ``wait()`` then polling ``done()``). `Completer` is one daemon thread
that waits for submitted handles in order and then runs their callbacks; the controller books
a finished backup or fetch there, and `CacheExecutor` finishes plans there.
"""

from __future__ import annotations

import time
import threading
from collections import deque
from typing import Callable

from ..interfaces import TransferHandle

__all__ = ["host_wait", "Completer"]


def host_wait(handle: TransferHandle) -> None:
    """Block the calling thread until ``handle``'s copies have really landed."""
    sync = getattr(handle, "synchronize", None)
    if sync is not None:
        sync()
        return
    handle.wait()
    delay = 20e-6
    while not handle.done():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class Completer:
    """One thread that waits for transfers to land and then runs their callbacks, in order."""

    def __init__(self, on_death: Callable[[BaseException], None]):
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._busy = 0
        self._on_death = on_death
        self.thread = threading.Thread(target=self._run, name="kvtier-cache-completer",
                                       daemon=True)
        self.thread.start()

    def submit(self, handle: TransferHandle, callback: Callable[[BaseException | None], None]
               ) -> None:
        if not self.thread.is_alive():        # dead (and reported): finish inline
            self._finish(handle, callback)
            return
        with self._cv:
            self._q.append((handle, callback))
            self._cv.notify()

    @staticmethod
    def _finish(handle: TransferHandle, callback: Callable) -> None:
        err: BaseException | None = None
        try:
            host_wait(handle)
        except Exception as exc:
            err = exc
        callback(err)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._q and not self._stop:
                        self._cv.wait()
                    if not self._q:
                        return
                    item = self._q.popleft()
                    self._busy += 1
                try:
                    self._finish(*item)
                finally:
                    with self._cv:
                        self._busy -= 1
                        self._cv.notify_all()
        except BaseException as exc:
            self._on_death(exc)
            with self._cv:                     # finish what is queued, then exit
                items = list(self._q)
                self._q.clear()
            for item in items:
                try:
                    self._finish(*item)
                except BaseException:  # pragma: no cover - already reported as dead
                    pass

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: (not self._q and not self._busy)
                                     or not self.thread.is_alive(), timeout)

    def depth(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.thread.join(timeout)
