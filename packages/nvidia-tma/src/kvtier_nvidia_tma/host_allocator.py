"""`cuda-host-register`: kvtier's mmap host memory, registered with CUDA in chunks.

Large pinned pools the way ``cudaHostAlloc`` cannot give them: no >4 GiB single-allocation
failures, no power-of-two rounding. The memory comes from core's ``mmap`` allocator (2 MiB
hugetlb pages when reserved, else transparent hugepages, else 4 KiB pages, NUMA binding on
request), is page-locked and mapped for the GPU with ``cuMemHostRegister`` in chunks of
``chunk_bytes`` (PORTABLE | DEVICEMAP, so every context and device can use it), and is
unregistered, then unmapped, on close. ``backing`` says what the kernel really gave; THP
coverage is measured after registration has faulted the pages in.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtier import Availability, HostAllocator, HostBuffer
from kvtier.errors import AllocationError, ConfigError
from kvtier.host_allocators.mmap import MmapAllocator, anon_huge_bytes

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_cuda

_2M = 2 << 20


class CudaHostRegisterAllocator(HostAllocator):
    name = "cuda-host-register"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: As core's mmap allocator: "auto" = hugetlb 2 MiB, then THP, then 4 KiB pages.
        hugepages: Literal["auto", "hugetlb", "thp", "off"] = "auto"
        #: Bind to this NUMA node (libnuma mbind); None leaves the kernel's policy.
        numa_node: int | None = None
        #: Bytes per cuMemHostRegister call (a multiple of 2 MiB).
        chunk_bytes: int = 1 << 30
        #: CUDA device whose primary context registers the memory (PORTABLE: all contexts).
        device: int = 0

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda(need_nvrtc=False)

    def __init__(self, config: Any = None):
        super().__init__(config)
        cb = self.config.chunk_bytes
        if cb <= 0 or cb % _2M:
            raise ConfigError(f"{self.name}.chunk_bytes must be a positive multiple of 2 MiB, "
                              f"got {cb}", key=f"{self.name}.chunk_bytes", value=cb)
        self._mmap = MmapAllocator({"hugepages": self.config.hugepages,
                                    "numa_node": self.config.numa_node, "prefault": False})

    def _allocate(self, nbytes: int) -> HostBuffer:
        from . import _driver
        try:
            dev = _driver.device(self.config.device)
        except Exception as exc:          # no driver/device: an allocation error saying so
            raise AllocationError(f"{self.name}: no usable CUDA device: {exc}",
                                  backend=self.name, nbytes=nbytes) from exc
        inner = self._mmap.allocate(nbytes)
        length = int(inner.details.get("mapped_bytes", nbytes))
        registered: list[int] = []
        try:
            dev.make_current()
            for off in range(0, length, self.config.chunk_bytes):
                _driver.register_host(inner.ptr + off, min(self.config.chunk_bytes, length - off))
                registered.append(inner.ptr + off)
        except Exception as exc:
            _unregister(registered)
            inner.close()
            raise AllocationError(f"{self.name}: registering {length} B with CUDA failed: "
                                  f"{exc}", backend=self.name, nbytes=nbytes) from exc
        backing, details = inner.backing, dict(inner.details)
        if backing == "thp":                # registration faulted the pages in: measure now
            huge = anon_huge_bytes(inner.ptr, length)
            details["thp_bytes"] = huge
            if huge == 0:
                backing = "anonymous"
                details["thp_demoted"] = "the kernel backed the THP region with 4 KiB pages"
        details.update(chunks=len(registered), chunk_bytes=self.config.chunk_bytes,
                       device=dev.ordinal)

        def release() -> None:
            errors = _unregister(registered)
            inner.close()
            if errors:
                raise AllocationError(f"{self.name}: cuMemHostUnregister failed: {errors[0]}",
                                      backend=self.name, nbytes=nbytes)

        # The buffer's own view of the memory: when it is dropped without close(), its last
        # view going unregisters the memory before unmapping it (the inner mapping, held by
        # the finalizer until then, would otherwise be unmapped while still registered: its
        # pages stay pinned, and a later mapping at that address cannot be registered).
        arr = (ctypes.c_uint8 * nbytes).from_address(inner.ptr)
        tensor = torch.frombuffer(arr, dtype=torch.uint8)
        fin = weakref.finalize(arr, release)
        fin.atexit = False                  # the process's end releases it all
        return HostBuffer(ptr=inner.ptr, nbytes=nbytes, tensor=tensor, backing=backing,
                          numa_node=inner.numa_node, device_addressable=True,
                          page_size_bytes=inner.page_size_bytes if backing != "anonymous"
                          else 4096, details=details,
                          _release=fin)


def _unregister(ptrs: list[int]) -> list[str]:
    """Unregister every chunk, collecting failures (the memory is unmapped regardless)."""
    from . import _driver
    errors = []
    for ptr in ptrs:
        try:
            _driver.unregister_host(ptr)
        except Exception as exc:
            errors.append(str(exc))
    ptrs.clear()
    return errors
