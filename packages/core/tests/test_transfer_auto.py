"""transfer_engine="auto": chosen by declared capability and rank, reported, never a silent
stand-in for a named engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from kvtier import registry
from kvtier.errors import BackendUnavailableError, LayoutError
from kvtier.interfaces import INTERFACE_VERSION, Availability, Capabilities, TransferEngine
from kvtier.registry import BackendRecord, TRANSFER_ENGINES
from kvtier.spec import KVSpec
from kvtier.testing import make_device_pool, make_host_pool
from kvtier.transfer_engines.torch_engine import TorchTransferEngine

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)


def _fake(name: str, *, ok=True, devices=("cpu",), rank=50, refuse=False):
    class Fake(TransferEngine):
        interface_version = INTERFACE_VERSION

        @dataclass(frozen=True)
        class Config:
            pass

        @classmethod
        def probe(cls):
            return Availability.available() if ok else Availability.unavailable("no runtime")

        @classmethod
        def capabilities(cls):
            return Capabilities(device_types=devices, auto_priority=rank)

        def __init__(self, dp, hp, config=None):
            super().__init__(dp, hp, config)
            if refuse:
                raise LayoutError(f"{name}: device layout not supported")

        def load(self, h, d, layers=None):
            raise AssertionError

        def backup(self, d, h):
            raise AssertionError
    Fake.name = name
    rec = BackendRecord(TRANSFER_ENGINES, name, "fake-dist", "0", f"fake:{name}")
    rec.cls = Fake
    return rec


@pytest.fixture
def pools():
    dp, hp = make_device_pool(SPEC, 3), make_host_pool(SPEC, 3)
    yield dp, hp
    hp.close()


def _with(monkeypatch, recs):
    torch_rec = BackendRecord(TRANSFER_ENGINES, "torch", "kvtier-core", "0", "t")
    torch_rec.cls = TorchTransferEngine
    monkeypatch.setattr(registry, "records", lambda group=None: recs + [torch_rec])


def test_auto_on_cpu_is_the_torch_engine_and_says_so(pools, caplog):
    with caplog.at_level(logging.INFO, logger="kvtier.registry"):
        eng = registry.create_transfer_engine("auto", *pools)
    try:
        assert isinstance(eng, TorchTransferEngine)
        assert eng.auto_selection["chosen"] == "torch"
        assert eng.auto_selection["device_type"] == "cpu"
        assert "transfer_engine=auto chose 'torch'" in caplog.text
    finally:
        eng.close()


def test_rank_capabilities_and_refusals(pools, monkeypatch):
    recs = [_fake("gpu-only", devices=("cuda",), rank=99), _fake("broken", ok=False, rank=98),
            _fake("manual", rank=None), _fake("picky", rank=90, refuse=True),
            _fake("second", rank=10), _fake("best", rank=80)]
    recs[-1].cls.__init__ = lambda self, dp, hp, config=None: None       # builds fine
    _with(monkeypatch, recs)
    order = [r.name for r, why in registry.auto_candidates("cpu") if not why]
    assert order == ["picky", "best", "second", "torch"]
    eng = registry.select_transfer_engine(*pools)
    assert eng.name == "best"
    skipped = eng.auto_selection["skipped"]
    assert "LayoutError" in skipped["picky"] and "cuda" in skipped["gpu-only"]
    assert "no runtime" in skipped["broken"] and "auto_priority" in skipped["manual"]


def test_nothing_that_fits_is_a_typed_error(pools, monkeypatch):
    monkeypatch.setattr(registry, "records",
                        lambda group=None: [_fake("gpu-only", devices=("cuda",))])
    with pytest.raises(BackendUnavailableError, match="gpu-only"):
        registry.create_transfer_engine("auto", *pools)


def test_auto_config_maps_engine_names(pools):
    eng = registry.create_transfer_engine("auto", *pools, {"torch": {"staging_bytes": 7}})
    try:
        assert eng.config.staging_bytes == 7
    finally:
        eng.close()
    from kvtier.errors import ConfigError
    with pytest.raises(ConfigError):
        registry.create_transfer_engine("auto", *pools, ["torch"])


def test_a_named_engine_that_cannot_run_still_fails_loudly(pools):
    unavailable = [r for r in registry.records(TRANSFER_ENGINES)
                   if not registry.probe(r).ok]
    if not unavailable:
        pytest.skip("every discovered transfer engine can run here")
    with pytest.raises(BackendUnavailableError):
        registry.create_transfer_engine(unavailable[0].name, *pools)


def test_backends_listing_shows_the_auto_rank():
    rows = {r["name"]: r for r in (x.as_dict() for x in registry.probe_all())
            if r["kind"] == "transfer_engine"}
    assert rows["torch"]["auto_priority"] == 0
