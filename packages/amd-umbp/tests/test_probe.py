"""The backends are discovered and say precisely why they cannot run: mori missing, mori.umbp
failing to load (naming the library), an old mori, no AMD GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from kvtier import KVSpec, registry
from kvtier.errors import BackendUnavailableError
from kvtier.interfaces import HOST_ALLOCATORS, L3_STORES
from kvtier.testing import PackageContract

from kvtier_amd_umbp import _probe
from kvtier_amd_umbp.host_allocator import UmbpHostAllocator
from kvtier_amd_umbp.l3_store import UmbpStore

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")


def _both() -> list:
    return [UmbpHostAllocator.probe(), UmbpStore.probe()]


class TestPackage(PackageContract):
    """Discovery with reasons, no vendor import, core imports nothing of the package."""

    distribution = "kvtier-amd-umbp"
    module = "kvtier_amd_umbp"
    backends = {("host_allocator", "umbp"), ("l3_store", "umbp")}


# ----- mori not installed -----------------------------------------------------------------------
def test_mori_missing(mori_missing):
    for av in _both():
        assert not av.ok
        assert "not installed" in av.reason
        assert "amd-mori" in av.hint and "3.10" in av.hint and "3.12" in av.hint
    with pytest.raises(BackendUnavailableError) as err:
        registry.create_l3_store("umbp", spec=SPEC)
    assert "not installed" in err.value.reason and "amd-mori" in err.value.hint
    with pytest.raises(BackendUnavailableError):
        UmbpHostAllocator()                      # direct construction checks too


@pytest.mark.parametrize("py, wheel", [("3.11", False), ("3.13", False), ("3.12", True),
                                       ("3.10", True)])
def test_mori_missing_says_whether_this_python_has_wheels(mori_missing, monkeypatch, py, wheel):
    monkeypatch.setattr(_probe, "python_version", lambda: py)
    av = UmbpStore.probe()
    assert (f"this is Python {py}" in av.reason) is not wheel


# ----- mori present, mori.umbp failing to load --------------------------------------------------
def test_load_error_names_missing_library(umbp_load_error):
    umbp_load_error()
    for av in _both():
        assert not av.ok
        assert "missing shared library libpci.so.3" in av.reason
        assert "OSError" in av.reason
        assert "libpci3" in av.hint
    rec = registry.get_record(HOST_ALLOCATORS, "umbp")
    assert "libpci.so.3" in registry.probe(rec).reason
    with pytest.raises(BackendUnavailableError) as err:
        registry.create_host_allocator("umbp")
    assert "libpci.so.3" in err.value.reason


@pytest.mark.parametrize("message, in_reason, in_hint", [
    ("libamdhip64.so.7: cannot open shared object file: No such file or directory",
     "libamdhip64.so.7", "ROCm 7"),
    ("libhsa-runtime64.so.1: cannot open shared object file: No such file or directory",
     "libhsa-runtime64.so.1", "ROCm 7"),
    ("libgrpc++.so.1.51: cannot open shared object file: No such file or directory",
     "libgrpc++.so.1.51", "gRPC"),
    ("libfoo.so.9: cannot open shared object file: No such file or directory",
     "libfoo.so.9", "provides it"),
    ("/usr/lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.38' not found (required by "
     "libmori_pybinds.so)", "GLIBC_2.38", "glibc 2.35"),
])
def test_load_error_hints(umbp_load_error, message, in_reason, in_hint):
    umbp_load_error(OSError(message))
    av = UmbpStore.probe()
    assert not av.ok and in_reason in av.reason and in_hint in av.hint


def test_load_error_without_a_library_name(umbp_load_error):
    umbp_load_error(RuntimeError("rocm_sdk is installed but could not initialize the HIP runtime"))
    av = UmbpHostAllocator.probe()
    assert not av.ok and "RuntimeError" in av.reason and "rocm_sdk" in av.reason


def test_import_error_inside_mori(umbp_load_error):
    umbp_load_error(ImportError("cannot import name 'UMBPClient' from 'mori.cpp'"))
    av = UmbpStore.probe()
    assert not av.ok and "ImportError" in av.reason and "UMBPClient" in av.reason


def test_old_mori_without_the_1_2_4_api(install_fake, new_fake_module):
    mod = new_fake_module()
    del mod.UMBPClient.batch_exists_consecutive
    del mod.UMBPHostBufferBacking       # a mori built before the host allocator existed
    mod.__version__ = "1.1.0"
    install_fake(module=mod)
    for av in _both():
        assert not av.ok
        assert "UMBPClient.batch_exists_consecutive" in av.reason
        assert "UMBPHostBufferBacking" in av.reason and "1.1.0" in av.reason
        assert "1.2.4" in av.hint


# ----- no AMD GPU -------------------------------------------------------------------------------
def test_no_gpu_store_unavailable_allocator_available(install_fake, tmp_path, monkeypatch):
    install_fake(real_gpu_check=True)
    monkeypatch.setattr(_probe, "KFD_PATH", str(tmp_path / "kfd"))
    _refresh_probes()
    store = UmbpStore.probe()
    assert not store.ok and "kfd" in store.reason and "AMD Instinct" in store.hint
    alloc = UmbpHostAllocator.probe()
    assert alloc.ok and "no AMD GPU" in alloc.reason
    with pytest.raises(BackendUnavailableError) as err:
        UmbpStore(spec=SPEC)
    assert "kfd" in err.value.reason


def test_no_gpu_through_the_registry(install_fake):
    install_fake(gpus=0)
    rec = registry.get_record(L3_STORES, "umbp")
    av = registry.probe(rec, refresh=True)
    assert not av.ok and "no AMD GPU" in av.reason
    assert registry.probe(registry.get_record(HOST_ALLOCATORS, "umbp"), refresh=True).ok


def _refresh_probes() -> None:
    for rec in registry.records():
        if rec.distribution == "kvtier-amd-umbp":
            registry.probe(rec, refresh=True)


def test_amd_gpus_without_kfd(tmp_path):
    n, why = _probe.amd_gpus(str(tmp_path / "kfd"))
    assert n == 0 and "does not exist" in why


def test_amd_gpus_without_hip_runtime(tmp_path):
    kfd = tmp_path / "kfd"
    kfd.write_bytes(b"")
    n, why = _probe.amd_gpus(str(kfd), ("libamdhip64-not-here.so.7",))
    assert n == 0 and "HIP runtime not loadable" in why and "libamdhip64-not-here" in why


def test_amd_gpus_library_without_hip_symbols(tmp_path):
    kfd = tmp_path / "kfd"
    kfd.write_bytes(b"")
    n, why = _probe.amd_gpus(str(kfd), ("libc.so.6",))
    assert n == 0 and "has no hipGetDeviceCount" in why


FAKE_HIP_C = textwrap.dedent("""
    /* FAKE libamdhip64 for tests: hipGetDeviceCount from the environment. */
    #include <stdlib.h>
    int hipGetDeviceCount(int *count) {
        const char *rc = getenv("FAKE_HIP_RC"), *n = getenv("FAKE_HIP_COUNT");
        *count = n ? atoi(n) : 0;
        return rc ? atoi(rc) : 0;
    }
    int hipHostRegister(void *p, unsigned long n, unsigned int f) { return 0; }
    int hipHostUnregister(void *p) { return 0; }
