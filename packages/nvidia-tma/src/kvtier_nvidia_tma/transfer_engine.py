"""NVIDIA transfer engines: TMA bulk copies, register copies and the copy engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier import Availability, TransferEngine

from . import KVTIER_INTERFACE_VERSION
from ._probe import probe_cuda


class TmaTransferEngine(TransferEngine):
    name = "nvidia-tma"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        ctas: int = 2

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((9, 0), "TMA (cp.async.bulk)")


class RegisterTransferEngine(TransferEngine):
    name = "nvidia-register"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        ctas: int = 16

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda()


class CopyEngineTransferEngine(TransferEngine):
    name = "nvidia-copy-engine"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        pass

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda()
