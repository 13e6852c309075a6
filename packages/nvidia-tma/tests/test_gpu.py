"""The engines and the allocator on a real NVIDIA GPU: bitwise against torch, events that
really gate, and typed errors for bad input. Skipped with the probe's reason elsewhere."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from kvtier import DeviceKVPool, HostKVPool, KVSpec, registry
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, PageIndexError)
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.interfaces import HostBuffer
from kvtier.testing.data import fill_random

pytestmark = pytest.mark.hardware

ENGINES = ["nvidia-tma", "nvidia-register", "nvidia-copy-engine"]


def _available(name: str, group: str = "kvtier.transfer_engines"):
    """The backend class, or skip with its probe's reason."""
    try:
        return registry.get_backend_class(group, name)
    except BackendUnavailableError as exc:
        pytest.skip(f"{name}: {exc.reason}" + (f" ({exc.hint})" if exc.hint else ""))


def _engine(name: str, dpool, hpool, **cfg):
    return _available(name)(dpool, hpool, cfg)


SPECS = [
    KVSpec.mla(num_layers=5, kv_lora_rank=512, rope_dim=64, page_size=1),        # 1152 B rows
    KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=3),
    KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5),          # 96 B rows
    KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16,
               dtype="float32"),                                                  # 64 KiB chunks
    KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=128, page_size=1),          # 256 B chunks
]


def _sid(s: KVSpec) -> str:
    return f"{s.kind}-L{s.num_layers}-r{s.row_bytes}-p{s.page_size}"


def _poison(dpool) -> None:
    for comp in dpool.layers:
        for t in comp:
            fill_random(t)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_device_has(dpool, hpool, host_pages, dev_pages, layers=None):
    spec = dpool.spec
    h = torch.as_tensor(host_pages, dtype=torch.int64)
    d = torch.as_tensor(dev_pages, dtype=torch.int64, device=dpool.device)
    for layer in (range(spec.num_layers) if layers is None else layers):
        for c in range(spec.num_components):
            got = dpool.pages_view(c, layer).index_select(0, d)
            want = hpool.view[:, layer, c].index_select(0, h).to(dpool.device)
            assert torch.equal(_u8(got), _u8(want)), f"layer {layer} comp {c} differs"


def assert_host_has(dpool, hpool, dev_pages, host_pages):
    spec = dpool.spec
    h = torch.as_tensor(host_pages, dtype=torch.int64)
    d = torch.as_tensor(dev_pages, dtype=torch.int64, device=dpool.device)
    for layer in range(spec.num_layers):
        for c in range(spec.num_components):
            got = hpool.view[:, layer, c].index_select(0, h)
            want = dpool.pages_view(c, layer).index_select(0, d).cpu()
            assert torch.equal(_u8(got), _u8(want)), f"layer {layer} comp {c} differs"


@pytest.fixture(params=ENGINES)
def engine_name(request):
    _available(request.param)
    return request.param


@pytest.mark.parametrize("spec", SPECS, ids=_sid)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layerwise", [True, False], ids=["per-layer", "all-layer"])
def test_roundtrip_bitwise(engine_name, spec, layout, layerwise):
    if engine_name != "nvidia-copy-engine" and spec.row_bytes % 16:
        pytest.skip("16-byte rows only (misalignment is tested as a typed error)")
    rng = random.Random(hash((engine_name, _sid(spec), layout, layerwise)) & 0xFFFF)
    dpool = DeviceKVPool.empty(spec, 41, "cuda")
    hpool = HostKVPool(spec, 37, layout=layout, allocator=TorchPinnedAllocator())
    eng = _engine(engine_name, dpool, hpool, layerwise_load=layerwise,
                  layerwise_backup=layerwise)
    try:
        for n, form in [(1, "list"), (7, "cuda"), (33, "cpu"), (37, "cuda")]:
            fill_random(hpool.raw)
            _poison(dpool)
            host = [rng.randrange(37) for _ in range(n)]          # repeated sources allowed
            dev = rng.sample(range(41), n)
            wrap = {"list": lambda x: x,
                    "cpu": lambda x: torch.tensor(x),
                    "cuda": lambda x: torch.tensor(x, device="cuda")}[form]
            eng.load(wrap(host), wrap(dev)).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, host, dev)
            fill_random(hpool.raw)                                 # poison the host side
            src = [rng.randrange(41) for _ in range(n)]
            dst = rng.sample(range(37), n)
            h = eng.backup(wrap(src), wrap(dst))
            h.wait()
            torch.cuda.synchronize()
            assert h.done()
            assert_host_has(dpool, hpool, src, dst)
        assert eng.bad_pairs() == 0
    finally:
        eng.close()
        hpool.close()


