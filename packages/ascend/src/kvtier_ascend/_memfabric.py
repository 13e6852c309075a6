"""The process's Memfabric offload session (memfabric-hybrid 1.3.0, ``memfabric_hybrid.offload``).

The offload entity is process-global: ``offload.initialize(OffloadConfig)`` reserves one pool of
host DRAM mapped into the NPU's address space (LOCAL scene: ``reserve_size == alloc_size``, the
C++ side works in whole GiB), then ``malloc``/``free`` carve blocks out of it and ``get_dva``
gives the device virtual address an NPU kernel must use. Errors are return codes plus log
lines, never exceptions: ``initialize`` returns 0 or -1, ``malloc`` and ``get_dva`` return 0.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvtier.errors import AllocationError, KVTierError

from ._probe import capture_log, load_memfabric, load_offload, quote_errors

GIB = 1 << 30
#: Reservation a probe's trial session makes (the C++ side rounds up to whole GiB anyway).
PROBE_RESERVE = GIB


class OffloadInitError(KVTierError, RuntimeError):
    """``offload.initialize`` returned non-zero; the message quotes memfabric's log, ``code``
    is its return code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def round_up_gib(nbytes: int) -> int:
    return -(-nbytes // GIB) * GIB


def initialize(mf: Any, offload: Any, device_id: int, reserve: int, flags: int) -> None:
    """``offload.initialize`` in the LOCAL scene; raises OffloadInitError quoting memfabric."""
    cfg = offload.OffloadConfig()
    cfg.device_id = device_id
    cfg.reserve_size = reserve
    cfg.alloc_size = reserve
    cfg.scene = offload.Scene.LOCAL
    cfg.flags = flags
    with capture_log(mf) as lines:
        rc = offload.initialize(cfg)
    if rc != 0:
        raise OffloadInitError(f"memfabric offload.initialize(device_id={device_id}, "
                               f"reserve_size={reserve}) returned {rc}: "
                               f"{quote_errors(lines, mf)}", rc)


@dataclass
class OffloadSession:
    """One initialised offload entity and the blocks carved out of it."""

    mf: Any
    offload: Any
    device_id: int
    capacity: int
    flags: int
    allocated: int = 0
    blocks: dict[int, int] = field(default_factory=dict)     # ptr -> nbytes
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def malloc(self, nbytes: int, backend: str) -> tuple[int, int]:
        """A block of ``nbytes`` and its DVA; AllocationError (with memfabric's code and log)
        when the pool is full or memfabric refuses."""
        with self.lock:
            if self.allocated + nbytes > self.capacity:
                raise AllocationError(
                    f"{backend}: {nbytes} bytes do not fit: {self.allocated} of the "
                    f"{self.capacity}-byte memfabric reservation are in use (raise "
                    "capacity_bytes; the first allocator of the process sizes it)",
                    backend=backend, nbytes=nbytes)
            with capture_log(self.mf) as lines:
                ptr = int(self.offload.malloc(nbytes, 0))
            if ptr == 0:
                raise AllocationError(f"{backend}: memfabric offload.malloc({nbytes}) returned 0: "
                                      f"{quote_errors(lines, self.mf)}", backend=backend,
                                      nbytes=nbytes, code=0)
            with capture_log(self.mf) as lines:
                dva = int(self.offload.get_dva(ptr))
            if dva == 0:
                self.offload.free(ptr, 0)
                raise AllocationError(f"{backend}: memfabric offload.get_dva({ptr:#x}) returned "
                                      f"0: {quote_errors(lines, self.mf)}", backend=backend,
                                      nbytes=nbytes, code=0)
            self.blocks[ptr] = nbytes
            self.allocated += nbytes
            return ptr, dva

    def free(self, ptr: int) -> None:
        with self.lock:
            nbytes = self.blocks.pop(ptr, None)
            if nbytes is None:
                return
            self.allocated -= nbytes
            self.offload.free(ptr, 0)


_lock = threading.RLock()
_session: OffloadSession | None = None


def _current(offload: Any) -> OffloadSession | None:
    """The open session, if it belongs to this ``offload`` module object."""
    if _session is not None and _session.offload is offload:
        return _session
    return None


def open_session(device_id: int, capacity: int, flags: int, backend: str) -> OffloadSession:
    """The process's session, initialising it on first use with ``capacity`` (rounded up to
    whole GiB). Later callers share it; asking for another device is an error."""
    global _session
    try:
        mf = load_memfabric()
        offload = load_offload()
    except (ImportError, OSError, RuntimeError) as exc:
        raise AllocationError(f"{backend}: memfabric_hybrid is unusable: {exc}",
                              backend=backend) from exc
    with _lock:
        s = _current(offload)
        if s is not None:
            if s.device_id != device_id:
                raise AllocationError(f"{backend}: memfabric offload is already initialised for "
                                      f"NPU {s.device_id} in this process; asked for NPU "
                                      f"{device_id}", backend=backend)
            return s
        reserve = round_up_gib(capacity)
        try:
            initialize(mf, offload, device_id, reserve, flags)
        except OffloadInitError as exc:
            raise AllocationError(f"{backend}: {exc}", backend=backend, nbytes=reserve,
                                  code=exc.code) from exc
        _session = OffloadSession(mf, offload, device_id, reserve, flags)
        return _session


def session_for(offload: Any) -> OffloadSession | None:
    with _lock:
        return _current(offload)


@contextlib.contextmanager
def probe_session(mf: Any, offload: Any, device_id: int = 0) -> Iterator[OffloadSession]:
    """The open session if there is one, else a trial session torn down after the block."""
    with _lock:
        s = _current(offload)
        if s is not None:
            yield s
            return
        initialize(mf, offload, device_id, PROBE_RESERVE, 0)
        try:
            yield OffloadSession(mf, offload, device_id, PROBE_RESERVE, 0)
        finally:
            offload.uninitialize()


def shutdown() -> None:
    """Uninitialise the process's offload entity; every buffer must be closed first."""
    global _session
    with _lock:
        s = _session
        if s is None:
            return
        if s.blocks:
            raise AllocationError(f"memfabric: {len(s.blocks)} buffer(s) still allocated "
                                  f"({s.allocated} bytes); close them before shutdown()",
                                  backend="memfabric", nbytes=s.allocated)
        _session = None
        s.offload.uninitialize()
