"""Why a UMBP backend can or cannot run here.

Three different failures look alike from far away and need different fixes, so they are told
apart: ``mori`` is not installed (no wheel for this Python, or not installed); ``mori`` is
installed but ``mori.umbp`` fails to load (amd-mori's native libraries need ROCm 7, libpci,
gRPC... -- the dynamic loader raises ``OSError`` naming the first missing library); no AMD GPU
is visible to the HIP runtime. Nothing here imports mori at module import time.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import sys
from typing import Any

from kvtier import Availability

#: amd-mori publishes CPython wheels for these versions only.
WHEEL_PYTHONS = ("3.10", "3.12")
#: The release whose ``mori.umbp`` API this package is written against.
MORI_VERSION = "1.2.4"
INSTALL_HINT = (f"pip install 'kvtier-amd-umbp[runtime]' (amd-mori>={MORI_VERSION} has x86_64 "
                "Linux wheels for CPython 3.10 (glibc 2.35+) and 3.12 (glibc 2.39+) only, and "
                "needs the ROCm 7 runtime)")

#: What provides each shared library amd-mori 1.2.4 links against (Debian/Ubuntu names).
LIBRARY_HINTS = {
    "libamdhip64.so.7": "the ROCm 7 HIP runtime (ROCm 7 install, e.g. /opt/rocm/lib)",
    "libhsa-runtime64.so.1": "the ROCm 7 HSA runtime (ROCm 7 install, e.g. /opt/rocm/lib)",
    "libpci.so.3": "libpci3 (apt-get install libpci3)",
    "libnuma.so.1": "libnuma1 (apt-get install libnuma1)",
    "libdrm.so.2": "libdrm2 (apt-get install libdrm2)",
    "libdrm_amdgpu.so.1": "libdrm-amdgpu1 (apt-get install libdrm-amdgpu1)",
    "libprotobuf.so.32": "protobuf 3.21 runtime (Ubuntu 24.04: libprotobuf32t64)",
    "libgrpc++.so.1.51": "gRPC 1.51 C++ runtime (Ubuntu 24.04: libgrpc++1.51t64)",
    "libgrpc.so.29": "gRPC 1.51 core runtime (Ubuntu 24.04: libgrpc29t64)",
}

#: Where the HIP runtime is looked for (the soname first: mori.umbp has usually loaded it).
HIP_LIBRARIES = ("libamdhip64.so.7", "/opt/rocm/lib/libamdhip64.so.7")
KFD_PATH = "/dev/kfd"
HIP_ERROR_NO_DEVICE = 100

_MISSING_LIB = re.compile(r"([A-Za-z0-9_.+-]+\.so(?:\.[0-9]+)*): cannot open shared object file")
_MISSING_SYMBOL_VERSION = re.compile(r"version `([A-Za-z0-9_.]+)' not found")

#: Classes and methods of the 1.2.4 API the adapters call; an older mori lacks some.
REQUIRED_API = {
    "UMBPHostMemAllocator": ("alloc", "free"),
    "UMBPHostBufferBacking": ("Anonymous", "AnonymousHugetlb", "AnonymousShm",
                              "AnonymousShmHugetlb"),
    "UMBPClient": ("batch_put_from_ptr_with_depth", "batch_get_into_ptr", "batch_exists",
                   "batch_exists_consecutive", "register_memory", "deregister_memory", "clear",
                   "flush"),
    "UMBPConfig": (),
    "UMBPDistributedConfig": (),
    "UMBPMedium": ("DRAM", "SSD"),
}


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def load_umbp() -> Any:
    """Import and return ``mori.umbp``; raises ImportError/OSError/RuntimeError."""
    return importlib.import_module("mori.umbp")


def missing_library(exc: BaseException) -> str | None:
    """The shared library (or symbol version) a loader error names, if it names one."""
    text = str(exc)
    m = _MISSING_LIB.search(text)
    if m:
        return m.group(1)
    m = _MISSING_SYMBOL_VERSION.search(text)
    if m:
        return m.group(1)
    return None


def _load_failure(exc: BaseException) -> Availability:
    lib = missing_library(exc)
    kind = type(exc).__name__
    if lib is None:
        return Availability.unavailable(f"mori.umbp failed to load: {kind}: {exc}",
                                        "check the amd-mori install and the ROCm 7 runtime "
                                        "(libamdhip64.so.7, libhsa-runtime64.so.1)")
    if lib.startswith(("GLIBC_", "GLIBCXX_")):
        return Availability.unavailable(
            f"mori.umbp failed to load: this system's C/C++ runtime lacks {lib} ({kind}: {exc})",
            "amd-mori 1.2.4's wheels need glibc 2.35+ (CPython 3.10, manylinux_2_35) or glibc "
            "2.39+ (CPython 3.12, manylinux_2_39) and a matching libstdc++; use a newer "
            "distribution (Ubuntu 22.04 for 3.10, 24.04 for 3.12)")
    provider = LIBRARY_HINTS.get(lib, "the package that provides it")
    return Availability.unavailable(
        f"mori.umbp failed to load: missing shared library {lib} ({kind}: {exc})",
        f"install {provider}; or add its directory to LD_LIBRARY_PATH")


def probe_umbp() -> tuple[Availability, Any]:
    """Load ``mori.umbp``; (availability, module or None). Never raises."""
    if importlib.util.find_spec("mori") is None:
        py = python_version()
        extra = "" if py in WHEEL_PYTHONS else \
            f" (this is Python {py}; amd-mori has wheels for {', '.join(WHEEL_PYTHONS)} only)"
        return Availability.unavailable("mori (amd-mori) is not installed" + extra,
                                        INSTALL_HINT), None
    try:
        mod = load_umbp()
    except (ImportError, OSError, RuntimeError) as exc:
        return _load_failure(exc), None
    missing = []
    for cls_name, attrs in REQUIRED_API.items():
        cls = getattr(mod, cls_name, None)
        if cls is None:
            missing.append(cls_name)
            continue
        missing += [f"{cls_name}.{a}" for a in attrs if not hasattr(cls, a)]
    if missing:
        version = getattr(sys.modules.get("mori"), "__version__", "unknown")
        return Availability.unavailable(
            f"mori.umbp (amd-mori {version}) lacks {', '.join(missing)}",
            f"upgrade to amd-mori>={MORI_VERSION}"), None
    return Availability.available("mori.umbp loaded"), mod


# --------------------------------------------------------------------------------------------
# The HIP runtime, through ctypes (no torch, no mori): GPU count and host registration.
# --------------------------------------------------------------------------------------------
class HipRuntime:
    """The few HIP runtime calls kvtier needs, on a loaded ``libamdhip64``."""

    def __init__(self, lib: Any, path: str):
        self.lib = lib
        self.path = path

    def device_count(self) -> tuple[int, int]:
        """(error code, count) of hipGetDeviceCount."""
        n = ctypes.c_int(0)
        rc = int(self.lib.hipGetDeviceCount(ctypes.byref(n)))
        return rc, n.value

    def host_register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        """hipHostRegister: page-lock host memory so the GPU can DMA it; returns the code."""
        return int(self.lib.hipHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                            ctypes.c_uint(flags)))

    def host_unregister(self, ptr: int) -> int:
        return int(self.lib.hipHostUnregister(ctypes.c_void_p(ptr)))


def load_hip(libraries: tuple[str, ...] | None = None) -> tuple[HipRuntime | None, str]:
    """Load the HIP runtime; (runtime or None, why not)."""
    errors = []
    for name in HIP_LIBRARIES if libraries is None else libraries:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        missing = [s for s in ("hipGetDeviceCount", "hipHostRegister", "hipHostUnregister")
                   if not hasattr(lib, s)]
        if missing:
            errors.append(f"{name} has no {', '.join(missing)}")
            continue
        return HipRuntime(lib, name), ""
    return None, "HIP runtime not loadable: " + "; ".join(errors)


def amd_gpus(kfd_path: str | None = None,
             libraries: tuple[str, ...] | None = None) -> tuple[int, str]:
    """(number of AMD GPUs the HIP runtime sees, explanation).

    ``/dev/kfd`` first (cheap, and absent when the amdgpu driver is not loaded or the device
    was not passed into the container), then the HIP runtime's own count, which honours
    ``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES``.
    """
    kfd_path = KFD_PATH if kfd_path is None else kfd_path
    if not os.path.exists(kfd_path):
        return 0, (f"no AMD GPU: {kfd_path} does not exist (amdgpu kernel driver not loaded, "
                   "or the device is not passed into this container)")
    hip, why = load_hip(HIP_LIBRARIES if libraries is None else libraries)
    if hip is None:
        return 0, f"no AMD GPU usable: {why}"
    try:
        rc, n = hip.device_count()
    except Exception as exc:  # a broken runtime must not break discovery
        return 0, f"no AMD GPU usable: hipGetDeviceCount raised {type(exc).__name__}: {exc}"
    if rc == HIP_ERROR_NO_DEVICE or (rc == 0 and n == 0):
        return 0, f"no AMD GPU: the HIP runtime ({hip.path}) sees no device"
    if rc != 0:
        return 0, f"no AMD GPU usable: hipGetDeviceCount failed with hipError {rc}"
    return n, f"{n} AMD GPU(s) visible through {hip.path}"
