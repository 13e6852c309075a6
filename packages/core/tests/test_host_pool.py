"""HostKVPool: layouts over a HostBuffer, the free list, pins, validation, thread safety."""

from __future__ import annotations

import ctypes
import os
import random
import sys
import threading

import pytest
import torch

from kvtier.errors import (InvalidArgumentError, LayoutError, PageIndexError, PagePinnedError,
                           PoolExhaustedError)
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.registry import create_host_allocator
from kvtier.layout import logical_view
from kvtier.spec import KVSpec
from kvtier.testing import fill_random, random_specs

SPEC = KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")


@pytest.fixture(params=["torch-pinned", "mmap"])
def allocator(request):
    return create_host_allocator(request.param)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("spec", random_specs(), ids=lambda s: f"{s.kind}-{s.dtype}")
def test_segments_match_the_logical_view(spec, layout, allocator):
    with HostKVPool(spec, 9, layout=layout, allocator=allocator) as pool:
        fill_random(pool.raw)
        assert pool.nbytes == 9 * spec.page_bytes
        for p in random.Random(0).sample(range(9), 5):
            want = pool.view[p].contiguous().view(-1).view(torch.uint8)
            got = torch.cat(pool.page_segments(p))
            assert torch.equal(got, want)
            if layout == "page_first":
                assert torch.equal(pool.page_bytes_view(p), want)
                assert pool.page_ptr(p) == pool.raw.data_ptr() + p * spec.page_bytes
            else:
                with pytest.raises(LayoutError):
                    pool.page_bytes_view(p)
        # writing through a segment shows in the view: they are views, not copies
        seg = pool.page_segments(4)[-1]
        seg.fill_(0x3C)
        tail = pool.view[4, -1, -1].contiguous().view(-1).view(torch.uint8)
        assert int(tail.min()) == int(tail.max()) == 0x3C


def test_page_meta_are_page_addresses():
    with HostKVPool(SPEC, 6, allocator=TorchPinnedAllocator()) as pool:
        ptrs, sizes = pool.get_page_buffer_meta([5, 0, 2])
        base = pool.raw.data_ptr()
        assert ptrs == [base + 5 * SPEC.page_bytes, base, base + 2 * SPEC.page_bytes]
        assert sizes == [SPEC.page_bytes] * 3
        with pytest.raises(PageIndexError):
            pool.get_page_buffer_meta([6])
    with HostKVPool(SPEC, 6, layout="layer_first", allocator=TorchPinnedAllocator()) as pool, \
            pytest.raises(LayoutError):
        pool.get_page_buffer_meta([0])


@pytest.mark.parametrize("bad", [-1, 7, 1.0, True, "1", None])
def test_single_page_accessors_validate(bad):
    with HostKVPool(SPEC, 7, allocator=TorchPinnedAllocator()) as pool:
        for fn in (pool.page_segments, pool.page_bytes_view, pool.page_ptr,
                   pool.pin_count, pool.is_allocated):
            with pytest.raises(PageIndexError):
                fn(bad)


def test_alloc_free_cycle():
    with HostKVPool(SPEC, 5, allocator=TorchPinnedAllocator()) as pool:
        a = pool.alloc(3)
        assert len(set(a)) == 3 and pool.free_count == 2
        assert all(pool.is_allocated(p) for p in a)
        with pytest.raises(PoolExhaustedError) as exc:
            pool.alloc(3)
        assert exc.value.requested == 3 and exc.value.free == 2
        assert pool.free_count == 2, "a failed alloc takes nothing"
        b = pool.alloc(2)
        assert sorted(a + b) == list(range(5))
        assert pool.alloc(0) == []
        pool.free(a)
        assert pool.free_count == 3
        with pytest.raises(PageIndexError):
            pool.free(a[:1])                        # double free
        with pytest.raises(PageIndexError):
            pool.free([b[0], b[0]])                 # duplicate in one call
        assert pool.free_count == 3 and pool.is_allocated(b[0])
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(PageIndexError):
                pool.alloc(bad)                     # type: ignore[arg-type]


def test_pins_protect_pages():
    with HostKVPool(SPEC, 4, allocator=TorchPinnedAllocator()) as pool:
        pages = pool.alloc(3)
        with pytest.raises(PageIndexError):
            pool.pin([p for p in range(4) if p not in pages])   # unallocated
        pool.pin([pages[0], pages[0], pages[1]])
        assert pool.pin_count(pages[0]) == 2 and pool.pin_count(pages[1]) == 1
        with pytest.raises(PagePinnedError):
            pool.free(pages)
        assert all(pool.is_allocated(p) for p in pages), "a refused free frees nothing"
        with pytest.raises(PageIndexError):
            pool.unpin([pages[1], pages[1]])        # pinned once, unpinned twice
        assert pool.pin_count(pages[1]) == 1, "a refused unpin drops nothing"
        pool.unpin([pages[0], pages[1]])
        with pytest.raises(PagePinnedError):
            pool.free([pages[0]])
        pool.unpin([pages[0]])
        pool.free(pages)
        assert pool.free_count == 4
        with pytest.raises(PageIndexError):
            pool.unpin([pages[0]])