@pytest.mark.parametrize("name", ["nvidia-tma", "nvidia-register", "nvidia-copy-engine"])
@pytest.mark.parametrize("cfg", [
    {"ctas": 1}, {"ctas": 4}, {"max_batch": 3}, {"max_batch": 1},
    {"first_batch": 0}, {"first_batch": 1}, {"first_batch": 5, "max_batch": 7},
    {"warps": 1, "stages": 2, "stage_bytes": 4096},
    {"warps": 4, "stages": 3, "stage_bytes": 16384},
    {"tensor_map": False},
    {"layer_signals": False}, {"layer_signals": True, "ctas": 8, "warps": 8},
    {"layer_signals": True, "ctas": 3, "warps": 31, "stage_bytes": 1024},
    {"layer_signals": True, "ctas": 5, "warps": 3},
    {"signal_layers": 2}, {"signal_layers": 3, "tensor_map": False}, {"signal_layers": 64},
    {"side_stream": True}, {"issue_thread": True}, {"issue_thread": False, "side_stream": True},
    {"strided": False}, {"strided": True, "max_batch": 2, "first_batch": 1},
    {"strided": True, "issue_thread": True},
    {"threads": 256, "unroll": 8}, {"threads": 1024, "unroll": 2},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_configurations_stay_bitwise(name, cfg):
    keys = set(_available(name).Config.__dataclass_fields__)
    if not set(cfg) <= keys:
        pytest.skip(f"{name} has no {sorted(set(cfg) - keys)}")
    spec = KVSpec.mla(num_layers=7, kv_lora_rank=512, rope_dim=64, page_size=2)
    dpool = DeviceKVPool.empty(spec, 64, "cuda")
    hpool = HostKVPool(spec, 64, allocator=TorchPinnedAllocator())
    rng = random.Random(5)
    try:
        for layerwise in (True, False):
            eng = _engine(name, dpool, hpool, layerwise_load=layerwise,
                          layerwise_backup=layerwise, **cfg)
            fill_random(hpool.raw)
            _poison(dpool)
            host, dev = rng.sample(range(64), 29), rng.sample(range(64), 29)
            eng.load(host, dev).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, host, dev)
            fill_random(hpool.raw)
            eng.backup(dev, host).wait()
            torch.cuda.synchronize()
            assert_host_has(dpool, hpool, dev, host)
            eng.close()
    finally:
        hpool.close()


@pytest.mark.parametrize("name", ["nvidia-tma", "nvidia-register", "nvidia-copy-engine"])
def test_scattered_device_layers(name):
    """Layers allocated separately (no constant stride): no tensor map, still bitwise."""
    spec = KVSpec.mla(num_layers=4, kv_lora_rank=512, rope_dim=64, page_size=1)
    _available(name)
    bufs = []
    for _ in range(spec.num_layers):
        bufs.append(torch.empty((50, 1, 576), dtype=torch.bfloat16, device="cuda"))
        torch.empty(4096 + 512, dtype=torch.uint8, device="cuda")   # break the stride
    bufs.reverse()
    dpool = DeviceKVPool(spec, bufs)
    _poison(dpool)
    hpool = HostKVPool(spec, 30, allocator=TorchPinnedAllocator())
    fill_random(hpool.raw)
    try:
        for layerwise in (True, False):
            eng = _engine(name, dpool, hpool, layerwise_load=layerwise)
            _poison(dpool)
            host, dev = list(range(0, 30, 2)), list(range(49, 34, -1))
            eng.load(host, dev).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, host, dev)
            if name == "nvidia-tma":   # no constant (positive) layer stride: no 4-layer map
                assert not eng.plan(len(host), 0, spec.num_layers)[0].use_tmap
            if name == "nvidia-copy-engine":   # nor strided copies: one copy per chunk
                assert not eng.describe()["strided"], eng.describe()
            eng.close()
    finally:
        hpool.close()


