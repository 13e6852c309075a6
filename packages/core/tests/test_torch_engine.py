"""The `torch` transfer engine beyond the contract: job ordering, layer-wise waits, failures
surfacing through the handle, bad pools and closed engines."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError, InvalidArgumentError, LayoutError, PageIndexError, \
    TransferError
from kvtier.host_pool import HostKVPool
from kvtier.spec import KVSpec
from kvtier.testing import fill_random, make_device_pool, make_host_pool
from kvtier.testing.contracts import assert_bitwise_equal
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


def test_failures_surface_through_the_handle(engine, monkeypatch):
    def boom(*args):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(engine, "_load_layer", boom)
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
    with HostKVPool(other, 3) as hp, pytest.raises(ConfigError):
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


def test_layer_i_waits_only_for_layer_i(engine, spec, monkeypatch):
    """Layer 0 can be waited on while the later layers are still held back."""
    import threading
    gate = threading.Event()
    real = engine._load_layer

    def held(layer, *args):
        if layer > 0:
            gate.wait(30)
        real(layer, *args)

    monkeypatch.setattr(engine, "_load_layer", held)
    fill_random(engine.host_pool.raw)
    h = engine.load([4], [2])
    h.wait_layer(0)                    # returns although layer 1 has not moved yet
    assert not h.done()
    for c in range(spec.num_components):
        assert_bitwise_equal(engine.device_pool.page(c, 0, 2), engine.host_pool.view[4, 0, c])
    gate.set()
    h.wait()
    assert h.done()
    caps = TorchTransferEngine.capabilities()
    assert not caps.host_indices and caps.row_alignment == 1