def test_concurrent_alloc_free_never_hands_out_a_page_twice():
    pool = HostKVPool(SPEC, 64, allocator=TorchPinnedAllocator())
    owner: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for _ in range(300):
                try:
                    got = pool.alloc(rng.randint(1, 6))
                except PoolExhaustedError:
                    continue
                with lock:
                    for p in got:
                        assert p not in owner, f"page {p} handed out twice"
                        owner[p] = tid
                pool.pin(got)
                pool.unpin(got)
                with lock:
                    for p in got:
                        del owner[p]
                pool.free(got)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert pool.free_count == 64
    assert sorted(pool.alloc(64)) == list(range(64))
    pool.close()


def test_buffer_too_small_and_bad_sizes():
    buf = TorchPinnedAllocator().allocate(SPEC.page_bytes * 3 - 1)
    with pytest.raises(LayoutError):
        HostKVPool(SPEC, 3, buffer=buf)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(LayoutError):
            HostKVPool(SPEC, bad, allocator=TorchPinnedAllocator())  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        HostKVPool(SPEC, 2, layout="row_major", allocator=TorchPinnedAllocator())


def test_caller_buffer_is_not_closed_by_the_pool():
    buf = TorchPinnedAllocator().allocate(SPEC.page_bytes * 4 + 100)
    pool = HostKVPool(SPEC, 4, buffer=buf)
    fill_random(pool.raw)
    pool.close()
    assert not buf.closed
    want = pool.view.contiguous().view(-1).view(torch.uint8)      # compare bytes, not floats
    got = logical_view(buf.tensor, SPEC, 4, "page_first").contiguous().view(-1).view(torch.uint8)
    assert torch.equal(got, want)
    buf.close()


def test_pool_closes_the_buffer_it_allocated(allocator):
    pool = HostKVPool(SPEC, 3, allocator=allocator)
    pool.close()
    assert pool.buffer.closed


def test_allocator_is_an_instance_not_a_name():
    """The pool takes an allocator instance (names resolve through the registry, above it);
    a name is a typed error before anything is allocated."""
    with pytest.raises(InvalidArgumentError, match="HostAllocator instance"):
        HostKVPool(SPEC, 2, allocator="torch-pinned")         # type: ignore[arg-type]
    alloc = TorchPinnedAllocator()
    with HostKVPool(SPEC, 2, allocator=alloc) as pool:
        assert pool.buffer.nbytes >= pool.nbytes


def test_a_missing_allocator_is_a_typed_error_saying_how_to_get_one():
    """No default backend: without an allocator or a buffer the pool refuses, naming the
    registry call that makes one."""
    with pytest.raises(InvalidArgumentError, match=r"create_host_allocator\(name, config\)"
                       ) as err:
        HostKVPool(SPEC, 2)
    assert err.value.argument == "allocator" and "none given" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(InvalidArgumentError, match="allocator"):
        HostKVPool(SPEC, 2, allocator=None)


def test_allocator_and_buffer_together_are_refused():
    alloc = TorchPinnedAllocator()
    buf = alloc.allocate(SPEC.page_bytes * 2)
    with pytest.raises(InvalidArgumentError, match="not both"):
        HostKVPool(SPEC, 2, allocator=alloc, buffer=buf)
    buf.close()


def _resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of the whole pages within ``[ptr, ptr + nbytes)`` that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-ptr // page) * page
    pages = (ptr + nbytes - start) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux mincore")
@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory is resident anyway")
def test_torch_pinned_without_a_gpu_prefaults_unless_told_not_to():
    """Fresh host memory costs a page fault at its first write: the allocator touches it at
    creation by default, so a pool's first fill of backups does not pay it."""
    n = 64 << 20
    buf = TorchPinnedAllocator().allocate(n)
    lazy = TorchPinnedAllocator(TorchPinnedAllocator.Config(prefault=False)).allocate(n)
    # the pages of each buffer in memory now (mincore), not the process's resident size,
    # which memory freed elsewhere at the same time (a collection, another thread) moves
    resident, lazy_resident = _resident_bytes(buf.ptr, n), _resident_bytes(lazy.ptr, n)
    try:
        assert resident >= n * 0.9, resident
        assert lazy_resident < n * 0.5, lazy_resident
        assert buf.tensor.eq(0).all()
    finally:
        buf.close()
        lazy.close()