@pytest.mark.parametrize("name, cfg", [
    ("nvidia-tma", {}), ("nvidia-register", {}), ("nvidia-copy-engine", {}),
    ("nvidia-copy-engine", {"issue_thread": True}),    # the issuer's per-layer batches
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_layer_events_really_gate(name, cfg):
    """A layer read after wait_layer(i) on another stream sees the data; read without waiting
    (the load held back by a spin kernel) it sees the poison -- so the test can fail."""
    _available(name)
    spec = KVSpec.mla(num_layers=6, kv_lora_rank=512, rope_dim=64, page_size=4)
    dpool = DeviceKVPool.empty(spec, 300, "cuda")
    hpool = HostKVPool(spec, 300, allocator=TorchPinnedAllocator())
    fill_random(hpool.raw)
    _poison(dpool)
    eng = _engine(name, dpool, hpool, **cfg)
    load_stream, compute = torch.cuda.Stream(), torch.cuda.Stream()
    pages = list(range(300))
    before = [dpool.pages_view(0, layer).clone() for layer in range(spec.num_layers)]
    try:
        with torch.cuda.stream(load_stream):
            torch.cuda._sleep(200_000_000)             # ~0.1 s: hold the load back
            handle = eng.load(pages, pages)
        assert not handle.done()
        with torch.cuda.stream(compute):
            early = dpool.pages_view(0, 5).clone()     # no wait: must still be poison
            seen = []
            for layer in range(spec.num_layers):
                handle.wait_layer(layer)
                seen.append(dpool.pages_view(0, layer).clone())
        torch.cuda.synchronize()
        assert torch.equal(_u8(early), _u8(before[5])), "read before the event saw new data?"
        for layer in range(spec.num_layers):
            want = hpool.view[:, layer, 0].to("cuda")
            assert torch.equal(_u8(seen[layer]), _u8(want)), f"layer {layer} not gated"
        assert handle.done()
    finally:
        eng.close()
        hpool.close()


RANGE_SPECS = [SPECS[0],                                                         # L5, MLA
               KVSpec.mha(num_layers=13, num_kv_heads=2, head_dim=64, page_size=3)]  # L13


@pytest.mark.parametrize("name, cfg", [
    ("nvidia-tma", {}), ("nvidia-tma", {"layer_signals": False}),
    ("nvidia-tma", {"layerwise_load": False}), ("nvidia-tma", {"tensor_map": False}),
    ("nvidia-register", {}), ("nvidia-register", {"layerwise_load": False}),
    ("nvidia-copy-engine", {}), ("nvidia-copy-engine", {"layerwise_load": False}),
    ("nvidia-copy-engine", {"strided": False, "layerwise_load": False}),
    ("nvidia-copy-engine", {"issue_thread": True}),
    ("nvidia-copy-engine", {"issue_thread": True, "layerwise_load": False}),
    ("nvidia-routed", {"crossover_bytes": 1}), ("nvidia-routed", {"crossover_bytes": 1 << 40}),
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("spec", RANGE_SPECS, ids=_sid)
def test_layer_range_loads_bitwise_and_gated(name, cfg, layout, spec):
    """Loads of ranges of layers (the first, the last, every layer, random ones) between
    random pages (repeated sources), the load held back by a spin kernel on its stream:
    on another stream each layer of the range, read right after its wait_layer (asked in
    random order), holds the host's bytes -- it would hold the poison if wait_layer did not
    gate --; every other byte of the device pool (other layers of the same pages, other
    pages) is untouched; wait_layer outside the range is a LayoutError."""
    _available(name)
    L = spec.num_layers
    rng = random.Random(zlib.crc32(repr((name, cfg, layout, _sid(spec))).encode()))
    dpool = DeviceKVPool.empty(spec, 41, "cuda")
    hpool = HostKVPool(spec, 37, layout=layout, allocator=TorchPinnedAllocator())
    eng = _engine(name, dpool, hpool, **cfg)
    C = spec.num_components
    wraps = [lambda x: x, lambda x: torch.tensor(x), lambda x: torch.tensor(x, device="cuda")]
    try:
        assert type(eng).capabilities().layer_ranges
        ranges = [(lo, rng.randint(lo + 1, L)) for lo in (rng.randrange(L) for _ in range(4))]
        ranges += [(0, 1), (L - 1, L), (0, L)]
        for k, (lo, hi) in enumerate(ranges):
            fill_random(hpool.raw)
            _poison(dpool)
            torch.cuda.synchronize()
            before = [[dpool.pages_view(c, layer).clone() for c in range(C)] for layer in range(L)]
            n = rng.randint(1, 37)
            host = [rng.randrange(37) for _ in range(n)]
            dev = rng.sample(range(41), n)
            load_stream, compute = torch.cuda.Stream(), torch.cuda.Stream()
            with torch.cuda.stream(load_stream):
                torch.cuda._sleep(50_000_000)        # hold the load back: reads must wait
                h = eng.load(wraps[k % 3](host), wraps[k % 3](dev), layers=(lo, hi))
            d = torch.tensor(dev, device="cuda")
            seen = {}
            with torch.cuda.stream(compute):
                for layer in rng.sample(range(lo, hi), hi - lo):
                    h.wait_layer(layer)
                    seen[layer] = [dpool.pages_view(c, layer).index_select(0, d)
                                   for c in range(C)]
            for bad in {lo - 1, hi, -1, L} - set(range(lo, hi)):
                with pytest.raises(LayoutError):
                    h.wait_layer(bad)
            h.synchronize()
            torch.cuda.synchronize()
            assert h.done()
            hidx = torch.tensor(host)
            for layer, got in seen.items():
                for c in range(C):
                    want = hpool.view[:, layer, c].index_select(0, hidx).to("cuda")
                    assert torch.equal(_u8(got[c]), _u8(want)), \
                        f"layers [{lo}, {hi}): layer {layer} comp {c} read after wait_layer"
            assert_device_has(dpool, hpool, host, dev, layers=range(lo, hi))
            others = torch.tensor(sorted(set(range(41)) - set(dev)), device="cuda")
            for layer in range(L):
                for c in range(C):
                    now = dpool.pages_view(c, layer)
                    if lo <= layer < hi:
                        now, was = now.index_select(0, others), \
                            before[layer][c].index_select(0, others)
                    else:
                        was = before[layer][c]
                    assert torch.equal(_u8(now), _u8(was)), \
                        f"layers [{lo}, {hi}): layer {layer} comp {c} changed"
        if hasattr(eng, "bad_pairs"):
            assert eng.bad_pairs() == 0
    finally:
        eng.close()
        hpool.close()


def test_layer_range_refusals_on_the_gpu():
    """Bad ranges are InvalidArgumentError before anything is queued, on every engine."""
    spec = RANGE_SPECS[0]
    for name in ENGINES + ["nvidia-routed"]:
        _available(name)
        dpool = DeviceKVPool.empty(spec, 8, "cuda")
        hpool = HostKVPool(spec, 8, allocator=TorchPinnedAllocator())
        fill_random(hpool.raw)
        _poison(dpool)
        torch.cuda.synchronize()
        before = dpool.pages_view(0, 0).clone()
        cfg = {"crossover_bytes": 1} if name == "nvidia-routed" else {}
        eng = _engine(name, dpool, hpool, **cfg)
        try:
            for bad in [(0, 0), (2, 1), (-1, 2), (0, spec.num_layers + 1), (True, 2),
                        (0, 2.0), "0:2", (0,)]:
                with pytest.raises(InvalidArgumentError):
                    eng.load([0, 1], [0, 1], layers=bad)
            torch.cuda.synchronize()
            assert torch.equal(_u8(dpool.pages_view(0, 0)), _u8(before)), name
        finally:
            eng.close()
            hpool.close()


@pytest.mark.parametrize("issue_thread", [True, False])
def test_copy_engine_copies_follow_the_callers_work_at_the_call_only(issue_thread):
    """A backup sees what the caller wrote before it (held back by a spin kernel), and is not
    held back by what the caller queues after it."""
    import time
    _available("nvidia-copy-engine")
    spec = KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=4)
    dpool = DeviceKVPool.empty(spec, 40, "cuda")
    hpool = HostKVPool(spec, 40, allocator=TorchPinnedAllocator())
    fill_random(hpool.raw)
    eng = _engine("nvidia-copy-engine", dpool, hpool, issue_thread=issue_thread)
    caller = torch.cuda.Stream()
    dev, host = random.Random(3).sample(range(40), 17), random.Random(4).sample(range(40), 17)
    try:
        torch.cuda.synchronize()
        with torch.cuda.stream(caller):
            torch.cuda._sleep(100_000_000)             # ~50 ms before the caller's write
            _poison(dpool)                             # the write the backup must see
            handle = eng.backup(dev, host)
            torch.cuda._sleep(2_000_000_000)           # ~1 s of later work
        t0 = time.perf_counter()
        handle.synchronize()
        waited = time.perf_counter() - t0
        assert_host_has(dpool, hpool, dev, host)
        assert waited < 0.6, f"the backup waited {waited:.2f} s: behind later work"
        torch.cuda.synchronize()
    finally:
        eng.close()
        hpool.close()


def test_copy_engine_issue_thread_hands_each_layer_over_as_it_is_queued(monkeypatch):
    """With the issue thread a per-layer load's layer 0 can be waited for while its later
    layers are still being queued (a prefill launches layer 0 beside the queueing), and every
    layer lands bitwise."""
    import threading
    _available("nvidia-copy-engine")
    from kvtier_nvidia_tma import _driver
    spec = KVSpec.mha(num_layers=6, num_kv_heads=2, head_dim=64, page_size=4)
    dpool = DeviceKVPool.empty(spec, 48, "cuda")
    hpool = HostKVPool(spec, 48, allocator=TorchPinnedAllocator())
    fill_random(hpool.raw)
    _poison(dpool)
    eng = _engine("nvidia-copy-engine", dpool, hpool, issue_thread=True)
    gate = threading.Event()
    real = _driver.BatchCopier.queue_layers

    calls = []

    def held(self, dst, src, sizes, bounds, stream, max_batch=0, first=0, after=None):
        calls.append(len(bounds) - 1)

        def after_held(layer):
            after(layer)
            if layer == 0:
                assert gate.wait(10), "layer 0 was not waited for while layer 1 was held"
        return real(self, dst, src, sizes, bounds, stream, max_batch, first, after_held)
    monkeypatch.setattr(_driver.BatchCopier, "queue_layers", held)
    rng = random.Random(11)
    dev, host = rng.sample(range(48), 19), rng.sample(range(48), 19)
    try:
        handle = eng.load(host, dev)
        handle.wait_layer(0)            # returns while layers 1.. are held back unqueued
        gate.set()
        handle.synchronize()
        assert calls == [spec.num_layers], calls    # the per-layer path was the one taken
        assert_device_has(dpool, hpool, host, dev)
    finally:
        gate.set()
        eng.close()
        hpool.close()


@pytest.mark.parametrize("key", ["issue_thread", "strided"])
def test_copy_engine_switches_are_checked(key):
    _available("nvidia-copy-engine")
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=1)
    dpool = DeviceKVPool.empty(spec, 4, "cuda")
    hpool = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
    try:
        with pytest.raises(ConfigError, match=key):
            _engine("nvidia-copy-engine", dpool, hpool, **{key: "yes"})
    finally:
        hpool.close()


@pytest.mark.parametrize("layer_signals, signal_layers, launches", [
    (True, 1, 1), (True, 3, 2), (True, 7, 1), (False, 1, 7)])
def test_tma_per_layer_loads_are_one_launch_with_signals(monkeypatch, layer_signals,
                                                         signal_layers, launches):
    """With layer_signals a per-layer load of 7 layers is one kernel launch (two when the
    groups of signal_layers leave a shorter last one) whose handle waits on device counters;
    without, one launch per layer with events. Both land every layer bitwise, and wait_layer
    on a compute stream orders a read of that layer after it."""
    _available("nvidia-tma")
    from kvtier_nvidia_tma import _driver
    from kvtier_nvidia_tma.transfer_engine import CudaEventHandle, LayerSignalHandle
    spec = KVSpec.mha(num_layers=7, num_kv_heads=2, head_dim=64, page_size=3)
    dpool = DeviceKVPool.empty(spec, 64, "cuda")
    hpool = HostKVPool(spec, 64, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-tma", dpool, hpool, layer_signals=layer_signals,
                  signal_layers=signal_layers)
    seen_launches = []
    real = _driver.launch
    monkeypatch.setattr(_driver, "launch", lambda k, *a: (seen_launches.append(k.name),
                                                           real(k, *a))[1])
    rng = random.Random(7)
    try:
        assert eng.describe()["layer_signals"] is layer_signals
        fill_random(hpool.raw)
        _poison(dpool)
        host, dev = rng.sample(range(64), 50), rng.sample(range(64), 50)
        compute = torch.cuda.Stream()
        with torch.cuda.stream(torch.cuda.Stream()):
            handle = eng.load(host, dev)
        assert type(handle) is (LayerSignalHandle if layer_signals else CudaEventHandle)
        assert len(seen_launches) == launches
        d = torch.tensor(dev, device="cuda")
        with torch.cuda.stream(compute):
            seen = []
            for layer in reversed(range(spec.num_layers)):
                handle.wait_layer(layer)
                seen.append(dpool.pages_view(1, layer).index_select(0, d))
        compute.synchronize()
        for layer, got in zip(reversed(range(spec.num_layers)), seen):
            want = hpool.view[:, layer, 1].index_select(0, torch.tensor(host)).to("cuda")
            assert torch.equal(_u8(got), _u8(want)), f"layer {layer}"
        handle.synchronize()
        assert handle.done()
        assert_device_has(dpool, hpool, host, dev)
        with pytest.raises(LayoutError):
            handle.wait_layer(spec.num_layers)
    finally:
        eng.close()
        hpool.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_tma_signalled_waits_follow_the_counters_zeroing(layout):
    """Loads held back on their stream, each layer read on another stream right after its
    wait_layer, 20 times: the per-layer counters are zeroed on the load's stream, and a wait
    on another stream that did not first wait for that zeroing read the count an earlier load
    left in their memory and went ahead of the copies (4-14 of 30 loads on an H100)."""
    _available("nvidia-tma")
    spec = SPECS[0]
    dpool = DeviceKVPool.empty(spec, 41, "cuda")
    hpool = HostKVPool(spec, 37, layout=layout, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-tma", dpool, hpool)
    rng = random.Random(1)
    try:
        assert eng.describe()["layer_signals"]
        for it in range(20):
            fill_random(hpool.raw)
            _poison(dpool)
            torch.cuda.synchronize()
            n = rng.randint(1, 37)
            host, dev = [rng.randrange(37) for _ in range(n)], rng.sample(range(41), n)
            load_stream, compute = torch.cuda.Stream(), torch.cuda.Stream()
            with torch.cuda.stream(load_stream):
                torch.cuda._sleep(50_000_000)
                h = eng.load(host, dev)
            d = torch.tensor(dev, device="cuda")
            with torch.cuda.stream(compute):
                seen = []
                for layer in range(spec.num_layers):
                    h.wait_layer(layer)
                    seen.append(dpool.pages_view(0, layer).index_select(0, d))
            torch.cuda.synchronize()
            for layer, got in enumerate(seen):
                want = hpool.view[:, layer, 0].index_select(0, torch.tensor(host)).to("cuda")
                assert torch.equal(_u8(got), _u8(want)), f"load {it}: layer {layer} read early"
    finally:
        eng.close()
        hpool.close()


def test_tma_per_layer_signals_need_a_warp_to_spare():
    """A signalled launch adds a publishing warp to each CTA: 32 copy warps plus it would pass
    the 1024-thread block limit, so that configuration is refused when the engine is built,
    naming the key; without per-layer launches or without signals 32 warps still run."""
    _available("nvidia-tma")
    spec = KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=2)
    dpool = DeviceKVPool.empty(spec, 16, "cuda")
    hpool = HostKVPool(spec, 16, allocator=TorchPinnedAllocator())
    try:
        with pytest.raises(ConfigError, match="warps") as ei:
            _engine("nvidia-tma", dpool, hpool, warps=32, stage_bytes=1024)
        assert ei.value.key == "warps"
        for cfg in ({"layer_signals": False}, {"layerwise_load": False}):
            eng = _engine("nvidia-tma", dpool, hpool, warps=32, stage_bytes=1024, **cfg)
            fill_random(hpool.raw)
            eng.load([1, 5, 2], [0, 3, 9]).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, [1, 5, 2], [0, 3, 9])
            eng.close()
    finally:
        hpool.close()


@pytest.mark.parametrize("small_ctas, grid", [(4, 4), (0, 2)])
@pytest.mark.parametrize("d2h", [False, True], ids=["load", "backup"])
def test_tma_small_segments_run_on_more_ctas_and_stay_bitwise(monkeypatch, small_ctas, grid,
                                                              d2h):
    """Per-layer transfers of 512-byte segments (256-byte K and V rows of one page) launch on
    small_ctas CTAs and land every layer bitwise (backups: system-scope counters; loads:
    GPU-scope counters that order a read of each layer after wait_layer). 293 pages make
    groups whose pieces the pipelines do not divide."""
    _available("nvidia-tma")
    from kvtier_nvidia_tma import _driver
    spec = KVSpec.mha(num_layers=9, num_kv_heads=1, head_dim=128, page_size=1)
    dpool = DeviceKVPool.empty(spec, 400, "cuda")
    hpool = HostKVPool(spec, 400, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-tma", dpool, hpool, small_ctas=small_ctas, small_bytes=1024,
                  layerwise_backup=True)
    grids = []
    real = _driver.launch
    monkeypatch.setattr(_driver, "launch", lambda k, g, *a: (grids.append(g), real(k, g, *a))[1])
    rng = random.Random(11 + small_ctas + d2h)
    try:
        assert eng.ctas == grid and eng.describe()["load_ctas"] == grid
        fill_random(hpool.raw)
        _poison(dpool)
        host, dev = rng.sample(range(400), 293), rng.sample(range(400), 293)
        compute = torch.cuda.Stream()
        with torch.cuda.stream(torch.cuda.Stream()):
            handle = eng.backup(dev, host) if d2h else eng.load(host, dev)
        assert grids == [grid]
        if d2h:
            handle.synchronize()
            assert_host_has(dpool, hpool, dev, host)
            return
        d = torch.tensor(dev, device="cuda")
        with torch.cuda.stream(compute):
            seen = []
            for layer in range(spec.num_layers):
                handle.wait_layer(layer)
                seen.append(dpool.pages_view(0, layer).index_select(0, d).clone())
        compute.synchronize()
        for layer, got in enumerate(seen):
            want = hpool.view[:, layer, 0].index_select(0, torch.tensor(host)).to("cuda")
            assert torch.equal(_u8(got), _u8(want)), f"layer {layer}"
        handle.synchronize()
        assert_device_has(dpool, hpool, host, dev)
    finally:
        eng.close()
        hpool.close()


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nvidia-tma", "nvidia-register"])
def test_misaligned_rows_are_typed_error(name):
    _available(name)
    spec = KVSpec.mla(num_layers=1, kv_lora_rank=20, rope_dim=0, page_size=1, dtype="float16")
    dpool = DeviceKVPool.empty(spec, 4, "cuda")
    hpool = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
    try:
        with pytest.raises(LayoutError, match="16"):
            _engine(name, dpool, hpool)
    finally:
        hpool.close()


@pytest.mark.parametrize("name, key, bad", [
    *(("nvidia-copy-engine", "max_batch", b) for b in (-1, 2.5)),
    *(("nvidia-copy-engine", "first_batch", b) for b in (-1, 2.5, True)),
    *(("nvidia-routed", "copy_engine.first_batch", b) for b in (-1, 2.5)),
    *(("nvidia-tma", "signal_layers", b) for b in (0, -2, 1.5, True)),
    *(("nvidia-routed", "verify_margin", b) for b in (-0.1, 1.0, True, "0.1")),
    *(("nvidia-routed", "prefer_copy_within", b) for b in (-0.1, 1.0, True)),
    *(("nvidia-routed", "idle_shortfall", b) for b in (-0.1, 1.0, True, "0.3", float("nan"))),
])
def test_numeric_settings_are_checked(name, key, bad):
    _available(name)
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=1)
    dpool = DeviceKVPool.empty(spec, 4, "cuda")
    hpool = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
    try:
        path, _, leaf = key.rpartition(".")
        with pytest.raises(ConfigError, match=leaf):
            _engine(name, dpool, hpool, **({path: {leaf: bad}} if path else {key: bad}))
    finally:
        hpool.close()


