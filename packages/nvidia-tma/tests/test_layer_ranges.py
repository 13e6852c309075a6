"""Loads of a range of layers (``load(..., layers=(lo, hi))``) through the NVIDIA engines'
shared launch path, the copy engine's issue thread and the router, on the CPU: the launches
are recorded instead of run and CUDA's streams and events are stand-ins, so what is checked
here is which launches a ranged load makes, the handle it returns and the refusal of bad
ranges before anything is queued. test_gpu.py moves the bytes on a GPU; the kernels' and copy
lists' own handling of a launch's first layer is replayed on CPU buffers in test_plan.py and
test_routing.py. Also here: the per-layer signal handle orders a waiting stream after the
zeroing of its counters."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from kvtier import KVSpec
from kvtier.errors import InvalidArgumentError, LayoutError
from kvtier.transfer_engines import CompletedRangeHandle
from kvtier.transfer_engines.torch_engine import LayerwiseHandle

from kvtier_nvidia_tma.copy_engine import CopyEngineTransferEngine
from kvtier_nvidia_tma.register import RegisterTransferEngine
from kvtier_nvidia_tma.routed import RoutedHandle, RoutedTransferEngine
from kvtier_nvidia_tma.tma import TmaTransferEngine
from kvtier_nvidia_tma.transfer_engine import CudaEventHandle, LayerSignalHandle

SPEC = KVSpec.mla(num_layers=7, kv_lora_rank=56, rope_dim=8, page_size=2)
L = SPEC.num_layers

BAD = [(0, 0), (3, 3), (4, 2), (-1, 3), (0, L + 1), (L, L + 1), (True, 2), (0, True), (1.0, 2),
       (0, "3"), (0,), (0, 1, 2), 3, "0:3", torch.tensor([0, 3])]


class _Event:
    count = 0

    def __init__(self, *args, **kwargs):
        _Event.count += 1
        self.name = f"ev{_Event.count}"
        self.stream = None
        self.synced = False

    def record(self, stream=None):
        self.stream = stream

    def query(self):
        return True

    def synchronize(self):
        self.synced = True


class _Stream:
    def __init__(self, *args, **kwargs):
        self.cuda_stream = id(self)
        self.waits: list = []

    def wait_event(self, ev):
        self.waits.append(ev)

    def wait_stream(self, other):
        pass

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.cuda_stream == self.cuda_stream

    def __ne__(self, other):                 # as torch's streams: never != a non-stream (None)
        return isinstance(other, _Stream) and other.cuda_stream != self.cuda_stream

    __hash__ = object.__hash__


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda's calls the engines and handles make, as stand-ins: one caller's stream."""
    caller = _Stream()
    for name, value in (("current_stream", lambda device=None: caller), ("Event", _Event),
                        ("Stream", _Stream), ("set_device", lambda device: None),
                        ("device", lambda device: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    return caller


def _engine(cls, launches, **config):
    """An engine of ``cls`` without a GPU: its launches (first layer, layers) recorded, the
    all-layer fast paths (one signalled launch, one batch of per-layer copies) recorded as
    such, index checks (done on the host for lists) as lists to tensors."""
    eng = object.__new__(cls)
    eng.spec = SPEC
    eng.config = cls.Config(**config)
    eng._torch = torch
    eng.device = "cuda:0"
    eng._side = None
    eng._dev = SimpleNamespace(make_current=lambda: None)
    eng._signals = cls is TmaTransferEngine
    eng._closed = False
    eng._own = None
    eng._issuers, eng._issuers_lock = {}, threading.Lock()
    eng._indices = lambda h, d, dst_device: (launches.append("indices") or
                                             (torch.tensor(h, dtype=torch.int64),
                                              torch.tensor(d, dtype=torch.int64)))
    eng._launch = lambda h, d, d2h, layer0, layers, stream: launches.append((layer0, layers))

    def signalled(h, d, d2h, stream):
        launches.append("signalled")
        return CudaEventHandle([_Event()] * L, eng.device)

    def per_layer(h, d, d2h, stream, land=None):
        launches.append("per-layer batch")
        events = [_Event() for _ in range(L)]
        for layer, ev in enumerate(events):
            if land is not None:
                land(layer, 1, ev)
        return events
    eng._launch_signalled = signalled
    eng._launch_per_layer = per_layer if cls is CopyEngineTransferEngine else lambda *a: None
    return eng


ENGINES = [TmaTransferEngine, RegisterTransferEngine, CopyEngineTransferEngine]


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.name)
@pytest.mark.parametrize("layerwise", [True, False], ids=["per-layer", "all-layer"])
def test_a_ranged_load_launches_over_its_layers_only(cuda, cls, layerwise):
    """Layers 2..4 of 7: a launch per layer of the range (one for the range without
    layerwise_load), never the all-layer fast paths; the handle has an event per layer of the
    range, waits on layer i's, refuses the others with LayoutError, and ends with the last."""
    launches: list = []
    eng = _engine(cls, launches, layerwise_load=layerwise)
    assert cls.capabilities().layer_ranges
    h = eng.load([5, 1, 3], [0, 6, 2], layers=(2, 5))
    assert launches == ["indices"] + ([(2, 1), (3, 1), (4, 1)] if layerwise else [(2, 3)])
    assert isinstance(h, CudaEventHandle) and h.layers == (2, 5) and h.num_layers == L
    events = h._events
    assert len(events) == 3 and len(set(events)) == (3 if layerwise else 1)
    for layer in (4, 2, 3):
        h.wait_layer(layer)
        assert cuda.waits[-1] is events[layer - 2]
    for bad in (0, 1, 5, 6, -1, True, 2.0):
        with pytest.raises(LayoutError):
            h.wait_layer(bad)
    h.wait()
    assert cuda.waits[-1] is events[-1]
    assert h.done()
    h.synchronize()
    assert events[-1].synced


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.name)
@pytest.mark.parametrize("layers", [None, (0, L)], ids=["none", "every-layer"])
def test_every_layer_keeps_the_tuned_paths(cuda, cls, layers):
    """layers=None, or a range of every layer, is the load it always was: one signalled
    launch (nvidia-tma), one batch of per-layer copies (the copy engine), a launch per layer
    (nvidia-register); all-layer loads one launch."""
    for layerwise, want in ((True, {TmaTransferEngine: ["signalled"],
                                    CopyEngineTransferEngine: ["per-layer batch"],
                                    RegisterTransferEngine: [(i, 1) for i in range(L)]}[cls]),
                            (False, [(0, L)])):
        launches: list = []
        h = _engine(cls, launches, layerwise_load=layerwise).load([1, 2], [3, 4], layers=layers)
        assert launches == ["indices"] + want
        h.wait_layer(0)
        h.wait_layer(L - 1)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.name)
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_ranges_are_refused_before_anything(cuda, cls, bad):
    launches: list = []
    eng = _engine(cls, launches)
    with pytest.raises(InvalidArgumentError, match="layers"):
        eng.load([1, 2], [3, 4], layers=bad)
    assert launches == []                      # not even the indices went to the device


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.name)
def test_an_empty_ranged_load_answers_for_its_range(cuda, cls):
    launches: list = []
    h = _engine(cls, launches).load([], [], layers=(3, 6))
    assert isinstance(h, CompletedRangeHandle) and launches == ["indices"]
    for layer in (3, 5):
        h.wait_layer(layer)
    for bad in (2, 6):
        with pytest.raises(LayoutError):
            h.wait_layer(bad)
    assert h.done()


