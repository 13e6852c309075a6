"""The `torch` transfer engine beyond the contract: job ordering, layer-wise waits, failures
surfacing through the handle, bad pools and closed engines."""

from __future__ import annotations

import contextlib
import random
import zlib

import pytest
import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError, InvalidArgumentError, LayoutError, PageIndexError, \
    TransferError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.spec import KVSpec
from kvtier.testing import fill_random, make_device_pool, make_host_pool
from kvtier.testing.contracts import (DEVICE_LAYOUTS, DeviceLayoutContract,
                                      assert_bitwise_equal, layout_specs, make_layout_pool)
from kvtier.transfer_engines.torch_engine import TorchTransferEngine

MHA = KVSpec.mha(num_layers=4, num_kv_heads=3, head_dim=20, page_size=7, dtype="bfloat16")
MLA = KVSpec.mla(num_layers=3, kv_lora_rank=36, rope_dim=12, page_size=3, dtype="float16")


@pytest.fixture(params=[MHA, MLA], ids=["mha", "mla"])
def spec(request):
    return request.param


@pytest.fixture(params=["page_first", "layer_first"])
def engine(request, spec):
    dpool = make_device_pool(spec, 13)
    hpool = make_host_pool(spec, 17, request.param)
    eng = TorchTransferEngine(dpool, hpool)
    yield eng
    eng.close()
    hpool.close()


def _device_page(dpool: DeviceKVPool, p: int) -> list[torch.Tensor]:
    return [dpool.page(c, layer, p).clone() for c in range(dpool.spec.num_components)
            for layer in range(dpool.spec.num_layers)]


def test_jobs_run_in_submission_order(engine):
    """backup then load of the same host pages, without waiting in between, moves the
    backed-up bytes (FIFO), and a later backup sees the earlier load."""
    dp, hp = engine.device_pool, engine.host_pool
    rng = random.Random(2)
    src = rng.sample(range(dp.num_pages), 5)
    host = rng.sample(range(hp.num_pages), 5)
    dst = rng.sample([p for p in range(dp.num_pages) if p not in src], 5)
    want = [_device_page(dp, p) for p in src]
    h1 = engine.backup(src, host)
    h2 = engine.load(host, dst)
    h2.wait()
    assert h1.done() and h2.done()
    for i, p in enumerate(dst):
        for a, b in zip(_device_page(dp, p), want[i]):
            assert_bitwise_equal(a, b, f"device page {p}")


def test_out_of_order_and_repeated_pages(engine, spec):
    dp, hp = engine.device_pool, engine.host_pool
    fill_random(hp.raw)
    host = [16, 0, 9, 3, 3]           # a host page loaded twice into two device pages
    dev = [12, 1, 7, 0, 5]
    engine.load(torch.tensor(host), dev).wait()
    for h, d in zip(host, dev):
        for c in range(spec.num_components):
            for layer in range(spec.num_layers):
                assert_bitwise_equal(dp.page(c, layer, d), hp.view[h, layer, c],
                                     f"host {h} -> device {d}")


def test_wait_layers_in_any_order(engine, spec):
    h = engine.load(list(range(5)), list(range(5)))
    for layer in reversed(range(spec.num_layers)):
        h.wait_layer(layer)
    assert h.done()
    for bad in (-1, spec.num_layers, 1.0, True, "0"):
        with pytest.raises(LayoutError):
            h.wait_layer(bad)                           # type: ignore[arg-type]


def test_a_groups_shared_event_is_waited_once_per_stream():
    """Layers of one group share an event: the caller's stream waits on it once, and again
    only from another stream (or for another event)."""
    from kvtier.transfer_engines.torch_engine import LayerwiseHandle

    class Stream:
        def __init__(self, name):
            self.name, self.waits = name, []

        def wait_event(self, ev):
            self.waits.append(ev)

    class Module:                          # the calls LayerwiseHandle makes of torch.cuda
        current = Stream("a")

        def current_stream(self):
            return self.current

    dm = Module()
    h = LayerwiseHandle(5, "torch", dm)
    h._land(0, 3, "g0")
    h._land(3, 2, "g1")
    h.wait()
    h.wait_layer(4)
    assert dm.current.waits == ["g0", "g1"]
    dm.current = Stream("b")
    h.wait_layer(2)
    h.wait_layer(1)
    assert dm.current.waits == ["g0"]


