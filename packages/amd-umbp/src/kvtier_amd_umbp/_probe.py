"""Tell apart: mori not installed, mori.umbp failing to load (which library), no ROCm GPU."""

from __future__ import annotations

import importlib
import importlib.util
import sys

from kvtier import Availability

INSTALL_HINT = ("pip install amd-mori (wheels for CPython 3.10 and 3.12 only, manylinux 2.35+, "
                "ROCm 7 runtime libraries)")


def load_umbp():
    """Import and return ``mori.umbp``; raises ImportError/OSError/RuntimeError."""
    return importlib.import_module("mori.umbp")


def probe_umbp() -> Availability:
    if importlib.util.find_spec("mori") is None:
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        extra = "" if py in ("3.10", "3.12") else f" (this is Python {py}: amd-mori has no wheel)"
        return Availability.unavailable("mori is not installed" + extra, INSTALL_HINT)
    try:
        load_umbp()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(f"mori.umbp failed to load: {exc}",
                                        "install the ROCm 7 runtime (libamdhip64.so.7, "
                                        "libhsa-runtime64.so.1) and libpci.so.3")
    return Availability.available("mori.umbp loaded")
