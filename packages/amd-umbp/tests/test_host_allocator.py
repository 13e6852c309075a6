"""The `umbp` host allocator over the FAKE mori.umbp (real mmap/memfd memory underneath)."""

from __future__ import annotations

import ctypes
import gc
import logging

import pytest
import torch
from kvtier import KVSpec
from kvtier.errors import AllocationError, ConfigError, InvalidArgumentError
from kvtier.host_pool import HostKVPool
from kvtier.testing import fill_random

from kvtier_amd_umbp import host_allocator as ha
from kvtier_amd_umbp.host_allocator import UmbpHostAllocator, backing_name, page_numa_node
from kvtier import logutil


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(logutil, "_warned", set())


@pytest.fixture
def no_hugepages(fake_umbp):
    """A kernel with no free huge pages (deterministic whatever this machine has)."""
    fake_umbp.FAKE.deny_hugetlb = True
    return fake_umbp


def test_tensor_is_a_view_of_the_umbp_mapping(fake_umbp):
    buf = UmbpHostAllocator({"hugepages": False}).allocate(10_000)
    try:
        assert buf.ptr in fake_umbp.FAKE.live
        data = torch.randint(1, 256, (10_000,), dtype=torch.uint8)
        buf.tensor.copy_(data)
        assert ctypes.string_at(buf.ptr, 10_000) == bytes(data.tolist())   # same memory
        ctypes.memmove(buf.ptr + 17, b"\x00\x01\x02", 3)
        assert buf.tensor[17:20].tolist() == [0, 1, 2]
        assert buf.backing == "anonymous" and not buf.details["demoted"]
        assert buf.details["mapped_size"] == 12288 and buf.page_size_bytes == 4096
    finally:
        buf.close()
    assert buf.ptr not in fake_umbp.FAKE.live
    buf.close()


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * 1024 * 1024 + 17])
def test_sizes_that_are_not_page_multiples(no_hugepages, nbytes):
    buf = UmbpHostAllocator().allocate(nbytes)
    with buf:
        mapped = buf.details["mapped_size"]
        assert buf.nbytes == nbytes and buf.tensor.numel() == nbytes
        assert mapped >= nbytes and mapped % buf.page_size_bytes == 0
        assert mapped - nbytes < buf.page_size_bytes


def test_hugepage_demotion_reported_and_logged_once(no_hugepages, caplog):
    alloc = UmbpHostAllocator({"hugepages": True, "hugepage_size": 2 << 20})
    with caplog.at_level(logging.WARNING, logger=ha.__name__):
        bufs = [alloc.allocate(5 << 20), alloc.allocate(4096)]
    try:
        for buf in bufs:
            assert buf.backing == "anonymous"             # what it really got, not hugetlb-2MiB
            assert buf.details["requested_backing"] == "AnonymousHugetlb"
            assert buf.details["demoted"] is True
        warnings = [r for r in caplog.records if "4 KiB pages" in r.getMessage()]
        assert len(warnings) == 1 and "nr_hugepages" in warnings[0].getMessage()
    finally:
        for b in bufs:
            b.close()


def test_require_hugepages_is_an_error_and_frees(no_hugepages):
    alloc = UmbpHostAllocator({"require_hugepages": True})
    with pytest.raises(AllocationError) as err:
        alloc.allocate(1 << 20)
    assert "huge pages" in str(err.value) and err.value.nbytes == 1 << 20
    assert not no_hugepages.FAKE.live                   # the demoted mapping was given back


def test_shared_memfd_backing(no_hugepages):
    buf = UmbpHostAllocator({"shared": True}).allocate(70_000)
    with buf:
        assert buf.backing == "shm"
        assert buf.details["requested_backing"] == "AnonymousShmHugetlb"
        fill_random(buf.tensor)
        assert int(buf.tensor.min()) > 0
    buf2 = UmbpHostAllocator({"shared": True, "hugepages": False}).allocate(100)
    with buf2:
        assert buf2.backing == "shm" and not buf2.details["demoted"]


def test_numa_node_reported_from_the_page(fake_umbp):
    node = page_numa_node(ctypes.addressof(ctypes.c_char.from_buffer(bytearray(1))))
    buf = UmbpHostAllocator({"numa_node": 0, "hugepages": False}).allocate(1 << 16)
    with buf:
        assert buf.details["requested_numa_node"] == 0
        # move_pages reads back where the page is; None only where the kernel cannot say
        assert buf.numa_node == (0 if node is not None else None)
    lazy = UmbpHostAllocator({"prefault": False, "hugepages": False}).allocate(1 << 16)
    with lazy:
        assert lazy.numa_node is None                   # not faulted in: no node to report