@pytest.mark.parametrize("name", ENGINES)
def test_unregistered_host_memory_is_typed_error(name):
    _available(name)
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=1)
    dpool = DeviceKVPool.empty(spec, 4, "cuda")
    raw = torch.empty(4 * spec.page_bytes, dtype=torch.uint8)          # pageable
    buf = HostBuffer(ptr=raw.data_ptr(), nbytes=raw.numel(), tensor=raw, backing="pageable")
    hpool = HostKVPool(spec, 4, buffer=buf)
    with pytest.raises(InvalidArgumentError, match="not registered"):
        _engine(name, dpool, hpool)


@pytest.mark.parametrize("name", ENGINES)
def test_wrong_device_is_typed_error(name):
    _available(name)
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=1)
    hpool = HostKVPool(spec, 4, allocator=TorchPinnedAllocator())
    try:
        other = torch.cuda.device_count()           # cuda:N never exists; N-1 may
        with pytest.raises(LayoutError, match=f"cuda:{other}"):
            _engine(name, DeviceKVPool.empty(spec, 4, "cuda"), hpool, device=other)
        with pytest.raises(LayoutError, match="CUDA device"):
            _engine(name, DeviceKVPool.empty(spec, 4, "cpu"), hpool)
    finally:
        hpool.close()


