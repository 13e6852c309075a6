"""`umbp`: host memory for the L2 pool from mori's ``UMBPHostMemAllocator``.

Hugetlb-backed (2 MiB or 1 GiB pages) when the kernel has free huge pages, bound to a NUMA node
and prefaulted, as SGLang's UMBP host allocator does. UMBP never throws: a failed allocation is
a falsy handle, and a hugetlb request the kernel cannot serve falls back to 4 KiB pages and says
so in ``actual_backing``. This allocator reports that honestly (``HostBuffer.backing``, a
warning logged once per process, or an error with ``require_hugepages``), reads back the NUMA
node the first page really landed on, and page-locks the memory with ``hipHostRegister`` when an
AMD GPU is visible so that the GPU can DMA it. The memory needs no GPU itself.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from kvtier.logutil import warn_once
from kvtier import Availability, HostAllocator, HostBuffer
from kvtier.errors import AllocationError, BackendUnavailableError, ConfigError

from . import KVTIER_INTERFACE_VERSION, _probe

log = logging.getLogger(__name__)

_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "ppc64le": 301}


def _size_name(nbytes: int) -> str:
    if nbytes >= 1 << 30 and nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30}GiB"
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20}MiB"
    return f"{nbytes >> 10}KiB"


def backing_name(backing: Any, alignment: int) -> str:
    """kvtier's name for a UMBPHostBufferBacking value (hugetlb ones carry the page size)."""
    name = getattr(backing, "name", str(backing))
    return {"Anonymous": "anonymous",
            "AnonymousHugetlb": f"hugetlb-{_size_name(alignment)}",
            "AnonymousShm": "shm",
            "AnonymousShmHugetlb": f"shm-hugetlb-{_size_name(alignment)}"}.get(name, name)


def page_numa_node(ptr: int) -> int | None:
    """NUMA node of the page at ``ptr`` (move_pages query), None if unknown or not present."""
    nr = _MOVE_PAGES.get(platform.machine())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (ctypes.c_void_p * 1)(ptr)
        status = (ctypes.c_int * 1)(-1)
        rc = libc.syscall(nr, 0, 1, pages, None, status, 0)
    except (OSError, AttributeError):
        return None
    return int(status[0]) if rc == 0 and status[0] >= 0 else None


def _warn_once(key: tuple[str, int], message: str, *args: object) -> None:
    warn_once(log, key, message, *args)