def test_failures_surface_through_the_handle(engine, monkeypatch):
    def boom(*args):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(engine, "_load_group", boom)
    h = engine.load([0], [0])
    with pytest.raises(TransferError, match="on fire"):
        h.wait()
    with pytest.raises(TransferError):
        h.wait_layer(0)
    monkeypatch.undo()
    engine.load([1], [1]).wait()          # the worker survived the failure


def test_closed_engine_refuses_work(spec):
    dp, hp = make_device_pool(spec, 3), make_host_pool(spec, 3)
    eng = TorchTransferEngine(dp, hp)
    eng.close()
    eng.close()
    with pytest.raises(TransferError):
        eng.load([0], [0])
    hp.close()


def test_bad_pools(spec):
    other = KVSpec.mha(num_layers=4, num_kv_heads=3, head_dim=20, page_size=7,
                       dtype="float16")
    with HostKVPool(other, 3, allocator=TorchPinnedAllocator()) as hp, pytest.raises(ConfigError):
        TorchTransferEngine(make_device_pool(spec, 3), hp)
    # device buffers of the wrong dtype, shape or slot count never make a pool
    good = make_device_pool(spec, 3)
    k = good.layers[0]
    bad_dtype = [t.to(torch.float32) for t in k]
    bad_shape = [t[:, :, :-1] for t in k]
    short = [t[: spec.page_size] for t in k[:-1]] + [k[-1]]
    v = good.layers[1] if spec.num_components == 2 else None
    for layers in (bad_dtype, bad_shape, short, k[:-1]):
        with pytest.raises(LayoutError):
            DeviceKVPool(spec, layers, v)


def test_bad_indices_touch_nothing(engine):
    dp, hp = engine.device_pool, engine.host_pool
    before = hp.raw.clone()
    for call in (lambda: engine.backup([0, dp.num_pages], [0, 1]),
                 lambda: engine.backup([0, 1], [0, -1]),
                 lambda: engine.backup([[0]], [0]),
                 lambda: engine.backup(torch.tensor([0.0]), [0])):
        with pytest.raises(PageIndexError):
            call()
    with pytest.raises(InvalidArgumentError):
        engine.backup([0, 1, 2], [0, 1])
    assert torch.equal(hp.raw, before)


@pytest.mark.parametrize("group", [1, 2])
def test_layer_i_waits_only_for_its_group(spec, group, monkeypatch):
    """The layers of the first group can be waited on while the later groups are still held
    back; with groups of one layer, layer 0 alone."""
    import threading
    dpool, hpool = make_device_pool(spec, 13), make_host_pool(spec, 17)
    engine = TorchTransferEngine(dpool, hpool, {"group_layers": group, "worker_thread": "always"})
    gate = threading.Event()
    real = engine._load_group
    firsts = []

    def held(a, g, *args):
        firsts.append((a, g))
        if a > 0:
            gate.wait(30)
        real(a, g, *args)

    try:
        assert engine.max_group == group
        monkeypatch.setattr(engine, "_load_group", held)
        fill_random(hpool.raw)
        h = engine.load([4], [2])
        h.wait_layer(group - 1)            # returns although the next group has not moved
        assert not h.done()
        for layer in range(group):
            for c in range(spec.num_components):
                assert_bitwise_equal(dpool.page(c, layer, 2), hpool.view[4, layer, c])
        gate.set()
        h.wait()
        assert h.done()
        assert firsts == [(a, min(group, spec.num_layers - a))
                          for a in range(0, spec.num_layers, group)]
    finally:
        gate.set()
        engine.close()
        hpool.close()
    caps = TorchTransferEngine.capabilities()
    assert not caps.host_indices and caps.row_alignment == 1