@pytest.mark.parametrize("name", ENGINES)
def test_out_of_range_indices(name):
    _available(name)
    spec = KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=2)
    dpool = DeviceKVPool.empty(spec, 10, "cuda")
    hpool = HostKVPool(spec, 8, allocator=TorchPinnedAllocator())
    fill_random(hpool.raw)
    _poison(dpool)
    try:
        eng = _engine(name, dpool, hpool)
        with pytest.raises(PageIndexError):
            eng.load([0, 8], [0, 1])                          # lists: always checked
        with pytest.raises(PageIndexError):
            eng.backup(torch.tensor([10]), torch.tensor([0]))  # CPU tensors: always checked
        with pytest.raises(InvalidArgumentError):
            eng.load([0, 1], [0])
        with pytest.raises(ConfigError):
            _engine(name, dpool, hpool, nonsense=1)
        dbg = _engine(name, dpool, hpool, debug=True)
        with pytest.raises(PageIndexError):                   # device tensors: debug mode
            dbg.load(torch.tensor([0, 9], device="cuda"), torch.tensor([0, 1], device="cuda"))
        with pytest.raises(PageIndexError, match="repeat"):
            dbg.load(torch.tensor([0, 1], device="cuda"), torch.tensor([3, 3], device="cuda"))
        if name != "nvidia-copy-engine":
            # without debug the kernel skips the bad pair, counts it, writes nothing through it
            before = dpool.pages_view(0, 0).clone()
            eng.load(torch.tensor([2, 99, 4], device="cuda"),
                     torch.tensor([5, 6, 7], device="cuda")).wait()
            torch.cuda.synchronize()
            assert eng.bad_pairs() == 1
            assert_device_has(dpool, hpool, [2, 4], [5, 7])
            assert torch.equal(_u8(dpool.pages_view(0, 0)[6]), _u8(before[6]))
    finally:
        hpool.close()