class UmbpHostAllocator(HostAllocator):
    name = "umbp"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: Ask for hugetlb pages; without free huge pages UMBP falls back to 4 KiB pages.
        hugepages: bool = True
        #: Huge page size: 2 MiB or 1 GiB (a power of two the kernel supports).
        hugepage_size: int = 2 << 20
        #: memfd-backed memory (UMBP's AnonymousShm*), which another process can map.
        shared: bool = False
        #: Bind to this NUMA node (-1: no binding). Best effort, as in UMBP; the node the first
        #: page really landed on is reported in ``HostBuffer.numa_node``.
        numa_node: int = -1
        #: Fault every page in at allocation time (no first-touch stalls later).
        prefault: bool = True
        #: Page-lock the memory with hipHostRegister when an AMD GPU is visible.
        pin: bool = True
        #: Treat a fallback to 4 KiB pages as an AllocationError instead of a logged warning.
        require_hugepages: bool = False

    def __init__(self, config: Any = None):
        super().__init__(config)
        c = self.config
        hp = c.hugepage_size
        if isinstance(hp, bool) or hp < 4096 or hp & (hp - 1):
            raise ConfigError(f"umbp.hugepage_size must be a power of two >= 4096, got {hp!r}",
                              key="umbp.hugepage_size", value=hp)
        if c.numa_node < -1:
            raise ConfigError(f"umbp.numa_node must be -1 (no binding) or a node id, got "
                              f"{c.numa_node}", key="umbp.numa_node", value=c.numa_node)
        if c.require_hugepages and not c.hugepages:
            raise ConfigError("umbp.require_hugepages needs umbp.hugepages", key="umbp.hugepages",
                              value=c.hugepages)
        av, mod = _probe.probe_umbp()
        if not av.ok:
            raise BackendUnavailableError(f"host_allocator 'umbp' is unavailable: {av.reason}",
                                          kind="host_allocator", name=self.name,
                                          reason=av.reason, hint=av.hint)
        self._mod = mod
        self._alloc = mod.UMBPHostMemAllocator()
        self._hip = None
        self._gpu_note = ""
        if c.pin:
            n, self._gpu_note = _probe.amd_gpus()
            if n > 0:
                self._hip, why = _probe.load_hip()
                if self._hip is None:
                    self._gpu_note = why

    @classmethod
    def probe(cls) -> Availability:
        av, mod = _probe.probe_umbp()
        if not av.ok:
            return av
        try:
            alloc = mod.UMBPHostMemAllocator()
            h = alloc.alloc(4096, mod.UMBPHostBufferBacking.Anonymous, 2 << 20, -1, True)
        except Exception as exc:  # a broken runtime is a reason, not a crash
            return Availability.unavailable(f"UMBPHostMemAllocator raised {type(exc).__name__}: "
                                            f"{exc}")
        if not h:
            return Availability.unavailable("UMBPHostMemAllocator.alloc(4096) returned an "
                                            "invalid handle (mmap failed)")
        alloc.free(h)
        _, gpus = _probe.amd_gpus()
        return Availability.available(f"mori.umbp host memory works; {gpus}")

    def _backing(self) -> Any:
        B = self._mod.UMBPHostBufferBacking
        c = self.config
        if c.shared:
            return B.AnonymousShmHugetlb if c.hugepages else B.AnonymousShm
        return B.AnonymousHugetlb if c.hugepages else B.Anonymous

    def _allocate(self, nbytes: int) -> HostBuffer:
        c = self.config
        requested = self._backing()
        handle = self._alloc.alloc(nbytes, requested, c.hugepage_size, c.numa_node, c.prefault)
        if not handle:
            raise AllocationError(
                f"umbp: UMBPHostMemAllocator.alloc({nbytes}) failed (backing={requested.name}, "
                f"numa_node={c.numa_node}): mmap refused the mapping", backend=self.name,
                nbytes=nbytes)
        alloc = self._alloc
        ptr, mapped = int(handle.ptr), int(handle.mapped_size)
        actual, alignment = handle.actual_backing, int(handle.actual_alignment)
        demoted = c.hugepages and actual.name in ("Anonymous", "AnonymousShm")
        if demoted and c.require_hugepages:
            alloc.free(handle)
            raise AllocationError(
                f"umbp: no free {_size_name(c.hugepage_size)} huge pages for {nbytes} bytes "
                "(require_hugepages is set); raise vm.nr_hugepages", backend=self.name,
                nbytes=nbytes)
        if demoted:
            _warn_once((requested.name, c.hugepage_size),
                       "umbp: asked for %s pages of %s, the kernel gave %s (4 KiB pages); "
                       "check vm.nr_hugepages and HugePages_Free in /proc/meminfo",
                       requested.name, _size_name(c.hugepage_size), actual.name)

        pinned, pin_error = False, None
        if self._hip is not None:
            rc = self._hip.host_register(ptr, mapped)
            pinned = rc == 0
            if not pinned:
                pin_error = rc
                _warn_once(("pin", rc), "umbp: hipHostRegister failed with hipError %d; the "
                           "buffer stays pageable (slower host<->device copies)", rc)

        node = page_numa_node(ptr) if c.prefault else None
        if c.numa_node >= 0 and node is not None and node != c.numa_node:
            _warn_once(("numa", c.numa_node), "umbp: asked for NUMA node %d, memory is on "
                       "node %d", c.numa_node, node)

        array = (ctypes.c_ubyte * nbytes).from_address(ptr)
        tensor = torch.frombuffer(array, dtype=torch.uint8, count=nbytes)
        hip = self._hip if pinned else None

        def release(handle=handle) -> None:
            if hip is not None:
                hip.host_unregister(ptr)
            alloc.free(handle)

        # Explicit close() frees at once; a buffer never closed is freed when the last view of
        # its memory (the ctypes array behind every tensor view) goes away.
        finalizer = weakref.finalize(array, release)
        details = {"requested_backing": requested.name, "actual_backing": actual.name,
                   "mapped_size": mapped, "alignment": alignment, "demoted": demoted,
                   "pinned": pinned, "requested_numa_node": c.numa_node}
        if pin_error is not None:
            details["pin_error"] = pin_error
        if c.pin and self._hip is None:
            details["not_pinned_because"] = self._gpu_note
        return HostBuffer(ptr=ptr, nbytes=nbytes, tensor=tensor,
                          backing=backing_name(actual, alignment), numa_node=node,
                          device_addressable=pinned, page_size_bytes=alignment,
                          details=details, _release=finalizer)