def test_cpu_copies_run_on_the_callers_thread(spec):
    """On the CPU the default engine copies on the caller's thread (no second thread copying
    beside the engine's compute): the handle is finished on return and the bytes are there;
    ``worker_thread="always"`` keeps the worker thread; anything else is a ConfigError."""
    import threading
    dpool, hpool = make_device_pool(spec, 13), make_host_pool(spec, 17)
    seen = []
    engine = TorchTransferEngine(dpool, hpool)
    real = engine._load_group
    engine._load_group = lambda *a: (seen.append(threading.current_thread()), real(*a))[1]
    try:
        assert engine.on_caller and engine._worker is None
        fill_random(hpool.raw)
        for layer in dpool.chunks:
            for chunk in layer:
                fill_random(chunk)
        src = [11, 3, 16, 0]
        dst = [7, 12, 1, 5]
        h = engine.load(src, dst)
        assert h.done() and seen and set(seen) == {threading.current_thread()}
        for s_, d_ in zip(src, dst):
            for layer in range(spec.num_layers):
                for c in range(spec.num_components):
                    assert_bitwise_equal(dpool.page(c, layer, d_), hpool.view[s_, layer, c])
        before = hpool.raw.clone()
        h = engine.backup([2, 9], [4, 13])
        assert h.done()
        assert not torch.equal(hpool.raw, before)
        for d_, s_ in zip([2, 9], [4, 13]):
            for layer in range(spec.num_layers):
                for c in range(spec.num_components):
                    assert_bitwise_equal(hpool.view[s_, layer, c], dpool.page(c, layer, d_))
    finally:
        engine.close()
    threaded = TorchTransferEngine(dpool, hpool, {"worker_thread": "always"})
    try:
        assert not threaded.on_caller and threaded._worker.is_alive()
    finally:
        threaded.close()
    with pytest.raises(ConfigError, match="worker_thread"):
        TorchTransferEngine(dpool, hpool, {"worker_thread": "never"})
    hpool.close()


def test_a_failing_copy_on_the_callers_thread_fails_its_handle(spec):
    dpool, hpool = make_device_pool(spec, 5), make_host_pool(spec, 5)
    engine = TorchTransferEngine(dpool, hpool)

    def broken(*a):
        raise RuntimeError("copy failed")

    engine._backup_group = broken
    try:
        h = engine.backup([1], [2])          # no exception here: the handle carries it
        with pytest.raises(Exception, match="copy failed"):
            h.wait()
    finally:
        engine.close()
        hpool.close()


# ----- byte chunks: every device layout, fp8, the staged path ---------------------------------
class TestTorchDeviceLayouts(DeviceLayoutContract):
    """The layout round trips for the torch engine, which must move every layout."""

    distribution = "kvtier-core"
    refusals_allowed = False


class _FakeStream:
    def wait_event(self, ev):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _FakeDeviceModule:
    """Streams and events for the CPU, so the staged path (gather, copy, scatter through two
    staging buffers in batches) runs in CI; CPU work is synchronous, so they order nothing."""

    Stream = staticmethod(lambda device=None: _FakeStream())
    Event = _FakeEvent

    @staticmethod
    def current_stream(device=None):
        return _FakeStream()

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        yield

    @staticmethod
    @contextlib.contextmanager
    def device(d):
        yield


class StagedTorchEngine(TorchTransferEngine):
    def _device_module(self, device):
        return _FakeDeviceModule


class ZeroCopyTorchEngine(StagedTorchEngine):
    """The zero-copy path's index ops on the CPU: the host pool is its own device alias."""

    def _host_alias(self):
        return self.host_pool.raw


def _layout_case(layout, which, host_layout, staging, device="cpu", staged=True,
                 one_block=False, cls=None, **cfg):
    spec = layout_specs(layout)[which]
    dpool = make_layout_pool(spec, layout, 23, device, one_block)
    hpool = make_host_pool(spec, 31, host_layout)
    cls = cls or (StagedTorchEngine if staged else TorchTransferEngine)
    return spec, dpool, hpool, cls(dpool, hpool, {"staging_bytes": staging, **cfg})


def _host_page(hpool, p):
    return torch.cat(hpool.page_segments(p))


