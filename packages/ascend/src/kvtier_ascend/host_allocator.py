"""`memfabric`: host memory the NPU can address, from Memfabric acc_offload."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier import Availability, HostAllocator

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_memfabric, probe_npu


class MemfabricHostAllocator(HostAllocator):
    name = "memfabric"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        device_id: int = 0

    @classmethod
    def probe(cls) -> Availability:
        npu = probe_npu()
        return npu if not npu.ok else probe_memfabric()
