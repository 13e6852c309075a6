"""The package's backends are discovered and report honestly why they can or cannot run:
torch_npu failing to import (naming the missing library), no NPU, memfabric failing to
initialise (quoting its log), the acc_offload kernel library not built."""

import logging

import pytest

from kvtier import registry
from kvtier.testing import PackageContract
from kvtier.errors import BackendUnavailableError
from kvtier.interfaces import HOST_ALLOCATORS, TRANSFER_ENGINES
from kvtier_ascend.host_allocator import MemfabricHostAllocator


class TestPackage(PackageContract):
    """Discovery with reasons, no vendor import, core imports nothing of the package."""

    distribution = "kvtier-ascend"
    module = "kvtier_ascend"
    backends = {("host_allocator", "memfabric"), ("transfer_engine", "ascendc")}


# ----- each failure mode, on the FAKE vendor modules (tests/fakes/) -------------------------------

def probe(group: str, name: str):
    return registry.probe(registry.get_record(group, name), refresh=True)


def test_available_on_working_fakes(ascend_fakes):
    npu, mf = ascend_fakes
    inits, uninits = mf.init_calls, mf.uninit_calls
    eng = probe(TRANSFER_ENGINES, "ascendc")
    assert eng.ok, eng.reason
    assert "kv_exchange_copy kernel" in eng.reason
    assert probe(HOST_ALLOCATORS, "memfabric").ok
    # each probe made a trial session and tore it down again
    assert (mf.init_calls - inits, mf.uninit_calls - uninits) == (2, 2)
    assert not mf.initialized


def test_probe_reuses_the_open_session(ascend_fakes):
    _, mf = ascend_fakes
    buf = MemfabricHostAllocator({"capacity_bytes": 1 << 30}).allocate(10)
    inits = mf.init_calls
    assert probe(TRANSFER_ENGINES, "ascendc").ok and probe(HOST_ALLOCATORS, "memfabric").ok
    assert mf.init_calls == inits and mf.initialized, "a probe must not touch a live session"
    buf.close()


def test_torch_npu_missing_library_is_named(failing_import, fake_mf):
    failing_import("torch_npu", ImportError(
        "libhccl.so: cannot open shared object file: No such file or directory"))
    av = probe(TRANSFER_ENGINES, "ascendc")
    assert not av.ok
    assert av.reason.startswith("torch_npu failed to import: libhccl.so is missing")
    assert "CANN" in av.hint
    with pytest.raises(BackendUnavailableError) as err:
        registry.create_transfer_engine("ascendc", None, None)
    assert "libhccl.so" in err.value.reason


def test_torch_npu_not_installed(failing_import, fake_mf):
    failing_import("torch_npu", ModuleNotFoundError("No module named 'torch_npu'",
                                                    name="torch_npu"))
    av = probe(TRANSFER_ENGINES, "ascendc")
    assert not av.ok and av.reason == "torch_npu is not installed"
    # the allocator needs no torch_npu
    assert probe(HOST_ALLOCATORS, "memfabric").ok


def test_no_npu(ascend_fakes):
    npu, _ = ascend_fakes
    npu.device_count = 0
    av = probe(TRANSFER_ENGINES, "ascendc")
    assert not av.ok and "no Ascend NPU" in av.reason and "0 devices" in av.reason


def test_memfabric_not_installed(failing_import, fake_npu):
    failing_import("memfabric_hybrid", ModuleNotFoundError(
        "No module named 'memfabric_hybrid'", name="memfabric_hybrid"))
    for group, name in ((HOST_ALLOCATORS, "memfabric"), (TRANSFER_ENGINES, "ascendc")):
        av = probe(group, name)
        assert not av.ok and av.reason == "memfabric_hybrid is not installed"
        assert "pip install" in av.hint


def test_memfabric_initialise_failure_quotes_its_message(ascend_fakes, caplog):
    _, mf = ascend_fakes
    mf.init_failure = mf.NO_DRIVER_LOG
    with caplog.at_level(logging.WARNING, logger="memfabric_hybrid"):
        for group, name in ((HOST_ALLOCATORS, "memfabric"), (TRANSFER_ENGINES, "ascendc")):
            av = probe(group, name)
            assert not av.ok
            assert "offload.initialize(device_id=0, reserve_size=1073741824) returned -1" \
                in av.reason
            assert "the current version of ascend driver does not support mf!" in av.reason
            assert "entry initialize failed, scene: 0, ret: -1" in av.reason
    assert not caplog.records, "lines quoted in a probe reason are not logged again"
    with pytest.raises(BackendUnavailableError, match="does not support mf"):
        registry.create_host_allocator("memfabric")


def test_kernel_library_not_built(ascend_fakes):
    _, mf = ascend_fakes
    mf.kernel_library_built = False
    av = probe(TRANSFER_ENGINES, "ascendc")
    assert not av.ok and "returned -1" in av.reason and "load library failed" in av.reason
    assert "mfcli kernel install" in av.hint
    assert probe(HOST_ALLOCATORS, "memfabric").ok      # allocation needs no kernel


def test_memfabric_logs_reach_python_logging(ascend_fakes, caplog):
    _, mf = ascend_fakes
    alloc = MemfabricHostAllocator({"capacity_bytes": 1 << 30})
    buf = alloc.allocate(16)
    with caplog.at_level(logging.ERROR, logger="memfabric_hybrid"):
        mf.free(12345)                  # memfabric logs an error outside any probe
    mf.errors.clear()
    assert any("release fail" in r.getMessage() for r in caplog.records)
    buf.close()


def test_vendor_errors_are_kvtier_errors():
    from kvtier.errors import KVTierError
    from kvtier_ascend._memfabric import OffloadInitError
    err = OffloadInitError("offload.initialize returned -3", code=-3)
    assert isinstance(err, KVTierError) and isinstance(err, RuntimeError) and err.code == -3
