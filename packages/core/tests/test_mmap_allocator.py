"""The `mmap` host allocator: sizes without power-of-two rounding, honest backing, hugepage
demotion logged once, NUMA binding reported as it is, prefaulting, unmapping."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

from kvtier.errors import AllocationError, ConfigError, InvalidArgumentError
from kvtier.host_allocators import mmap as mm
from kvtier.host_allocators.mmap import HUGE_2M, MmapAllocator
from kvtier import logutil

pytestmark = pytest.mark.skipif(not MmapAllocator.probe().ok,
                                reason=f"mmap: {MmapAllocator.probe().reason}")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _smaps_field(addr: int, length: int, field: str) -> int:
    """Sum of an smaps field (bytes) over the mappings overlapping [addr, addr+length)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, _, hi = head.partition("-")
                inside = int(lo, 16) < addr + length and int(hi, 16) > addr
            elif inside and line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, _, hi = line.split(" ", 1)[0].partition("-")
            if int(lo, 16) <= addr < int(hi, 16):
                return True
    return False


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the 'logged once' state of a fresh process."""
    monkeypatch.setattr(logutil, "_warned", set())


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def test_tens_of_gib_without_power_of_two_rounding():
    # 20 GiB + an odd tail (smaller where the machine could not even map that much).
    size = (20 << 30) + 12345 if _mem_total() > (21 << 30) else _mem_total() // 2 + 12345
    buf = MmapAllocator({"prefault": False}).allocate(size)
    try:
        assert buf.nbytes == size and buf.tensor.numel() == size
        mapped = buf.details["mapped_bytes"]
        assert mapped % buf.page_size_bytes == 0
        assert size <= mapped < size + buf.page_size_bytes, "rounded only to the page size"
        assert mapped & (mapped - 1), "not a power of two"
        assert buf.details["prefaulted"] is False
        assert _smaps_field(buf.ptr, mapped, "Rss") < (64 << 20), "nothing faulted up front"
        offsets = [0, PAGE - 1, size // 3, (5 << 30) % size, size - 1]
        for i, off in enumerate(offsets):
            buf.tensor[off] = 17 + i
        for i, off in enumerate(offsets):
            assert int(buf.tensor[off]) == 17 + i
        assert int(buf.tensor[size // 2]) == 0, "anonymous memory starts zeroed"
    finally:
        buf.close()
    assert not _mapped(buf.ptr)


@pytest.mark.parametrize("nbytes", [1, PAGE - 1, PAGE + 1, 3 * HUGE_2M + 17])
def test_plain_pages_round_to_the_base_page(nbytes):
    buf = MmapAllocator({"hugepages": "off"}).allocate(nbytes)
    try:
        assert buf.backing == "anonymous" and buf.page_size_bytes == PAGE
        assert buf.details["mapped_bytes"] == -(-nbytes // PAGE) * PAGE
        assert buf.ptr % PAGE == 0 and buf.ptr == buf.tensor.data_ptr()
        assert "demoted" not in buf.details
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        buf.tensor.copy_(data)
        assert torch.equal(buf.tensor, data)
    finally:
        buf.close()


def test_prefault_faults_every_page_multithreaded():
    size = 8 * HUGE_2M + 3 * PAGE + 5
    buf = MmapAllocator({"hugepages": "off", "prefault_threads": 3}).allocate(size)
    try:
        mapped = buf.details["mapped_bytes"]
        assert buf.details["prefaulted"] is True
        assert _smaps_field(buf.ptr, mapped, "Rss") >= mapped
        assert int(buf.tensor.max()) == 0
    finally:
        buf.close()


def test_prefault_by_touching_when_populate_is_missing(monkeypatch):
    # An advice the kernel rejects with EINVAL stands in for a kernel older than 5.14.
    monkeypatch.setattr(mm, "_MADV_POPULATE_WRITE", 0x7FFF)
    size = 5 * PAGE + 1
    buf = MmapAllocator({"hugepages": "off", "prefault_threads": 2}).allocate(size)
    try:
        assert _smaps_field(buf.ptr, buf.details["mapped_bytes"], "Rss") >= 6 * PAGE
        assert int(buf.tensor.max()) == 0
    finally:
        buf.close()


@pytest.mark.skipif(mm.thp_mode() not in ("always", "madvise"),
                    reason=f"transparent hugepages are '{mm.thp_mode() or 'unavailable'}'")
def test_thp_backing_is_what_the_kernel_gave():
    size = 3 * HUGE_2M + 1
    buf = MmapAllocator({"hugepages": "thp"}).allocate(size)
    try:
        mapped = buf.details["mapped_bytes"]
        assert mapped == 4 * HUGE_2M and buf.ptr % HUGE_2M == 0
        huge = buf.details["thp_bytes"]
        assert huge == _smaps_field(buf.ptr, mapped, "AnonHugePages")
        if huge:
            assert buf.backing == "thp" and buf.page_size_bytes == HUGE_2M
        else:   # the kernel could not find 2 MiB pages: said so, not hidden
            assert buf.backing == "anonymous" and "thp_demoted" in buf.details
            assert "demoted" in buf.details
    finally:
        buf.close()


def test_hugetlb_demotion_is_reported_and_logged_once(caplog):
    need = 2
    alloc = MmapAllocator({"hugepages": "hugetlb"})
    if mm.hugetlb_free_2m() >= need:
        buf = alloc.allocate(need * HUGE_2M - 7)
        try:
            assert buf.backing == "hugetlb-2MiB" and buf.page_size_bytes == HUGE_2M
            assert buf.details["mapped_bytes"] == need * HUGE_2M
        finally:
            buf.close()
        return
    with caplog.at_level(logging.WARNING, logger=mm.__name__):
        bufs = [alloc.allocate(need * HUGE_2M - 7) for _ in range(3)]
    try:
        for buf in bufs:
            assert buf.backing != "hugetlb-2MiB"
            first = buf.details["attempts"][0]
            assert first["backing"] == "hugetlb-2MiB" and not first["ok"]
            assert "hugetlb" in first["reason"]
            assert "demoted" in buf.details
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                    and r.name == mm.__name__]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "hugetlb-2MiB" in warnings[0].getMessage()
    finally:
        for buf in bufs:
            buf.close()


def test_no_hugepages_at_all(monkeypatch, caplog):
    # A machine with no hugetlb pages reserved and THP switched off.
    real_map = MmapAllocator._map

    def no_hugetlb(self, libc, kind, nbytes):
        if kind == "hugetlb":
            return None, None, "ENOMEM: no free 2 MiB hugetlb pages"
        return real_map(self, libc, kind, nbytes)

    monkeypatch.setattr(MmapAllocator, "_map", no_hugetlb)
    monkeypatch.setattr(mm, "thp_mode", lambda: "never")
    with caplog.at_level(logging.WARNING, logger=mm.__name__):
        buf = MmapAllocator({"hugepages": "auto"}).allocate(HUGE_2M + 1)
    try:
        assert buf.backing == "anonymous" and buf.page_size_bytes == PAGE
        assert [a["backing"] for a in buf.details["attempts"]] == \
            ["hugetlb-2MiB", "thp", "anonymous"]
        assert "never" in buf.details["attempts"][1]["reason"]
        assert len([r for r in caplog.records if r.name == mm.__name__]) == 1
    finally:
        buf.close()
    with pytest.raises(AllocationError, match="require_hugepages"):
        MmapAllocator({"require_hugepages": True}).allocate(HUGE_2M)


def test_numa_binding_is_reported_honestly(caplog):
    numa, why = mm._numa()
    if numa is None:
        buf = MmapAllocator({"numa_node": 0}).allocate(PAGE)
        try:
            assert buf.numa_node is None and why in buf.details["numa_bind_error"]
        finally:
            buf.close()
        with pytest.raises(AllocationError):
            MmapAllocator({"numa_node": 0, "numa_strict": True}).allocate(PAGE)
        return
    buf = MmapAllocator({"numa_node": 0, "hugepages": "off"}).allocate(3 * PAGE)
    try:
        assert buf.numa_node == 0 and buf.details["numa_bound"] == 0
        assert buf.details["numa_nodes_seen"] == [0]
    finally:
        buf.close()
    missing = numa.max_node + 1
    with caplog.at_level(logging.WARNING, logger=mm.__name__):
        buf = MmapAllocator({"numa_node": missing}).allocate(PAGE)
    try:
        assert buf.numa_node != missing and "does not exist" in buf.details["numa_bind_error"]
        assert any("NUMA" in r.getMessage() for r in caplog.records)
    finally:
        buf.close()
    with pytest.raises(AllocationError, match="NUMA node"):
        MmapAllocator({"numa_node": missing, "numa_strict": True}).allocate(PAGE)


def test_numa_node_unknown_without_prefault_or_binding():
    buf = MmapAllocator({"prefault": False}).allocate(PAGE)
    try:
        assert buf.numa_node is None
    finally:
        buf.close()


def test_unmapped_when_the_last_view_dies_without_close():
    buf = MmapAllocator({"hugepages": "off"}).allocate(4 * PAGE)
    addr = buf.ptr
    view = buf.tensor[PAGE:2 * PAGE]
    view.fill_(9)
    del buf
    gc.collect()
    assert _mapped(addr), "a live view keeps the memory mapped"
    assert int(view.sum()) == 9 * PAGE
    del view
    gc.collect()
    assert not _mapped(addr)


def test_close_is_idempotent_and_unmaps():
    buf = MmapAllocator({"hugepages": "off"}).allocate(PAGE)
    addr = buf.ptr
    buf.close()
    buf.close()
    assert buf.closed and buf.tensor.numel() == 0 and not _mapped(addr)


@pytest.mark.parametrize("config", [{"numa_node": -1}, {"prefault_threads": -2},
                                    {"hugepages": "1GiB"}, {"huge": True},
                                    {"prefault": "yes"}])
def test_bad_config_is_config_error(config):
    with pytest.raises(ConfigError):
        MmapAllocator(config)


@pytest.mark.parametrize("nbytes", [0, -5, 2.5, "1", None, True])
def test_bad_sizes(nbytes):
    with pytest.raises(InvalidArgumentError):
        MmapAllocator().allocate(nbytes)


def test_impossible_size_is_allocation_error():
    with pytest.raises(AllocationError):
        MmapAllocator({"prefault": False, "hugepages": "off"}).allocate(1 << 62)
