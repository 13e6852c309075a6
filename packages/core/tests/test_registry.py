"""Discovery rules, exercised with real (temporary) distributions on sys.path."""

import json
import subprocess
import sys
import textwrap

import pytest

from kvtier import registry
from kvtier.errors import (BackendConflictError, BackendNotFoundError, BackendUnavailableError,
                           EntryPointError, InterfaceVersionError)
from kvtier.interfaces import L3_STORES, TRANSFER_ENGINES
from kvtier.testing.imports import vendor_modules_added

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from kvtier.interfaces import Availability, INTERFACE_VERSION
    from kvtier.l3_stores.memory import MemoryStore

    class Ready(MemoryStore):
        name = "plug-ready"
        interface_version = INTERFACE_VERSION

    class Missing(MemoryStore):
        name = "plug-missing"
        interface_version = INTERFACE_VERSION
        @classmethod
        def probe(cls):
            return Availability.unavailable("libfoo.so.3 missing", "apt-get install libfoo3")

    class Old(MemoryStore):
        name = "plug-old"
        interface_version = INTERFACE_VERSION + 41

    class Raises(MemoryStore):
        name = "plug-raises"
        interface_version = INTERFACE_VERSION
        @classmethod
        def probe(cls):
            raise OSError("driver exploded")

    class NotABackend:
        name = "plug-notabackend"

    class Misnamed(MemoryStore):
        name = "something-else"
        interface_version = INTERFACE_VERSION
''')


def make_dist(root, dist, eps, module=None):
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(eps)
    if module:
        (root / f"{module[0]}.py").write_text(module[1])


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    make_dist(tmp_path, "plug-a", textwrap.dedent('''
        [kvtier.l3_stores]
        plug-ready = plug_mod:Ready
        plug-missing = plug_mod:Missing
        plug-old = plug_mod:Old
        plug-raises = plug_mod:Raises
        plug-notabackend = plug_mod:NotABackend
        plug-misnamed = plug_mod:Misnamed
        plug-broken = plug_mod_nonexistent:Thing
        plug-dup = plug_mod:Ready
        [kvtier.transfer_engines]
        plug-wronggroup = plug_mod:Ready
        '''), module=("plug_mod", PLUGIN))
    make_dist(tmp_path, "plug-b", "[kvtier.l3_stores]\nplug-dup = plug_mod:Ready\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.discover(refresh=True)
    yield tmp_path
    monkeypatch.undo()
    registry.discover(refresh=True)


def test_available_plugin_is_found(plugins):
    rec = registry.get_record(L3_STORES, "plug-ready")
    assert rec.distribution == "plug-a" and rec.version == "1.2.3"
    assert registry.get_backend_class(L3_STORES, "plug-ready").name == "plug-ready"


def test_unavailable_raises_with_reason_and_hint(plugins):
    with pytest.raises(BackendUnavailableError) as ei:
        registry.get_backend_class(L3_STORES, "plug-missing")
    assert ei.value.reason == "libfoo.so.3 missing" and ei.value.hint == "apt-get install libfoo3"
    assert "libfoo.so.3" in str(ei.value) and "plug-a" in str(ei.value)


def test_probe_that_raises_is_reported_not_propagated(plugins):
    rec = registry.get_record(L3_STORES, "plug-raises")
    av = registry.probe(rec)
    assert not av.ok and "driver exploded" in av.reason
    with pytest.raises(BackendUnavailableError):
        registry.get_backend_class(L3_STORES, "plug-raises")


def test_interface_version_mismatch_is_refused(plugins):
    with pytest.raises(InterfaceVersionError) as ei:
        registry.get_backend_class(L3_STORES, "plug-old")
    assert ei.value.found == ei.value.expected + 41 and "plug-a" in str(ei.value)


@pytest.mark.parametrize("name, text", [
    ("plug-notabackend", "not a L3Store subclass"), ("plug-misnamed", "something-else"),
    ("plug-broken", "failed to load"),
])
def test_malformed_entry_points(plugins, name, text):
    with pytest.raises(EntryPointError, match=text):
        registry.get_backend_class(L3_STORES, name)


def test_wrong_group_is_malformed(plugins):
    with pytest.raises(EntryPointError, match="TransferEngine"):
        registry.get_backend_class(TRANSFER_ENGINES, "plug-wronggroup")


def test_duplicate_names_error_naming_both(plugins):
    with pytest.raises(BackendConflictError) as ei:
        registry.get_backend_class(L3_STORES, "plug-dup")
    assert ei.value.distributions == ("plug-a", "plug-b")
    assert "plug-a" in str(ei.value) and "plug-b" in str(ei.value)


def test_unknown_name_and_group(plugins):
    with pytest.raises(BackendNotFoundError, match="no l3_store named 'nope'"):
        registry.get_backend_class(L3_STORES, "nope")
    with pytest.raises(BackendNotFoundError):
        registry.get_backend_class("kvtier.nothing", "memory")
    with pytest.raises(BackendNotFoundError):
        registry.get_backend_class(L3_STORES, 7)


def test_broken_plugins_do_not_hide_good_ones(plugins):
    names = {r.name for r in registry.records(L3_STORES)}
    assert {"memory", "plug-ready", "plug-missing", "plug-broken"} <= names


def test_cli_lists_everything_and_exits_zero(plugins):
    env_path = str(plugins)
    code = ("import sys; sys.path.insert(0, %r); from kvtier.cli import main; "
            "sys.exit(main(['backends', '--json']))" % env_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
    assert rows[("l3_store", "plug-ready")]["available"] is True
    miss = rows[("l3_store", "plug-missing")]
    assert miss["available"] is False and miss["reason"] == "libfoo.so.3 missing"
    assert miss["hint"] == "apt-get install libfoo3"
    assert "plug-a and plug-b" in rows[("l3_store", "plug-dup")]["reason"]
    assert rows[("transfer_engine", "torch")]["distribution"] == "kvtier-core"
    code_table = code.replace("'--json'", "")
    out = subprocess.run([sys.executable, "-c", code_table], capture_output=True, text=True)
    assert out.returncode == 0 and "libfoo.so.3 missing" in out.stdout
    assert "hint: apt-get install libfoo3" in out.stdout


@pytest.mark.parametrize("discover", [False, True])
def test_import_kvtier_loads_no_vendor_runtime(discover):
    """kvtier adds no vendor module, neither on import nor when listing backends."""
    stmts = "import kvtier, kvtier.cli" + (
        "\nfrom kvtier import registry; registry.discover()" if discover else "")
    assert vendor_modules_added(stmts) == []