def _roundtrip(dpool, hpool, eng, seed, n):
    """Random (repeated on the host side) pages out and back in; every page checked as bytes,
    each layer checked as soon as wait_layer returns."""
    rng = random.Random(seed)
    src = rng.sample(range(dpool.num_pages), n)
    host = rng.sample(range(hpool.num_pages), n)
    want = [dpool.page_bytes(p).cpu() for p in src]
    eng.backup(torch.tensor(src), host).wait()
    if dpool.device.type == "cuda":          # wait() orders the caller's stream; read on host
        torch.cuda.current_stream().synchronize()
    for i, p in enumerate(host):
        assert torch.equal(_host_page(hpool, p), want[i]), f"backup page {src[i]} -> {p}"
    for layer in dpool.chunks:
        for chunk in layer:
            fill_random(chunk)
    dst = rng.sample(range(dpool.num_pages), n)
    h = eng.load(host, torch.tensor(dst, device=dpool.device))
    lb = dpool.spec.page_bytes // dpool.spec.num_layers
    for layer in rng.sample(range(dpool.spec.num_layers), dpool.spec.num_layers):
        h.wait_layer(layer)
        if dpool.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        for i, p in enumerate(dst):
            got = torch.cat([c[p] for c in dpool.chunks[layer]]).cpu()
            assert torch.equal(got, want[i][layer * lb:(layer + 1) * lb]), \
                f"load layer {layer} host {host[i]} -> device {p}"
    h.wait()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("staging", [1, 1 << 20], ids=["batched", "one-batch"])
@pytest.mark.parametrize("pool", ["scattered", "one-block", "groups-of-2"])
@pytest.mark.parametrize("cls", [StagedTorchEngine, ZeroCopyTorchEngine],
                         ids=["staged", "zero-copy"])
def test_staged_path_every_layout(layout, which, host_layout, staging, pool, cls):
    """Staging of 1 byte is rounded up to one page-layer: every page is its own batch and the
    two staging buffers are reused many times per layer. Pools of one allocation move groups
    of layers per op (all of them in one batch, or 2 at a time, the last group shorter where
    the layer count is odd); pools of layers allocated one by one, a layer per op."""
    spec, dpool, hpool, eng = _layout_case(
        layout, which, host_layout, staging, one_block=pool != "scattered", cls=cls,
        group_layers=2 if pool == "groups-of-2" else 0)
    try:
        assert eng.zero_copy == (cls is ZeroCopyTorchEngine)
        assert eng.max_group == {"scattered": 1, "one-block": spec.num_layers,
                                 "groups-of-2": 2}[pool]
        if staging == 1:
            assert eng.batch_pages == 1 and eng._group_size(1) == 1
        elif pool != "scattered":
            assert eng._group_size(17) == eng.max_group
        for seed in range(2):
            _roundtrip(dpool, hpool, eng, seed * 7 + which, random.Random(seed).randint(1, 17))
    finally:
        eng.close()
        hpool.close()


# ----- loads of a range of layers ----------------------------------------------------------
#: 13 layers: groups of 2 and 5 leave shorter last groups, ranges start and end mid-group.
RANGE_SPEC = KVSpec.mha(num_layers=13, num_kv_heads=3, head_dim=8, page_size=3, dtype="float16")


def _ranged_loads(dpool, hpool, eng, seed, rounds=5):
    """Loads of random ranges of layers (the first and last layer, all of them, random ones)
    between random pages, wait_layer in random order: every layer of the range lands bitwise,
    every other byte of the device pool stays; the ops cover the range in order, one group
    (at most ``max_group`` layers) each, from its first layer."""
    spec = dpool.spec
    L, lb = spec.num_layers, spec.page_bytes // spec.num_layers
    rng = random.Random(seed)
    groups = []
    real = eng._load_group
    eng._load_group = lambda a, g, *rest: (groups.append((a, g)), real(a, g, *rest))[1]
    cuda = dpool.device.type == "cuda"

    def rows(layer):
        if cuda:
            torch.cuda.synchronize()
        return torch.cat([c.cpu() for c in dpool.chunks[layer]], dim=1)
    ranges = [(0, 1), (L - 1, L), (0, L)]
    ranges += [(lo, rng.randint(lo + 1, L)) for lo in (rng.randrange(L) for _ in range(rounds))]
    for lo, hi in ranges:
        fill_random(hpool.raw)
        for layer in dpool.chunks:
            for chunk in layer:
                fill_random(chunk)
        before = [rows(layer) for layer in range(L)]
        n = rng.randint(1, min(dpool.num_pages, hpool.num_pages))
        host = rng.sample(range(hpool.num_pages), n)
        dev = rng.sample(range(dpool.num_pages), n)
        want = torch.stack([_host_page(hpool, p) for p in host])
        groups.clear()
        h = eng.load(host, torch.tensor(dev, device=dpool.device), layers=(lo, hi))
        for layer in rng.sample(range(lo, hi), hi - lo):
            h.wait_layer(layer)
            assert torch.equal(rows(layer)[dev], want[:, layer * lb:(layer + 1) * lb]), \
                f"layers [{lo}, {hi}): layer {layer}"
        for bad in {lo - 1, hi} - set(range(lo, hi)):
            with pytest.raises(LayoutError):
                h.wait_layer(bad)
        h.wait()
        assert h.done()
        for layer in range(L):
            expect = before[layer]
            if lo <= layer < hi:
                expect[dev] = want[:, layer * lb:(layer + 1) * lb]
            assert torch.equal(rows(layer), expect), f"layers [{lo}, {hi}): layer {layer}"
        assert [a for a, _ in groups] == [lo + sum(g for _, g in groups[:i])
                                          for i in range(len(groups))], groups
        assert sum(g for _, g in groups) == hi - lo, groups
        assert all(0 < g <= eng.max_group for _, g in groups), groups


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", ["vllm_flash", "flashinfer_hnd"])
@pytest.mark.parametrize("staging", [1, 1 << 20], ids=["batched", "one-batch"])
@pytest.mark.parametrize("pool, group", [("scattered", 0), ("one-block", 0), ("one-block", 2),
                                         ("one-block", 5)],
                         ids=["scattered", "one-block", "groups-of-2", "groups-of-5"])