@pytest.mark.parametrize("layerwise", [True, False], ids=["per-layer", "all-layer"])
def test_copy_engine_issue_thread_queues_a_ranged_load(cuda, layerwise):
    """With issue_thread the range goes to the issuing thread with the job: its launches
    cover the range, and the handle lands and answers for those layers only."""
    launches: list = []
    eng = _engine(CopyEngineTransferEngine, launches, layerwise_load=layerwise,
                  issue_thread=True)
    try:
        h = eng.load([5, 1, 3], [0, 6, 2], layers=(1, 4))
        assert isinstance(h, LayerwiseHandle) and h.layers == (1, 4)
        h.wait()
        assert launches == ["indices"] + ([(1, 1), (2, 1), (3, 1)] if layerwise else [(1, 3)])
        assert h.done()
        with pytest.raises(LayoutError):
            h.wait_layer(4)
        empty = eng.load([], [], layers=(1, 4))
        with pytest.raises(LayoutError):
            empty.wait_layer(0)
    finally:
        eng.close()


class _Path:
    def __init__(self, name):
        self.name, self.calls = name, []

    def load(self, host_pages, device_pages, layers=None):
        self.calls.append((list(host_pages), list(device_pages), layers))
        h = CudaEventHandle([_Event() for _ in range(*(layers or (0, L)))], "cuda:0",
                            layers=layers, num_layers=L)
        return h


