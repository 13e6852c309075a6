"""`memfabric`: host memory the NPU's vector cores can address, from Memfabric acc_offload.

torch's pinned memory is reachable by the NPU's DMA engine only; an AscendC kernel (such as the
``ascendc`` engine's ``kv_exchange_copy``) can dereference host memory only when it comes from
Memfabric's offload pool and is addressed through its device virtual address (DVA). Each buffer
reports that DVA in ``details["dva"]``.

The offload pool is process-wide: the first allocator to allocate initialises it with its
``capacity_bytes`` (rounded up to whole GiB); later allocators share it and must use the same
NPU. Buffers are returned to the pool on ``close()``; ``kvtier_ascend.host_allocator.shutdown()``
uninitialises the pool once every buffer is closed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from kvtier import Availability, HostAllocator, HostBuffer
from kvtier.errors import ConfigError

from . import KVTIER_INTERFACE_VERSION
from ._memfabric import GIB, open_session, shutdown
from ._probe import probe_memfabric

__all__ = ["MemfabricHostAllocator", "shutdown"]


class MemfabricHostAllocator(HostAllocator):
    name = "memfabric"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: NPU whose address space the pool is mapped into.
        device_id: int = 0
        #: Bytes reserved for the whole process at first use (rounded up to whole GiB).
        capacity_bytes: int = 16 * GIB
        #: Ask memfabric for giant pages (``OFFLOAD_FLAG_GIANT_PAGE``).
        giant_pages: bool = False

    def __init__(self, config: Any = None):
        super().__init__(config)
        if self.config.device_id < 0:
            raise ConfigError(f"{self.name}.device_id must be >= 0, got "
                              f"{self.config.device_id}", key=f"{self.name}.device_id",
                              value=self.config.device_id)
        if self.config.capacity_bytes <= 0:
            raise ConfigError(f"{self.name}.capacity_bytes must be > 0, got "
                              f"{self.config.capacity_bytes}", key=f"{self.name}.capacity_bytes",
                              value=self.config.capacity_bytes)

    @classmethod
    def probe(cls) -> Availability:
        return probe_memfabric()

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        return {"capacity_bytes": GIB}

    def _allocate(self, nbytes: int) -> HostBuffer:
        session = open_session(self.config.device_id, self.config.capacity_bytes,
                               self._flags(), self.name)
        ptr, dva = session.malloc(nbytes, self.name)
        try:
            raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
            tensor = torch.frombuffer(raw, dtype=torch.uint8)
        except BaseException:
            session.free(ptr)
            raise
        return HostBuffer(
            ptr=ptr, nbytes=nbytes, tensor=tensor,
            backing="memfabric-offload" + ("-giant" if self.config.giant_pages else ""),
            numa_node=None, device_addressable=True,
            details={"dva": dva, "device_id": session.device_id,
                     "pool_reserved_bytes": session.capacity},
            _release=lambda: session.free(ptr))

    def _flags(self) -> int:
        if not self.config.giant_pages:
            return 0
        from ._probe import load_offload
        return int(load_offload().OFFLOAD_FLAG_GIANT_PAGE)
