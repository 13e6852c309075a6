"""FAKE ``torch_npu`` for CPU tests of kvtier-ascend's adapter logic. Not torch_npu.

Follows the stream/event API of torch_npu 2.x (``torch_npu/npu/streams.py``, ``utils.py``):
``torch_npu.npu.Stream(device=None, priority=0)`` with ``wait_event``, ``wait_stream``,
``record_event``, ``query``, ``synchronize`` and ``.device``; ``Event(enable_timing=False,
blocking=False, interprocess=False)`` with ``record(stream=None)``, ``wait(stream=None)``,
``query``, ``synchronize``; ``current_stream(device=None)``, ``default_stream``, the
``stream(s)`` context manager, ``set_stream``, ``device_count``, ``is_available``,
``current_device``, ``set_device``, ``synchronize``. Importing torch_npu makes
``Tensor.pin_memory()`` work; the installing fixture patches it for the test's duration.

The fake NPU's memory is host memory: its streams report ``torch.device("cpu", i)``. Work put on
a stream (the fake ``kv_exchange_copy`` kernel queues itself there) runs in stream order when the
stream drains: at once in mode ``"eager"``; in mode ``"deferred"`` only when the host waits
(``Event.synchronize``, ``Stream.synchronize``, ``synchronize``). ``Stream.wait_event`` queues a
dependency: when the waiting stream drains to it, the other stream first runs up to the event.
That lets tests see that nothing ran at launch (no hidden synchronisation), that a transfer is
ordered after the caller's earlier work, and that waiting for layer ``i`` lands layer ``i`` and
not the ones after it.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable

import torch


class _Marker:
    """Where an event was recorded in a stream's queue."""

    __slots__ = ("event",)

    def __init__(self, event: "Event"):
        self.event = event


class _WaitFor(_Marker):
    """A stream waits here until another stream reached ``event``."""


class FakeTorchNpu:
    """State of the fake runtime plus the ``torch_npu`` module object built over it."""

    def __init__(self, device_count: int = 1, mode: str = "eager"):
        self.device_count = device_count
        self.mode = mode
        self.launches = 0                    # work items ever queued (kernels)
        self.pinned = 0                      # pin_memory() calls
        self._tls = threading.local()
        self._current_device = 0
        self._lock = threading.RLock()
        self._default: dict[int, Stream] = {}
        self.streams: list[Stream] = []
        self.module = self._build_module()

    # ----- runtime --------------------------------------------------------------------------
    def _index(self, device: Any) -> int:
        if device is None:
            return self._current_device
        if isinstance(device, torch.device):
            return device.index if device.index is not None else self._current_device
        if isinstance(device, int):
            return self._current_device if device < 0 else device
        return self._index(torch.device(device))

    def default_stream(self, device: Any = None) -> "Stream":
        idx = self._index(device)
        if idx >= self.device_count:
            raise RuntimeError(f"fake NPU: invalid device ordinal {idx}")
        with self._lock:
            if idx not in self._default:
                self._default[idx] = Stream(self, idx)
            return self._default[idx]

    def current_stream(self, device: Any = None) -> "Stream":
        idx = self._index(device)
        cur = getattr(self._tls, "current", {})
        return cur.get(idx) or self.default_stream(idx)

    def set_stream(self, stream: "Stream") -> None:
        cur = getattr(self._tls, "current", None)
        if cur is None:
            cur = self._tls.current = {}
        cur[stream.device_index] = stream

    @contextlib.contextmanager
    def stream(self, stream: "Stream | None"):
        if stream is None:
            yield
            return
        prev = self.current_stream(stream.device_index)
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(prev)

    def enqueue(self, stream: "Stream", fn: Callable[[], None]) -> None:
        """Queue device work on ``stream`` (what a kernel launch does)."""
        self.launches += 1
        stream._ops.append(fn)
        if self.mode == "eager":
            stream._drain(raise_error=False)

    def synchronize(self, device: Any = None) -> None:
        idx = self._index(device)
        for s in list(self.streams):
            if s.device_index == idx:
                s._drain()

    def pending(self) -> int:
        """Queued work items (kernels) not yet run, over every stream."""
        return sum(1 for s in self.streams for op in s._ops if not isinstance(op, _Marker))

    # ----- module ---------------------------------------------------------------------------
    def _build_module(self) -> types.ModuleType:
        rt = self
        npu = types.ModuleType("torch_npu.npu")
        npu.__doc__ = "FAKE torch_npu.npu (kvtier-ascend tests)"

        def make_stream(device=None, priority=0, **kwargs):
            return Stream(rt, rt._index(device), priority)

        npu.Stream = make_stream
        npu.Event = lambda enable_timing=False, blocking=False, interprocess=False: Event(rt)
        npu.current_stream = rt.current_stream
        npu.default_stream = rt.default_stream
        npu.set_stream = rt.set_stream
        npu.stream = rt.stream
        npu.device_count = lambda: rt.device_count
        npu.is_available = lambda: rt.device_count > 0
        npu.current_device = lambda: rt._current_device
        npu.set_device = lambda d: setattr(rt, "_current_device", rt._index(d))
        npu.synchronize = rt.synchronize
        mod = types.ModuleType("torch_npu")
        mod.__doc__ = "FAKE torch_npu (kvtier-ascend tests)"
        mod.__version__ = "0.0.0+fake"
        mod.npu = npu
        mod.__kvtier_fake__ = rt
        return mod

    def fake_pin_memory(self):
        """What ``Tensor.pin_memory`` does once torch_npu is imported (a pinned copy)."""
        rt = self

        def pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
            rt.pinned += 1
            return tensor.clone()

        return pin_memory