@pytest.mark.parametrize("cls", [TorchTransferEngine, StagedTorchEngine, ZeroCopyTorchEngine],
                         ids=["cpu", "staged", "zero-copy"])
def test_layer_ranges_on_every_path(layout, host_layout, staging, pool, group, cls):
    """Ranged loads on the CPU path and on the staged and zero-copy paths (their index ops on
    the CPU), with the device pool's layers one allocation (groups of every layer, of 2 or 5)
    or allocated one by one (a layer per op)."""
    dpool = make_layout_pool(RANGE_SPEC, layout, 11, one_block=pool == "one-block")
    hpool = make_host_pool(RANGE_SPEC, 9, host_layout)
    eng = cls(dpool, hpool, {"staging_bytes": staging, "group_layers": group})
    try:
        assert TorchTransferEngine.capabilities().layer_ranges
        assert eng.max_group == (1 if pool == "scattered" else group or RANGE_SPEC.num_layers)
        _ranged_loads(dpool, hpool, eng, zlib.crc32(repr((layout, host_layout, staging, pool,
                                                           group)).encode()))
    finally:
        eng.close()
        hpool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "staged"])
@pytest.mark.parametrize("one_block", [False, True], ids=["scattered", "one-block"])
@pytest.mark.parametrize("group", [0, 2])
def test_cuda_layer_ranges(zero_copy, one_block, group):
    dpool = make_layout_pool(RANGE_SPEC, "vllm_flash", 11, "cuda", one_block)
    hpool = make_host_pool(RANGE_SPEC, 9, "page_first")
    eng = TorchTransferEngine(dpool, hpool, {"zero_copy": zero_copy, "group_layers": group,
                                             "staging_bytes": 4096})
    try:
        _ranged_loads(dpool, hpool, eng, 3 + group)
    finally:
        eng.close()
        hpool.close()


def test_layerwise_handle_of_a_range():
    """A handle of layers 4..8 lands from layer 4, answers wait_layer for those only, waits on
    each group's event once, and is done when layer 8 has landed."""
    from kvtier.transfer_engines.torch_engine import LayerwiseHandle

    class Event:
        def __init__(self, name):
            self.name = name

        def query(self):
            return True

    class Stream:
        def __init__(self):
            self.waits = []

        def wait_event(self, ev):
            self.waits.append(ev.name)

    class Module:
        stream = Stream()

        def current_stream(self):
            return self.stream

    dm = Module()
    h = LayerwiseHandle(13, "torch", dm, layers=(4, 9))
    with pytest.raises(RuntimeError, match="landed before"):
        h._land(0, 2, Event("early"))
    assert h.layers == (4, 9) and h.num_layers == 13
    h._land(4, 3, Event("g0"))
    assert not h.done()
    h.wait_layer(6)
    for bad in (3, 9, 0, 12, -1, True, 5.0):
        with pytest.raises(LayoutError):
            h.wait_layer(bad)                           # type: ignore[arg-type]
    h._land(7, 2, Event("g1"))
    h.wait()
    assert h.done() and dm.stream.waits == ["g0", "g1"]


