"""`umbp`: L3 store on mori.umbp's UMBPClient."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier import Availability, L3Store

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_umbp


class UmbpStore(L3Store):
    name = "umbp"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        dram_capacity_bytes: int = 1 << 30

    @classmethod
    def probe(cls) -> Availability:
        return probe_umbp()
