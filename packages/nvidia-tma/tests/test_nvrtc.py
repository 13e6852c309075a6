"""Every kernel compiles through NVRTC to a cubin for sm_90 (and sm_100 where NVRTC knows it);
the disk cache is keyed by source, options, architecture and NVRTC version."""

from __future__ import annotations

import re

import pytest

from kvtier_nvidia_tma import _nvrtc
from kvtier_nvidia_tma._plan import KvtParams

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed "
                            "(pip install -r packages/nvidia-tma/tests/requirements.txt)")


def _archs() -> list[str]:
    try:
        have = _nvrtc.supported_archs()
    except Exception as exc:      # NVRTC library missing: say so instead of passing
        pytest.fail(f"NVRTC is not usable: {exc}")
    return [f"sm_{a}" for a in (90, 100) if a in have]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))


def test_sm90_is_supported():
    assert "sm_90" in _archs(), f"NVRTC {_nvrtc.version()} cannot target sm_90"


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("source", sorted(_nvrtc.SOURCES))
def test_kernel_compiles_to_cubin(source, arch):
    if arch not in _archs():
        pytest.skip(f"NVRTC {_nvrtc.version()} does not support {arch}")
    out = _nvrtc.compile_source(source, arch)
    assert out.image[:4] == b"\x7fELF", "not a cubin"
    for name in _nvrtc.SOURCES[source]:
        assert name.encode() in out.image, f"{name} missing from the {arch} cubin"
    assert not out.cached
    again = _nvrtc.compile_source(source, arch)
    assert again.cached and again.image == out.image and again.key == out.key


def test_tma_kernel_uses_bulk_copies():
    ptx = _nvrtc.compile_source("tma_copy.cu", "compute_90").image.decode()
    for op in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
               "cp.async.bulk.global.shared::cta.bulk_group",
               "cp.async.bulk.tensor.4d.shared::cluster.global.tile",
               "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group",
               "mbarrier.try_wait.parity", "cp.async.bulk.wait_group.read"):
        assert op in ptx, op
    reg = _nvrtc.compile_source("register_copy.cu", "compute_90").image.decode()
    assert "ld.global.v4.u32" in reg and "st.global.v4.u32" in reg   # 16-byte vectors


def test_cache_key_follows_options_and_source(tmp_path, monkeypatch):
    a = _nvrtc.compile_source("tma_copy.cu", "sm_90")
    b = _nvrtc.compile_source("tma_copy.cu", "sm_90", {"KVT_STORES_IN_FLIGHT": 2})
    assert a.key != b.key and not b.cached
    # an edited source is a new key
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    for f in _nvrtc.KERNEL_DIR.iterdir():
        (kdir / f.name).write_bytes(f.read_bytes())
    (kdir / "tma_copy.cu").write_text((kdir / "tma_copy.cu").read_text() + "\n// edited\n")
    monkeypatch.setattr(_nvrtc, "KERNEL_DIR", kdir)
    c = _nvrtc.compile_source("tma_copy.cu", "sm_90")
    assert c.key != a.key and not c.cached
    # a corrupt or unwritable cache is not fatal
    monkeypatch.setenv("KVTIER_CACHE_DIR", "/proc/no-such-dir")
    assert _nvrtc.compile_source("register_copy.cu", "sm_90").image[:4] == b"\x7fELF"


def test_targets():
    assert _nvrtc.target_for(90, "tma_copy.cu") == "sm_90"
    with pytest.raises(_nvrtc.CompileError, match="sm_90"):
        _nvrtc.target_for(80, "tma_copy.cu")
    newest = max(_nvrtc.supported_archs())
    assert _nvrtc.target_for(newest + 1, "tma_copy.cu") == f"compute_{newest}"
    with pytest.raises(_nvrtc.CompileError):
        _nvrtc.compile_source("nope.cu", "sm_90")


def test_compile_error_carries_log(tmp_path, monkeypatch):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    for f in _nvrtc.KERNEL_DIR.iterdir():
        (kdir / f.name).write_bytes(f.read_bytes())
    (kdir / "register_copy.cu").write_text("this is not C++;")
    monkeypatch.setattr(_nvrtc, "KERNEL_DIR", kdir)
    with pytest.raises(_nvrtc.CompileError) as ei:
        _nvrtc.compile_source("register_copy.cu", "sm_90")
    assert "error" in ei.value.log


def test_params_struct_matches_the_header():
    header = (_nvrtc.KERNEL_DIR / "kvt_common.cuh").read_text()
    body = header[header.index("struct KvtParams {"):header.index("};", header.index(
        "struct KvtParams {"))]
    fields = re.findall(r"^\s*i64 (\w+);", body, re.M)
    assert fields == [f for f, _ in KvtParams._fields_]


def test_compile_error_is_a_kvtier_error():
    from kvtier.errors import KVTierError
    err = _nvrtc.CompileError("NVRTC failed", log="line 3: error")
    assert isinstance(err, KVTierError) and isinstance(err, RuntimeError)
    assert err.log == "line 3: error" and "line 3" in str(err)