def test_tma_on_a_gpu_without_tma(monkeypatch):
    _available("nvidia-tma")
    from kvtier_nvidia_tma import _driver
    real = _driver.device(0)
    fake = _driver.Device(**{**real.__dict__, "cc": 80, "name": "pretend-A100"})
    monkeypatch.setattr(_driver, "device", lambda ordinal: fake)
    spec = KVSpec.mla(num_layers=1, kv_lora_rank=512, rope_dim=64, page_size=1)
    hpool = HostKVPool(spec, 2, allocator=TorchPinnedAllocator())
    try:
        with pytest.raises(BackendUnavailableError, match="sm_90"):
            _engine("nvidia-tma", DeviceKVPool.empty(spec, 2, "cuda"), hpool)
    finally:
        hpool.close()


# ----------------------------------------------------------------------------------------------
# cuda-host-register
# ----------------------------------------------------------------------------------------------
def test_host_register_large_pool_and_transfer():
    cls = _available("cuda-host-register", "kvtier.host_allocators")
    from kvtier_nvidia_tma import _driver
    alloc = cls({"chunk_bytes": 1 << 30})
    nbytes = (4 << 30) + 3 * 4096 + 17                 # > 4 GiB, not a power of two
    buf = alloc.allocate(nbytes)
    try:
        assert buf.nbytes == nbytes and buf.tensor.numel() == nbytes
        assert buf.details["chunks"] == 5 and buf.device_addressable
        assert buf.backing in ("hugetlb-2MiB", "hugetlb-1024MiB", "thp", "anonymous")
        for off in (0, nbytes // 2, nbytes - 1):
            assert _driver.host_device_pointer(buf.ptr + off) == buf.ptr + off
        spec = KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=64)
        pages = nbytes // spec.page_bytes
        hpool = HostKVPool(spec, pages, buffer=buf)
        dpool = DeviceKVPool.empty(spec, 8, "cuda")
        _poison(dpool)
        eng = _engine("nvidia-tma", dpool, hpool)
        far = [pages - 1, pages // 2, 0]              # touch every registration chunk
        eng.backup([1, 2, 3], far).wait()
        torch.cuda.synchronize()
        assert_host_has(dpool, hpool, [1, 2, 3], far)
        _poison(dpool)
        eng.load(far, [4, 5, 6]).wait()
        torch.cuda.synchronize()
        assert_device_has(dpool, hpool, far, [4, 5, 6])
    finally:
        ptr = buf.ptr
        buf.close()
    assert _driver.host_device_pointer(ptr) is None, "still registered after close"


def test_host_register_buffers_dropped_without_close_are_unregistered():
    """Buffers dropped without close() are unregistered when their last view goes, so the
    address can be mapped and registered again (it failed with ALREADY_REGISTERED)."""
    import gc
    cls = _available("cuda-host-register", "kvtier.host_allocators")
    from kvtier_nvidia_tma import _driver
    alloc = cls({"chunk_bytes": 32 << 20})
    ptrs = []
    for _ in range(6):
        buf = alloc.allocate(64 << 20)
        buf.tensor[::4096] = 1
        ptrs.append(buf.ptr)
        del buf
        gc.collect()
        assert _driver.host_device_pointer(ptrs[-1]) is None, "dropped but still registered"
    keep = alloc.allocate(64 << 20)
    try:
        assert _driver.host_device_pointer(keep.ptr) == keep.ptr
    finally:
        keep.close()


# ----- device layouts (pool.chunks) and the chunk-size router --------------------------------
@pytest.mark.parametrize("layout", ["flashinfer_nhd", "flashinfer_hnd", "vllm_cpu", "mla"])
def test_kernel_engines_refuse_untyped_layouts_copy_engine_takes_them(layout):
    from kvtier.testing.contracts import layout_specs, make_layout_pool
    _available("nvidia-routed")
    spec = layout_specs(layout)[0]
    dpool = make_layout_pool(spec, layout, 5, "cuda")
    hpool = HostKVPool(spec, 5, allocator=TorchPinnedAllocator())
    try:
        for name in ("nvidia-tma", "nvidia-register", "nvidia-routed"):
            with pytest.raises(LayoutError, match="device layout"):
                _engine(name, dpool, hpool, **({"crossover_bytes": 1}
                                               if name == "nvidia-routed" else {}))
        _engine("nvidia-copy-engine", dpool, hpool).close()
    finally:
        hpool.close()


@pytest.mark.parametrize("crossover, path", [(1, "copy_engine"), (1 << 40, "sm")])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3],
                                  KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=16,
                                             page_size=5, dtype="float8_e4m3fn")], ids=_sid)
def test_routed_paths_bitwise_and_counted(spec, crossover, path):
    _available("nvidia-routed")
    rng = random.Random(crossover % 97 + spec.num_layers)
    dpool = DeviceKVPool.empty(spec, 41, "cuda")
    hpool = HostKVPool(spec, 37, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-routed", dpool, hpool, crossover_bytes=crossover)
    try:
        assert eng.route == {"h2d": path, "d2h": path}
        assert eng.crossover_source == "configured"
        # indices where the route reads them: the copy engine on the host, the kernel on the GPU
        assert eng.indices_on_host("h2d") is eng.indices_on_host("d2h") is (path ==
                                                                            "copy_engine")
        with pytest.raises(InvalidArgumentError):
            eng.indices_on_host("both")
        moved = 0
        for n, form in [(1, "list"), (9, "cuda"), (33, "cpu")]:
            wrap = {"list": lambda x: x, "cpu": lambda x: torch.tensor(x),
                    "cuda": lambda x: torch.tensor(x, device="cuda")}[form]
            fill_random(hpool.raw)
            _poison(dpool)
            host = [rng.randrange(37) for _ in range(n)]
            dev = rng.sample(range(41), n)
            h = eng.load(wrap(host), wrap(dev))
            for layer in range(spec.num_layers):
                h.wait_layer(layer)
            h.wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, host, dev)
            fill_random(hpool.raw)
            src, dst = [rng.randrange(41) for _ in range(n)], rng.sample(range(37), n)
            eng.backup(wrap(src), wrap(dst)).wait()
            torch.cuda.synchronize()
            assert_host_has(dpool, hpool, src, dst)
            moved += 2 * n * spec.page_bytes
        st = eng.stats()
        assert st["bytes"][path] == moved and sum(st["bytes"].values()) == moved
        assert st["transfers"][path] == 6
    finally:
        eng.close()
        hpool.close()


