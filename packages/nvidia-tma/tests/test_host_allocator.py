"""`cuda-host-register`'s own logic on the CPU: the memory is registered in chunks and
unregistered before it is unmapped, whether the buffer is closed or dropped.

The CUDA calls are the package's own wrappers (``_driver.device``, ``register_host``,
``unregister_host``), replaced here by recorders that check the memory is still mapped when it
is unregistered (an unmapped, still-registered range keeps its pages pinned, and a later
mapping at that address fails to register with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED).
"""

import gc

import pytest

from kvtier_nvidia_tma import _driver
from kvtier_nvidia_tma.host_allocator import CudaHostRegisterAllocator


def _mapped(ptr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


class _Device:
    ordinal = 0

    def make_current(self):
        pass


@pytest.fixture
def calls(monkeypatch):
    log = []

    def unregister(ptr):
        log.append(("unregister", ptr, _mapped(ptr)))

    monkeypatch.setattr(_driver, "device", lambda ordinal: _Device())
    monkeypatch.setattr(_driver, "register_host",
                        lambda ptr, nbytes: log.append(("register", ptr, nbytes)))
    monkeypatch.setattr(_driver, "unregister_host", unregister)
    return log


def _alloc(nbytes=5 << 20):
    a = CudaHostRegisterAllocator({"hugepages": "off", "chunk_bytes": 2 << 20})
    return a.allocate(nbytes)


def _check_released(calls, ptr):
    regs = [c[1] for c in calls if c[0] == "register"]
    unregs = [c for c in calls if c[0] == "unregister"]
    assert regs == [ptr, ptr + (2 << 20), ptr + (4 << 20)]
    assert [c[1] for c in unregs] == regs
    assert all(still_mapped for _, _, still_mapped in unregs)
    assert not _mapped(ptr)


def test_close_unregisters_every_chunk_then_unmaps(calls):
    buf = _alloc()
    ptr = buf.ptr
    buf.tensor[:] = 7                             # the buffer's view is the memory
    assert buf.device_addressable and _mapped(ptr)
    assert buf.details["chunks"] == 3
    buf.close()
    _check_released(calls, ptr)
    buf.close()                                    # idempotent
    assert sum(c[0] == "unregister" for c in calls) == 3


def test_a_dropped_buffer_is_unregistered_before_it_is_unmapped(calls):
    buf = _alloc()
    ptr = buf.ptr
    view = buf.tensor[100:200]                    # a view keeps the memory alive
    view.fill_(3)
    del buf
    gc.collect()
    assert not any(c[0] == "unregister" for c in calls) and _mapped(ptr)
    assert int(view.sum()) == 300
    del view
    gc.collect()
    _check_released(calls, ptr)