class Stream:
    def __init__(self, rt: FakeTorchNpu, index: int, priority: int = 0):
        if index >= rt.device_count:
            raise RuntimeError(f"fake NPU: invalid device ordinal {index}")
        self._rt = rt
        self.device_index = index
        self.priority = priority
        self._ops: list[Any] = []
        self._error: BaseException | None = None
        rt.streams.append(self)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu", self.device_index)

    def _drain(self, upto: "_Marker | None" = None, raise_error: bool = True) -> None:
        """Run queued work in order, up to and including ``upto`` (everything when None).

        A fault in the work is kept and raised at the next synchronisation point, like an
        asynchronous NPU error."""
        while self._ops:
            op = self._ops.pop(0)
            if isinstance(op, _WaitFor):
                ev = op.event
                if not ev._done and ev._stream is not None:
                    try:
                        ev._stream._drain(ev._marker)
                    except Exception as exc:   # noqa: BLE001 - surfaced at the next sync
                        self._error = self._error or exc
            elif isinstance(op, _Marker):
                op.event._done = True
                if op is upto:
                    break
            else:
                try:
                    op()
                except Exception as exc:   # noqa: BLE001 - surfaced at the next sync
                    self._error = self._error or exc
        if raise_error:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event(self._rt)
        event.record(self)
        return event

    def query(self) -> bool:
        return not any(not isinstance(op, _Marker) for op in self._ops)

    def synchronize(self) -> None:
        self._drain()

    def __repr__(self) -> str:
        return f"<FAKE torch_npu.npu.Stream device={self.device} id={id(self):#x}>"


class Event:
    def __init__(self, rt: FakeTorchNpu):
        self._rt = rt
        self._done = True                # an unrecorded event counts as complete
        self._marker: _Marker | None = None
        self._stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self._rt.current_stream()
        self._done = False
        self._stream = stream
        self._marker = _Marker(self)
        stream._ops.append(self._marker)
        if self._rt.mode == "eager":
            stream._drain(self._marker, raise_error=False)

    def wait(self, stream: Stream | None = None) -> None:
        """Future work on ``stream`` waits for this event (nothing runs now)."""
        stream = stream or self._rt.current_stream()
        if self._done or self._stream is None:
            return
        stream._ops.append(_WaitFor(self))
        if self._rt.mode == "eager":
            stream._drain(raise_error=False)

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        if self._stream is None:
            return
        if self._done:
            self._stream._raise_error()
        else:
            self._stream._drain(self._marker)

    def elapsed_time(self, end_event: "Event") -> float:
        return 0.0