def test_routed_builds_its_paths_from_their_nested_configs():
    """``copy_engine`` and ``sm`` reach the two engines as given, the engine-wide settings
    with them."""
    _available("nvidia-routed")
    spec = KVSpec.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, page_size=2)
    dpool = DeviceKVPool.empty(spec, 8, "cuda")
    hpool = HostKVPool(spec, 8, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-routed", dpool, hpool, crossover_bytes=1, layerwise_backup=True,
                  copy_engine={"max_batch": 3, "first_batch": 1}, sm={"ctas": 3})
    try:
        assert (eng.copy.config.max_batch, eng.copy.config.first_batch) == (3, 1)
        assert eng.sm.config.ctas == 3
        assert eng.copy.config.layerwise_backup is eng.sm.config.layerwise_backup is True
    finally:
        eng.close()
        hpool.close()


def test_routed_calibration_is_measured_then_cached(tmp_path):
    _available("nvidia-routed")
    spec = KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=64)   # 128 KiB
    dpool = DeviceKVPool.empty(spec, 9, "cuda")
    hpool = HostKVPool(spec, 9, allocator=TorchPinnedAllocator())
    cache = str(tmp_path / "routes.json")
    try:
        first = _engine("nvidia-routed", dpool, hpool, cache_file=cache, calibrate_mib=8)
        assert first.crossover_source == "calibrated"
        for d in ("h2d", "d2h"):
            table = first.calibration[d]["table"]
            assert len(table) >= 5
            for v in table.values():
                assert set(v) == {"sm", "copy", "sm_device", "copy_device", "copy_call_share"}
                assert min(v.values()) > 0
                # behind GPU work the call's host time is hidden: a device rate is not under
                # the idle one by more than timing noise
                assert v["copy_device"] > 0.8 * v["copy"] and v["sm_device"] > 0.8 * v["sm"]
            cross = first.crossover[d]
            want = "copy_engine" if cross is not None and spec.chunk_bytes >= cross else "sm"
            assert first.route[d] == want
        second = _engine("nvidia-routed", dpool, hpool, cache_file=cache, calibrate_mib=8)
        assert second.crossover_source == "cached"
        assert second.crossover == first.crossover
        first.close()
        second.close()
    finally:
        hpool.close()


def _calibrate_then_say_copy_runs(dpool, hpool, cfg, rates) -> None:
    """Calibrate the router once into ``cfg["cache_file"]``, then edit the cached table: at
    every chunk size the copy engine's rates (from idle, behind GPU work) become ``rates(row)``
    and its call time nearly nothing, so the next engine built from the cache routes to it."""
    import json
    import pathlib
    _engine("nvidia-routed", dpool, hpool, **cfg).close()
    cache = pathlib.Path(cfg["cache_file"])
    data = json.loads(cache.read_text())
    for entry in data.values():
        for d in ("h2d", "d2h"):
            entry[d]["table"] = {k: {**v, **dict(zip(("copy", "copy_device"), rates(v))),
                                     "copy_call_share": 0.01}
                                 for k, v in entry[d]["table"].items()}
    cache.write_text(json.dumps(data))


def test_routed_copy_engine_route_that_is_slow_in_use_moves_to_the_sm_kernel(tmp_path,
                                                                           caplog):
    """A calibration that wrongly favours the copy engine (the cached table is edited to say
    so for 4 KiB chunks, where it really runs at a few GB/s) is caught by the first timed
    transfers: the route moves to the SM kernel, with a warning, and data stays bitwise."""
    import logging
    _available("nvidia-routed")
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=128, page_size=16)  # 4 KiB
    dpool = DeviceKVPool.empty(spec, 512, "cuda")
    hpool = HostKVPool(spec, 512, allocator=TorchPinnedAllocator())
    cache = tmp_path / "routes.json"
    cfg = {"cache_file": str(cache), "calibrate_mib": 8, "verify_mib": 1, "verify_count": 3}
    try:
        _calibrate_then_say_copy_runs(dpool, hpool, cfg,
                                      lambda v: (2 * v["sm"], 2 * v["sm_device"]))
        eng = _engine("nvidia-routed", dpool, hpool, **cfg)
        assert eng.crossover_source == "cached" and eng.route["h2d"] == "copy_engine"
        fill_random(hpool.raw)
        pages = list(range(512))
        with caplog.at_level(logging.WARNING):
            for _ in range(8):      # 3 timed on the copy engine, 3 on the SM kernel's trial
                _poison(dpool)
                eng.load(pages, pages).wait()
                torch.cuda.synchronize()
                assert_device_has(dpool, hpool, pages, pages)
                eng.stats()
            st = eng.stats()
        moved = st["rerouted"]["h2d"]
        assert st["route"]["h2d"] == "sm" and moved["copy_engine_gbps"] < \
            (1 - eng.config.verify_margin) * moved["copy_engine_calibrated_gbps"]
        assert moved["sm_gbps"] > (1 + eng.config.verify_margin) * moved["copy_engine_gbps"]
        assert st["route_trials"]["h2d"]["route"] == "sm"
        assert len(st["copy_engine_gbps_in_use"]["h2d"]) == 3
        assert len(st["sm_gbps_in_use"]["h2d"]) == 3
        assert "moved to nvidia-tma" in caplog.text or "moved to nvidia-register" in caplog.text
        assert st["transfers"]["sm"] >= 1 and st["route"]["d2h"] == "copy_engine"
        assert not eng.indices_on_host("h2d") and eng.indices_on_host("d2h")
        _poison(dpool)
        eng.load(pages, pages).wait()
        torch.cuda.synchronize()
        assert_device_has(dpool, hpool, pages, pages)
        eng.close()
        fixed = _engine("nvidia-routed", dpool, hpool, crossover_bytes=4096, verify_mib=1)
        for _ in range(4):
            fixed.load(pages, pages).wait()
        torch.cuda.synchronize()
        assert fixed.stats()["route"]["h2d"] == "copy_engine"      # configured: kept
        fixed.close()
    finally:
        hpool.close()