""")


@pytest.fixture(scope="module")
def fake_hip_library(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake HIP runtime")
    d = tmp_path_factory.mktemp("fakehip")
    (d / "fakehip.c").write_text(FAKE_HIP_C)
    lib = d / "libamdhip64.so.7"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(d / "fakehip.c")], check=True)
    return str(lib)


@pytest.mark.parametrize("rc, count, expect_n, expect", [
    (0, 2, 2, "2 AMD GPU(s) visible"),
    (100, 0, 0, "sees no device"),
    (0, 0, 0, "sees no device"),
    (3, 0, 0, "hipError 3"),
])
def test_amd_gpus_asks_the_hip_runtime(fake_hip_library, tmp_path, monkeypatch, rc, count,
                                       expect_n, expect):
    kfd = tmp_path / "kfd"
    kfd.write_bytes(b"")
    monkeypatch.setenv("FAKE_HIP_RC", str(rc))
    monkeypatch.setenv("FAKE_HIP_COUNT", str(count))
    n, why = _probe.amd_gpus(str(kfd), (fake_hip_library,))
    assert n == expect_n and expect in why


def test_missing_library_parser():
    assert _probe.missing_library(OSError(
        "/opt/x/libmori_application.so: libpci.so.3: cannot open shared object file")) == \
        "libpci.so.3"
    assert _probe.missing_library(OSError("something else")) is None


# ----- the real amd-mori wheel, where one is unpacked (its native load fails before anything
# Python-version specific, so the real failure can be seen on any Python) ------------------------
@pytest.mark.skipif(not os.environ.get("KVTIER_TEST_MORI_DIR"),
                    reason="set KVTIER_TEST_MORI_DIR to an unpacked amd-mori wheel (the folder "
                           "that holds mori/) to probe the real module")
def test_probe_against_an_unpacked_real_wheel():
    code = ("from kvtier_amd_umbp.l3_store import UmbpStore; "
            "from kvtier_amd_umbp.host_allocator import UmbpHostAllocator; "
            "print(UmbpStore.probe()); print(UmbpHostAllocator.probe())")
    env = dict(os.environ, PYTHONPATH=os.environ["KVTIER_TEST_MORI_DIR"])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    print(out)
    assert "ok=False" in out and "missing shared library" in out
