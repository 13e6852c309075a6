"""Fixtures that put a FAKE ``mori.umbp`` (tests/fakes/fake_mori_umbp.py, following amd-mori
1.2.4) or a simulated failure in place of the real module, for the length of one test.

Each fixture refreshes kvtier's registry (which caches probe results) after installing and again
after restoring, so no other test sees the fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest
from kvtier import registry

from kvtier_amd_umbp import _probe

FAKE_PATH = Path(__file__).parent / "fakes" / "fake_mori_umbp.py"
LIBPCI_ERROR = "libpci.so.3: cannot open shared object file: No such file or directory"


def load_fake_module() -> types.ModuleType:
    """A fresh instance of the fake (fresh state every time), named ``mori.umbp``."""
    spec = importlib.util.spec_from_file_location("mori.umbp", FAKE_PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mori_package(version: str) -> types.ModuleType:
    pkg = types.ModuleType("mori")
    pkg.__path__ = []          # a package, so "mori.umbp" resolves through sys.modules
    pkg.__spec__ = importlib.machinery.ModuleSpec("mori", None, is_package=True)
    pkg.__version__ = version
    return pkg


class _FailingLoader(importlib.abc.Loader):
    """Loads ``mori.umbp`` the way a broken install does: the native library fails."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise self.exc


class _FailingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, exc: BaseException):
        self.exc = exc

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "mori.umbp":
            return importlib.util.spec_from_loader(name, _FailingLoader(self.exc))
        return None


class FakeHip:
    """FAKE of the three HIP runtime calls kvtier makes (hipHostRegister etc.)."""

    def __init__(self, register_rc: int = 0):
        self.register_rc = register_rc
        self.path = "libamdhip64.so.7 (fake)"
        self.calls: list[tuple[str, int, int]] = []

    def device_count(self) -> tuple[int, int]:
        return 0, 1

    def host_register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        self.calls.append(("register", ptr, nbytes))
        return self.register_rc

    def host_unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0


@pytest.fixture
def make_fake_hip() -> type[FakeHip]:
    """The FakeHip class (HIP runtime stand-in for pinning tests)."""
    return FakeHip


def _refresh() -> None:
    """Drop the registry's cached probe results for this package's backends (the records
    themselves stay valid: only what the probes see changed)."""
    for rec in registry.records():
        if rec.distribution == "kvtier-amd-umbp":
            registry.probe(rec, refresh=True)


@pytest.fixture
def install_fake(monkeypatch) -> Any:
    """``install_fake(gpus=1, hip=None, module=None)`` puts the fake in place; returns it."""
    state: dict[str, Any] = {}

    def install(gpus: int = 1, hip: Any = None, module: types.ModuleType | None = None,
                real_gpu_check: bool = False) -> types.ModuleType:
        mod = module or load_fake_module()
        pkg = _mori_package(getattr(mod, "__version__", "1.2.4"))
        pkg.umbp = mod
        monkeypatch.setitem(sys.modules, "mori", pkg)
        monkeypatch.setitem(sys.modules, "mori.umbp", mod)
        if not real_gpu_check:
            note = f"{gpus} AMD GPU(s) visible (fake)" if gpus else "no AMD GPU (fake)"
            monkeypatch.setattr(_probe, "amd_gpus", lambda *a, **k: (gpus, note))
            monkeypatch.setattr(_probe, "load_hip",
                                lambda *a, **k: (hip, "") if hip else (None, "no HIP (fake)"))
        _refresh()
        state["mod"] = mod
        return mod

    yield install
    monkeypatch.undo()
    _refresh()


@pytest.fixture
def new_fake_module() -> Callable[[], types.ModuleType]:
    """Makes a fresh, not yet installed fake module (to alter before ``install_fake``)."""
    return load_fake_module


@pytest.fixture
def fake_umbp(install_fake) -> types.ModuleType:
    """The fake ``mori.umbp`` with one (fake) AMD GPU visible."""
    return install_fake()


@pytest.fixture
def mori_missing(monkeypatch) -> Callable[[], None]:
    """No ``mori`` importable at all (None in sys.modules blocks the import)."""
    monkeypatch.setitem(sys.modules, "mori", None)
    monkeypatch.delitem(sys.modules, "mori.umbp", raising=False)
    _refresh()
    yield
    monkeypatch.undo()
    _refresh()


@pytest.fixture
def umbp_load_error(monkeypatch) -> Callable[[BaseException], None]:
    """``mori`` is installed, ``import mori.umbp`` raises the given error (default: OSError
    naming libpci.so.3, which is what amd-mori 1.2.4 raises on a host without libpci3)."""

    def install(exc: BaseException | None = None) -> None:
        exc = exc or OSError(LIBPCI_ERROR)
        monkeypatch.setitem(sys.modules, "mori", _mori_package("1.2.4"))
        monkeypatch.delitem(sys.modules, "mori.umbp", raising=False)
        monkeypatch.setattr(sys, "meta_path", [_FailingFinder(exc)] + sys.meta_path)
        _refresh()

    yield install
    monkeypatch.undo()
    _refresh()