def test_a_ranges_first_group_is_waitable_while_the_rest_is_held(monkeypatch):
    """On the worker thread, with groups of 2 over layers 3..10: layers 3 and 4 can be waited
    on while the next groups are held back; the host copies' time is measured for the
    range."""
    import threading
    dpool = make_device_pool(RANGE_SPEC, 7)
    hpool = make_host_pool(RANGE_SPEC, 7)
    engine = TorchTransferEngine(dpool, hpool, {"group_layers": 2, "worker_thread": "always"})
    gate = threading.Event()
    real = engine._load_group
    seen = []

    def held(a, g, *args):
        seen.append((a, g))
        if a > 3:
            gate.wait(30)
        real(a, g, *args)
    try:
        monkeypatch.setattr(engine, "_load_group", held)
        h = engine.load([6, 1], [2, 5], layers=(3, 11))
        h.wait_layer(4)
        assert not h.done() and h.busy_seconds() is None
        for layer in (3, 4):
            for c in range(RANGE_SPEC.num_components):
                assert_bitwise_equal(dpool.page(c, layer, 5), hpool.view[1, layer, c])
        gate.set()
        h.wait()
        assert h.done() and h.busy_seconds() is not None
        assert seen == [(3, 2), (5, 2), (7, 2), (9, 2)]
        empty = engine.load([], [], layers=(3, 11))
        empty.wait_layer(10)
        with pytest.raises(LayoutError):
            empty.wait_layer(2)
    finally:
        gate.set()
        engine.close()
        hpool.close()


@pytest.mark.parametrize("op", ["parts", "index"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "cpu"])
def test_gathers_of_long_rows(layout, which, host_layout, staged, op, monkeypatch):
    """Rows at or over torch's CPU select grain are gathered in parts under the grain or
    through the advanced-index kernel instead (host rows into staging; both pools' rows for
    CPU device pools): the same bytes land. A grain of 5 elements cuts rows into odd parts."""
    from kvtier.transfer_engines import torch_engine
    monkeypatch.setattr(torch_engine, "_CPU_SELECT_ROW_LIMIT", 5)
    monkeypatch.setattr(torch_engine, "_gather_op", lambda row, rows: op)
    spec, dpool, hpool, eng = _layout_case(layout, which, host_layout, 1 << 20, one_block=True,
                                           staged=staged)
    try:
        for seed in range(2):
            _roundtrip(dpool, hpool, eng, seed * 5 + which, random.Random(seed).randint(1, 17))
    finally:
        eng.close()
        hpool.close()


def test_cpu_gather_picks_the_op_by_row_and_threads(monkeypatch):
    """index_select under the grain or where a row's copy already spans every thread; longer
    rows in parts under the grain where there is a row per thread, else the advanced-index
    kernel; the same rows every way, into ``out`` or a new tensor."""
    from kvtier.transfer_engines import torch_engine
    monkeypatch.setattr(torch_engine, "_CPU_SELECT_ROW_LIMIT", 8)
    calls = []
    real_index, real_select = torch.ops.aten.index.Tensor_out, torch.index_select
    monkeypatch.setattr(torch.ops.aten.index, "Tensor_out",
                        lambda *a, **k: calls.append("index") or real_index(*a, **k),
                        raising=False)
    monkeypatch.setattr(torch, "index_select",
                        lambda *a, **k: calls.append("select") or real_select(*a, **k))
    src = torch.arange(6 * 26, dtype=torch.int64).view(6, 26)      # rows of 26: 4 grains
    idx = torch.tensor([4, 0, 5, 4, 1])
    for threads, want in ((4, ["select"]), (5, ["select"] * 4), (6, ["index"])):
        monkeypatch.setattr(torch_engine, "_threads", lambda t=threads: t)
        for shape in ((6, 26), (6, 2, 13)):           # [rows, g, e] views are cut alike
            s = src.view(shape)
            calls.clear()
            out = torch.empty((5, *shape[1:]), dtype=torch.int64)
            assert torch_engine._cpu_gather(s, idx, out) is out
            assert torch.equal(out, s[idx]) and calls == want
            assert torch.equal(torch_engine._cpu_gather(s, idx), s[idx])
    assert torch.equal(torch_engine._cpu_gather(src[:, :7], idx), src[idx, :7])  # under grain


