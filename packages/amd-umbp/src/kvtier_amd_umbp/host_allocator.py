"""`umbp`: hugepage host allocator on mori.umbp's UMBPHostMemAllocator."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier import Availability, HostAllocator

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_umbp


class UmbpHostAllocator(HostAllocator):
    name = "umbp"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        hugepages: bool = True

    @classmethod
    def probe(cls) -> Availability:
        return probe_umbp()