@pytest.mark.parametrize("path", ["copy_engine", "sm"])
def test_router_forwards_a_range_and_counts_its_bytes(cuda, path):
    """The router says layer_ranges (both of its paths do), gives ``layers`` to the route's
    engine, counts the range's bytes, and refuses a bad range before either path sees it."""
    assert RoutedTransferEngine.capabilities().layer_ranges
    eng = object.__new__(RoutedTransferEngine)
    eng.spec, eng.config = SPEC, RoutedTransferEngine.Config(crossover_bytes=1)
    eng.copy, eng.sm = _Path("copy"), _Path("sm")
    eng.route = {"h2d": path, "d2h": path}
    eng._verify = set()
    eng._timed, eng._last = {"h2d": [], "d2h": []}, {"h2d": None, "d2h": None}
    eng._bytes, eng._transfers = {"copy_engine": 0, "sm": 0}, {"copy_engine": 0, "sm": 0}
    target = eng.copy if path == "copy_engine" else eng.sm
    h = eng.load([4, 2, 9], [1, 0, 5], layers=(2, 5))
    assert target.calls == [([4, 2, 9], [1, 0, 5], (2, 5))]
    assert isinstance(h, RoutedHandle) and h.layers == (2, 5) and h.num_layers == L
    h.wait_layer(4)
    with pytest.raises(LayoutError):
        h.wait_layer(5)
    assert eng._bytes[path] == 3 * SPEC.page_bytes // L * 3
    eng.load([4], [1])
    assert target.calls[-1][2] is None and eng._bytes[path] == 3 * SPEC.page_bytes // L * 3 \
        + SPEC.page_bytes
    for bad in BAD:
        with pytest.raises(InvalidArgumentError):
            eng.load([4], [1], layers=bad)
    assert len(target.calls) == 2 and eng._transfers[path] == 2


def test_signal_waits_follow_the_counters_zeroing(cuda, monkeypatch):
    """wait_layer first makes the stream wait for the event after the counters' zeroing (once
    per stream), then for the count: a stream that read the counters before they were zeroed
    could see an earlier load's count and go ahead of the copies."""
    from kvtier_nvidia_tma import _driver
    log: list = []
    monkeypatch.setattr(_driver, "stream_wait_geq",
                        lambda stream, ptr, value: log.append(("count", stream, value)))
    cuda.wait_event = lambda ev: log.append(("event", cuda.cuda_stream, ev.name))
    flags = SimpleNamespace(record_stream=lambda s: None, data_ptr=lambda: 4096)
    zeroed, done = _Event(), _Event()
    h = LayerSignalHandle(flags, [5, 6, 7], 3, L, done, SimpleNamespace(make_current=lambda: None),
                          "cuda:0", zeroed=zeroed)
    h.wait_layer(4)
    h.wait_layer(0)
    s = cuda.cuda_stream
    assert log == [("event", s, zeroed.name), ("count", s, 6), ("count", s, 5)]
    with pytest.raises(LayoutError):
        h.wait_layer(L)