def test_row_parts_cover_every_column_once_in_parts_under_the_grain(monkeypatch):
    """Flat rows and [rows, g, e] views whose rows are not one run (layer_first hosts) are cut
    into 2-D parts under the grain that together write every element of ``out`` once."""
    from kvtier.transfer_engines import torch_engine
    monkeypatch.setattr(torch_engine, "_CPU_SELECT_ROW_LIMIT", 5)
    base = torch.randint(1, 1 << 40, (7, 3, 23), dtype=torch.int64)
    for src in (base, base[:, :, 2:17], base[:, 1:3, :], base.view(7, 69)[:, 3:50]):
        out = torch.zeros(src.shape, dtype=torch.int64)
        parts = torch_engine._row_parts(src, out)
        for a, b in parts:
            assert a.dim() == b.dim() == 2 and 0 < a.shape[1] < 5 and b.shape == a.shape
            assert a.stride(1) == 1 and b.stride(1) == 1
            b.copy_(a + b)                              # each element once: a + 0
        assert torch.equal(out, src)
    flat = base[:, 1:3, :]                               # two layers, one run per row
    assert torch_engine._flat(flat).shape == (7, 46)
    assert torch_engine._flat(base[:, :, 2:17]) is not None and \
        torch_engine._flat(base[:, :, 2:17]).dim() == 3


def test_cpu_scatters_move_16_byte_words_bit_for_bit():
    """Host scatters run in 16-byte elements where both sides' layout allows it, else in the
    views' own: every bit pattern lands unchanged either way (NaNs of every payload and sign,
    signalling ones included, infinities, subnormals, random words)."""
    from kvtier.transfer_engines import torch_engine
    words = [0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF, 0xFFF0000000000001, 0x7FF8000000000001,
             0xFFFFFFFFFFFFFFFF, 0x7FF0000000000000, 0x0000000000000001, 0x8000000000000000]
    g = torch.Generator().manual_seed(5)
    base = torch.randint(-2**62, 2**62, (9, 3, 12), dtype=torch.int64, generator=g)
    base.view(-1)[:len(words)] = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w
                                               for w in words])
    idx = torch.tensor([7, 0, 4, 2])
    cases = {"flat": (slice(None), slice(None), slice(None), True),
             "3-D": (slice(None), slice(0, 2), slice(0, 6), True),       # not one run per row
             "odd width": (slice(None), slice(None), slice(0, 5), False),   # 40 B rows
             "odd start": (slice(None), slice(None), slice(1, 5), False)}   # 8 B off 16
    for name, (a, b, c, wide) in cases.items():
        src = base[a, b, c]
        dst = torch.randint(-2**62, 2**62, (11, *src.shape[1:]), dtype=torch.int64,
                            generator=g)
        want = dst.clone()
        want[idx] = src[:4]
        d, s = torch_engine._scatter_pair(dst, src[:4])
        assert (d.dtype == torch.complex128) == wide, name
        torch_engine._cpu_scatter(dst, idx, src[:4])
        assert torch.equal(dst, want), name


def test_fp8_moves_as_bytes():
    """fp8 (no CPU index_copy_ for it in torch) moves as bytes, NaN patterns included."""
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=16, page_size=4,
                      dtype="float8_e4m3fn")
    for staged in (False, True):
        dpool = make_device_pool(spec, 9)
        hpool = make_host_pool(spec, 9)
        dpool.chunks[0][0][3].fill_(0x7F)          # e4m3fn NaN
        eng = (StagedTorchEngine if staged else TorchTransferEngine)(dpool, hpool)
        try:
            eng.backup([3], [5]).wait()
            assert torch.equal(hpool.page_bytes_view(5), dpool.page_bytes(3))
            assert int(hpool.page_bytes_view(5)[0]) == 0x7F
        finally:
            eng.close()
            hpool.close()


def test_wide_elements_where_aligned():
    """Rows whose sizes and addresses allow it move as 8-byte elements; odd rows as bytes."""
    even = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    odd = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=3, page_size=3,
                     dtype="float8_e4m3fn")
    for spec, widths in ((even, [8]), (odd, [1])):
        dpool, hpool = make_device_pool(spec, 3), make_host_pool(spec, 3)
        eng = TorchTransferEngine(dpool, hpool)
        try:
            assert eng.describe()["element_bytes"] == widths
        finally:
            eng.close()
            hpool.close()