def test_routed_trial_keeps_the_copy_engine_when_the_sm_kernel_is_no_faster_in_use(tmp_path):
    """A copy engine that runs under its calibrated rate in use, where the SM kernel runs no
    faster on the same transfers (the cached table says the copy engine is twice as fast as
    it is, at 128 KiB chunks where both paths run near the link): the SM kernel is tried and
    the direction goes back to the copy engine for good, bitwise throughout."""
    _available("nvidia-routed")
    spec = KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=64)   # 128 KiB
    dpool = DeviceKVPool.empty(spec, 256, "cuda")
    hpool = HostKVPool(spec, 256, allocator=TorchPinnedAllocator())
    cache = tmp_path / "routes.json"
    cfg = {"cache_file": str(cache), "calibrate_mib": 8, "verify_mib": 8, "verify_count": 3}
    try:
        _calibrate_then_say_copy_runs(
            dpool, hpool, cfg, lambda v: (2 * max(v["copy"], v["sm"]),
                                          2 * max(v["copy_device"], v["sm_device"])))
        eng = _engine("nvidia-routed", dpool, hpool, **cfg)
        assert eng.route["h2d"] == "copy_engine" and "h2d" in eng._verify
        fill_random(hpool.raw)
        pages = list(range(256))
        routes = []
        for _ in range(10):
            _poison(dpool)
            eng.load(pages, pages).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, pages, pages)
            routes.append(eng.stats()["route"]["h2d"])
        st = eng.stats()
        trial = st["route_trials"]["h2d"]
        assert "sm" in routes, routes                   # the SM kernel was tried
        assert st["route"]["h2d"] == "copy_engine" and trial["route"] == "copy_engine"
        assert trial["sm_gbps"] <= (1 + eng.config.verify_margin) * trial["copy_engine_gbps"]
        assert "h2d" not in st["rerouted"] and "h2d" not in eng._verify
        assert eng.indices_on_host("h2d")
        eng.close()
    finally:
        hpool.close()


def test_routed_in_use_check_does_not_count_a_transfer_the_other_way_overlapped(tmp_path):
    """A timed load still running when a backup is called shares the link with it and would
    read low: it is not counted. A load that ran alone is."""
    _available("nvidia-routed")
    spec = KVSpec.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=64)   # 128 KiB
    dpool = DeviceKVPool.empty(spec, 96, "cuda")
    hpool = HostKVPool(spec, 96, allocator=TorchPinnedAllocator())
    try:
        eng = _engine("nvidia-routed", dpool, hpool, crossover_bytes=1, verify_mib=1,
                      verify_count=3)
        eng._verify = {"h2d", "d2h"}        # a configured route is never checked: check this one
        fill_random(hpool.raw)
        load = list(range(48))
        back = list(range(48, 96))
        torch.cuda._sleep(50_000_000)       # the load cannot have finished when the backup comes
        eng.load(load, load)
        assert len(eng._timed["h2d"]) == 1
        eng.backup(back, back)
        assert eng._timed["h2d"] == []      # overlapped: dropped
        torch.cuda.synchronize()
        eng.stats()
        # the backup was not timed either: it started while the load ran
        assert eng._measured["h2d"] == [] and eng._measured["d2h"] == []
        eng.load(load, load).wait()
        torch.cuda.synchronize()
        eng.stats()
        assert len(eng._measured["h2d"]) == 1 and eng._measured["h2d"][0] > 0
        eng.close()
    finally:
        hpool.close()


def test_auto_picks_the_router_on_cuda_and_reports_it(caplog):
    import logging
    _available("nvidia-routed")
    spec = SPECS[3]
    dpool = DeviceKVPool.empty(spec, 5, "cuda")
    hpool = HostKVPool(spec, 5, allocator=TorchPinnedAllocator())
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.registry"):
            eng = registry.create_transfer_engine(
                "auto", dpool, hpool, {"nvidia-routed": {"crossover_bytes": 1}})
        assert eng.name == "nvidia-routed" and eng.auto_selection["chosen"] == "nvidia-routed"
        assert "chose 'nvidia-routed'" in caplog.text
        eng.close()
        from kvtier.testing.contracts import make_layout_pool
        fpool = make_layout_pool(spec, "flashinfer_hnd", 5, "cuda")
        eng = registry.create_transfer_engine("auto", fpool, hpool)
        assert eng.name == "nvidia-copy-engine"          # the kernels refuse this layout
        assert "nvidia-tma" in eng.auto_selection["skipped"]
        eng.close()
    finally:
        hpool.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["per-layer", "all-layer"])
def test_copy_engine_strided_copies_where_layers_sit_at_one_stride(layerwise):
    """One allocation (DeviceKVPool.empty): a page's run over every layer of a transfer is one
    strided copy; bitwise both ways, with random and repeated source pages."""
    _available("nvidia-copy-engine")
    spec = KVSpec.mha(num_layers=9, num_kv_heads=3, head_dim=40, page_size=5, dtype="float16")
    dpool = DeviceKVPool.empty(spec, 23, "cuda")
    hpool = HostKVPool(spec, 19, allocator=TorchPinnedAllocator())
    eng = _engine("nvidia-copy-engine", dpool, hpool, layerwise_load=layerwise,
                  layerwise_backup=layerwise)
    rng = random.Random(11)
    try:
        info = eng.describe()
        assert info["strided"] and info["strided_why"] == "2 strided copies per page", info
        for _ in range(3):
            fill_random(hpool.raw)
            _poison(dpool)
            host = [rng.randrange(19) for _ in range(13)]
            dev = rng.sample(range(23), 13)
            eng.load(host, dev).wait()
            torch.cuda.synchronize()
            assert_device_has(dpool, hpool, host, dev)
            fill_random(hpool.raw)
            src, dst = [rng.randrange(23) for _ in range(11)], rng.sample(range(19), 11)
            eng.backup(src, dst).wait()
            torch.cuda.synchronize()
            assert_host_has(dpool, hpool, src, dst)
    finally:
        eng.close()
        hpool.close()
