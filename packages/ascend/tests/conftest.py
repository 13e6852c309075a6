"""Fixtures installing the FAKE vendor modules (tests/fakes/) for one test at a time.

The fakes replace ``torch_npu`` and ``memfabric_hybrid`` in ``sys.modules`` (and torch_npu's
``Tensor.pin_memory``) only while a test that asks for them runs; backends look the modules up
at call time, and the registry's cached probe results are dropped on both sides so no test sees
another's availability.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvtier import registry

_FAKES = Path(__file__).parent / "fakes"
DIST = "kvtier-ascend"


def _load(name: str):
    """Import a fake under a name no other package's tests can shadow."""
    mod_name = f"_kvtier_ascend_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, _FAKES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]


fake_torch_npu = _load("fake_torch_npu")
fake_memfabric = _load("fake_memfabric")


def refresh_registry() -> None:
    """Forget the package's cached probe results (the fakes change what its probes see)."""
    for rec in ascend_records():
        rec.availability = None


def ascend_records(group: str | None = None):
    return [r for r in registry.records(group) if r.distribution == DIST]


@pytest.fixture
def fake_npu(monkeypatch):
    """A FAKE torch_npu with one NPU whose memory is host memory."""
    rt = fake_torch_npu.FakeTorchNpu(device_count=1)
    monkeypatch.setitem(sys.modules, "torch_npu", rt.module)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", rt.module.npu)
    monkeypatch.setattr(torch.Tensor, "pin_memory", rt.fake_pin_memory())
    return rt


@pytest.fixture
def fake_mf(monkeypatch):
    """A FAKE memfabric_hybrid 1.3.0 (offload entity over real host memory)."""
    mf = fake_memfabric.FakeMemfabric()
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", mf.module)
    return mf


@pytest.fixture
def ascend_fakes(fake_npu, fake_mf):
    """Both fakes installed, registry probes refreshed; on teardown the process's offload
    session is shut down (a leaked buffer fails the test) and probes are refreshed again."""
    from kvtier_ascend import _memfabric
    for rec in ascend_records():
        registry.probe(rec, refresh=True)
    yield fake_npu, fake_mf
    try:
        _memfabric.shutdown()
    finally:
        _memfabric._session = None
        refresh_registry()
    assert not fake_mf.errors, fake_mf.errors


class _FailingImport(importlib.abc.MetaPathFinder):
    """Makes ``import <name>`` raise ``exc`` (how a broken vendor install looks)."""

    def __init__(self, name: str, exc: BaseException):
        self.name, self.exc = name, exc

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise self.exc
        return None


@pytest.fixture
def failing_import(monkeypatch):
    """``failing_import(name, exc)``: importing ``name`` raises ``exc`` for this test."""
    def install(name: str, exc: BaseException) -> None:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, mod)
        monkeypatch.setattr(sys, "meta_path", [_FailingImport(name, exc)] + sys.meta_path)
        refresh_registry()
    yield install
    refresh_registry()