@pytest.mark.parametrize("bad", [{"staging_bytes": 0}, {"staging_bytes": -1},
                                 {"staging_bytes": 1.5}, {"host_threads": 4},
                                 {"staging_bytes": True}, {"no_such_key": 1},
                                 {"group_layers": -1}, {"group_layers": True},
                                 {"group_layers": 1.5}])
def test_bad_config_is_refused_when_built(bad):
    dpool, hpool = make_device_pool(MHA, 3), make_host_pool(MHA, 3)
    try:
        with pytest.raises(ConfigError):
            TorchTransferEngine(dpool, hpool, bad)
    finally:
        hpool.close()


def test_device_without_streams_is_refused():
    class NoStreams(TorchTransferEngine):
        def _device_module(self, device):
            return TorchTransferEngine._device_module(self, torch.device("meta"))
    dpool, hpool = make_device_pool(MHA, 3), make_host_pool(MHA, 3)
    try:
        with pytest.raises(LayoutError, match="streams and events"):
            NoStreams(dpool, hpool)
    finally:
        hpool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("staging", [1, 64 << 20], ids=["batched", "one-batch"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "staged"])
@pytest.mark.parametrize("one_block", [False, True], ids=["scattered", "one-block"])
def test_cuda_every_layout(layout, host_layout, staging, zero_copy, one_block):
    for which in range(2):
        spec, dpool, hpool, eng = _layout_case(layout, which, host_layout, staging, "cuda",
                                               staged=False, one_block=one_block,
                                               zero_copy=zero_copy)
        try:
            assert eng.zero_copy == zero_copy        # torch-pinned host pools allow it
            assert eng.max_group == (spec.num_layers if one_block else 1)
            for seed in range(3):
                _roundtrip(dpool, hpool, eng, seed + 11 * which, random.Random(seed).randint(1, 20))
        finally:
            eng.close()
            hpool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calls_do_not_sync_the_caller():
    """A load queued behind a long kernel on the caller's stream returns at once and its data
    lands only after that kernel (the side stream is ordered after the caller's)."""
    spec = KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16)
    dpool, hpool = make_device_pool(spec, 64, "cuda"), make_host_pool(spec, 64)
    eng = TorchTransferEngine(dpool, hpool)
    try:
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        for _ in range(20):
            a = a @ a / 64                     # ~ tens of ms queued on the caller's stream
        dpool.chunks[0][0][:].fill_(0)         # also queued: must be overwritten by the load
        import time
        t = time.perf_counter()
        h = eng.load(list(range(32)), list(range(32)))
        assert time.perf_counter() - t < 0.01
        h.wait()
        torch.cuda.synchronize()
        assert torch.equal(dpool.page_bytes(5).cpu(), hpool.page_bytes_view(5))
    finally:
        eng.close()
        hpool.close()


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_large_rows_in_batches(staged):
    """128 KiB chunks over several staging batches land whole (every row, both ways)."""
    spec = KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=64)
    dpool, hpool = make_device_pool(spec, 12), make_host_pool(spec, 14)
    eng = (StagedTorchEngine if staged else TorchTransferEngine)(
        dpool, hpool, {"staging_bytes": 5 << 20})
    try:
        _roundtrip(dpool, hpool, eng, 3, 11)
    finally:
        eng.close()
        hpool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "staged"])
def test_cuda_large_rows_and_pageable_host(zero_copy):
    """128 KiB chunks in several batches, and a pageable (mmap) host pool, which
    cannot be read in place and is always staged."""
    spec = KVSpec.mha(num_layers=3, num_kv_heads=8, head_dim=128, page_size=64)
    dpool = make_device_pool(spec, 12, "cuda")
    for alloc in ("torch-pinned", "mmap"):
        hpool = make_host_pool(spec, 14, "page_first", alloc)
        eng = TorchTransferEngine(dpool, hpool, {"zero_copy": zero_copy,
                                                 "staging_bytes": 3 << 20})
        try:
            assert eng.zero_copy == (zero_copy and alloc == "torch-pinned")
            _roundtrip(dpool, hpool, eng, 5, 11)
        finally:
            eng.close()
            hpool.close()