def test_backing_names():
    B = type("B", (), {})
    for name, align, want in [("Anonymous", 4096, "anonymous"),
                              ("AnonymousHugetlb", 2 << 20, "hugetlb-2MiB"),
                              ("AnonymousHugetlb", 1 << 30, "hugetlb-1GiB"),
                              ("AnonymousShm", 4096, "shm"),
                              ("AnonymousShmHugetlb", 2 << 20, "shm-hugetlb-2MiB")]:
        b = B()
        b.name = name
        assert backing_name(b, align) == want


def test_alloc_failure_is_allocation_error(fake_umbp):
    fake_umbp.FAKE.fail_alloc = True
    with pytest.raises(AllocationError) as err:
        UmbpHostAllocator().allocate(4096)
    assert "UMBPHostMemAllocator.alloc(4096) failed" in str(err.value)


@pytest.mark.parametrize("config, key", [
    ({"hugepage_size": 3 << 20}, "umbp.hugepage_size"),
    ({"hugepage_size": 1024}, "umbp.hugepage_size"),
    ({"numa_node": -2}, "umbp.numa_node"),
    ({"hugepages": False, "require_hugepages": True}, "umbp.hugepages"),
    ({"hugepage": True}, "umbp.hugepage"),                         # unknown key
    ({"prefault": "yes"}, "umbp.prefault"),                        # wrong type
])
def test_bad_config_is_config_error(fake_umbp, config, key):
    with pytest.raises(ConfigError) as err:
        UmbpHostAllocator(config)
    assert err.value.key == key


@pytest.mark.parametrize("nbytes", [0, -4096, 4096.0, "4096", None, True])
def test_bad_size_is_typed_error_before_umbp_is_called(fake_umbp, nbytes):
    with pytest.raises(InvalidArgumentError):
        UmbpHostAllocator().allocate(nbytes)
    assert not fake_umbp.FAKE.live


def test_unclosed_buffer_is_freed_when_its_memory_is_unreachable(fake_umbp):
    buf = UmbpHostAllocator({"hugepages": False}).allocate(8192)
    view = buf.tensor[100:200]
    ptr = buf.ptr
    del buf
    gc.collect()
    assert ptr in fake_umbp.FAKE.live                   # a view still uses the memory
    view.fill_(7)
    del view
    gc.collect()
    assert ptr not in fake_umbp.FAKE.live


def test_pinned_through_hip_when_a_gpu_is_visible(install_fake, make_fake_hip):
    hip = make_fake_hip()
    mod = install_fake(gpus=1, hip=hip)
    mod.FAKE.deny_hugetlb = True
    buf = UmbpHostAllocator().allocate(5000)
    assert buf.device_addressable and buf.details["pinned"]
    assert hip.calls == [("register", buf.ptr, 8192)]
    ptr = buf.ptr
    buf.close()
    assert hip.calls[-1] == ("unregister", ptr, 0) and ptr not in mod.FAKE.live


def test_pin_failure_is_reported_not_hidden(install_fake, make_fake_hip, caplog):
    install_fake(gpus=1, hip=make_fake_hip(register_rc=1))
    with caplog.at_level(logging.WARNING, logger=ha.__name__):
        buf = UmbpHostAllocator({"hugepages": False}).allocate(5000)
    with buf:
        assert not buf.device_addressable and buf.details["pin_error"] == 1
    assert any("hipHostRegister failed" in r.getMessage() for r in caplog.records)


def test_no_gpu_means_not_pinned_and_says_why(install_fake):
    install_fake(gpus=0)
    buf = UmbpHostAllocator({"hugepages": False}).allocate(100)
    with buf:
        assert not buf.device_addressable
        assert "no AMD GPU" in buf.details["not_pinned_because"]
    with UmbpHostAllocator({"pin": False, "hugepages": False}).allocate(100) as b:
        assert "not_pinned_because" not in b.details


def test_backs_a_host_pool_bitwise(no_hugepages):
    spec = KVSpec.mla(num_layers=3, kv_lora_rank=48, rope_dim=8, page_size=7)
    pool = HostKVPool(spec, 9, allocator=UmbpHostAllocator())
    try:
        fill_random(pool.raw)
        snap = pool.raw.clone()
        assert ctypes.string_at(pool.buffer.ptr, pool.nbytes) == bytes(snap.tolist())
    finally:
        pool.close()
    assert not no_hugepages.FAKE.live
