"""`cuda-host-register`: mmap'd host memory registered with CUDA in chunks."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier import Availability, HostAllocator

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_cuda


class CudaHostRegisterAllocator(HostAllocator):
    name = "cuda-host-register"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        hugepages: bool = True

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda()
