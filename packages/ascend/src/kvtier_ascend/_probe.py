"""Tell apart: torch_npu failing to import (which library), no NPU, memfabric init failure."""

from __future__ import annotations

import importlib

from kvtier import Availability

TORCH_NPU_HINT = "install CANN and the torch-npu build matching your torch (not a kvtier dependency)"
MEMFABRIC_HINT = "pip install memfabric-hybrid (needs the Ascend driver to run)"


def load_torch_npu():
    return importlib.import_module("torch_npu")


def load_offload():
    return importlib.import_module("memfabric_hybrid.offload")


def probe_npu() -> Availability:
    try:
        torch_npu = load_torch_npu()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(f"torch_npu failed to import: {exc}", TORCH_NPU_HINT)
    try:
        count = torch_npu.npu.device_count()
    except (RuntimeError, AttributeError) as exc:
        return Availability.unavailable(f"no Ascend NPU: {exc}", TORCH_NPU_HINT)
    if not count:
        return Availability.unavailable("no Ascend NPU found (torch_npu sees 0 devices)",
                                        TORCH_NPU_HINT)
    return Availability.available(f"{count} NPU(s)")


def probe_memfabric() -> Availability:
    try:
        load_offload()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(f"memfabric_hybrid.offload failed to import: {exc}",
                                        MEMFABRIC_HINT)
    return Availability.available("memfabric_hybrid.offload imported")
