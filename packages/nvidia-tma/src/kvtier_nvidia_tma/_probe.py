"""What the NVIDIA backends need, checked for real: driver, devices, compute capability, NVRTC."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from kvtier import Availability

CUDA_HINT = "install the NVIDIA driver (libcuda.so.1) on a machine with an NVIDIA GPU"
NVRTC_HINT = "pip install 'kvtier-nvidia-tma[runtime]' (cuda-bindings and nvidia-cuda-nvrtc)"


@dataclass(frozen=True)
class DeviceInfo:
    count: int
    major: int
    minor: int
    name: str


def driver() -> ctypes.CDLL:
    """Load libcuda.so.1 and cuInit it; raises OSError/RuntimeError saying what is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise OSError(f"no CUDA driver found (libcuda.so.1): {exc}") from None
    rc = lib.cuInit(0)
    if rc != 0:
        raise RuntimeError(f"cuInit failed with CUresult {rc} (no usable NVIDIA GPU?)")
    return lib


def device_info(ordinal: int = 0) -> DeviceInfo:
    lib = driver()
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        raise RuntimeError(f"no CUDA device found (cuDeviceGetCount -> {rc}, "
                           f"count {count.value})")
    dev = ctypes.c_int(0)
    lib.cuDeviceGet(ctypes.byref(dev), ordinal)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)   # COMPUTE_CAPABILITY_MAJOR
    lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)   # COMPUTE_CAPABILITY_MINOR
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, dev)
    return DeviceInfo(count.value, major.value, minor.value, name.value.decode(errors="replace"))


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; raises ImportError/RuntimeError when NVRTC can't be used."""
    from cuda.bindings import nvrtc   # imported here only: never on `import kvtier`
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return major, minor


def probe_cuda(min_cc: tuple[int, int] = (0, 0), what: str = "", *, need_nvrtc: bool = True
               ) -> Availability:
    """Driver, device count, compute capability, cuda-bindings and (for kernels) NVRTC, in
    that order; the first that is missing is the reason."""
    try:
        info = device_info()
    except (OSError, RuntimeError) as exc:
        return Availability.unavailable(str(exc), CUDA_HINT)
    if (info.major, info.minor) < min_cc:
        return Availability.unavailable(
            f"{info.name} is sm_{info.major}{info.minor}; {what} needs sm_{min_cc[0]}{min_cc[1]}+",
            "use nvidia-register or nvidia-copy-engine on this GPU")
    try:
        from cuda.bindings import driver  # noqa: F401  (the engines' driver API)
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(f"cuda-bindings unavailable: {exc}", NVRTC_HINT)
    note = f"{info.name} sm_{info.major}{info.minor}, {info.count} device(s)"
    if not need_nvrtc:
        return Availability.available(note)
    try:
        nv = nvrtc_version()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(f"NVRTC unavailable: {exc}", NVRTC_HINT)
    return Availability.available(f"{note}, NVRTC {nv[0]}.{nv[1]}")
