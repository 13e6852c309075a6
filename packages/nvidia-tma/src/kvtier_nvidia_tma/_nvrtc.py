"""Run-time compilation of the package's CUDA sources with NVRTC, cached on disk.

No nvcc is needed at install time: ``kernels/*.cu`` ship as package data and are compiled for
the device's architecture on first use. Cubins are cached under ``$KVTIER_CACHE_DIR/nvrtc``
(default ``~/.cache/kvtier/nvrtc``), keyed by the sources' hash, the options (architecture
included) and NVRTC's version, so a toolkit upgrade or an edited kernel recompiles.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvtier.errors import KVTierError

KERNEL_DIR = Path(__file__).with_name("kernels")
#: Kernel sources, each with the extern "C" entry points it defines.
SOURCES: dict[str, tuple[str, ...]] = {
    "register_copy.cu": ("kvt_register_u2", "kvt_register_u4", "kvt_register_u8"),
    "tma_copy.cu": ("kvt_tma_copy",),
    "hold.cu": ("kvt_hold", "kvt_read_latency"),   # measurement only (limits.py)
}
#: Minimum compute capability per source (TMA bulk copies are sm_90+).
MIN_ARCH: dict[str, int] = {"register_copy.cu": 70, "tma_copy.cu": 90, "hold.cu": 70}


class CompileError(KVTierError, RuntimeError):
    """NVRTC rejected a kernel (or none fits the device); carries the compiler log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log = log


@dataclass(frozen=True)
class Compiled:
    source: str
    arch: str                 # e.g. "sm_90" (cubin) or "compute_90" (PTX for the driver to JIT)
    image: bytes
    key: str
    cached: bool


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvtier"
    return base / "nvrtc"


def nvrtc():
    from cuda.bindings import nvrtc as mod   # only here: importing the package loads no CUDA
    return mod


def version() -> tuple[int, int]:
    nv = nvrtc()
    err, major, minor = nv.nvrtcVersion()
    _check(nv, err, "nvrtcVersion")
    return int(major), int(minor)


def supported_archs() -> list[int]:
    nv = nvrtc()
    err, archs = nv.nvrtcGetSupportedArchs()
    _check(nv, err, "nvrtcGetSupportedArchs")
    return sorted(int(a) for a in archs)


def target_for(cc: int, source: str) -> str:
    """NVRTC target for a device of compute capability ``cc`` (e.g. 90): its own cubin when
    NVRTC knows the architecture, else PTX of the newest one it knows (the driver JITs it)."""
    if cc < MIN_ARCH[source]:
        raise CompileError(f"{source} needs sm_{MIN_ARCH[source]}+, device is sm_{cc}")
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}"
    older = [a for a in archs if a <= cc]
    if not older:
        raise CompileError(f"NVRTC {version()} supports none of the architectures <= sm_{cc}")
    return f"compute_{older[-1]}"


def _check(nv, err, what: str) -> None:
    if err != nv.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


def _source_blob(source: str) -> bytes:
    """The source plus every header in the kernel directory (they are all it may include)."""
    parts = [(KERNEL_DIR / source).read_bytes()]
    for h in sorted(KERNEL_DIR.glob("*.cuh")):
        parts.append(h.name.encode() + b"\0" + h.read_bytes())
    return b"\0\0".join(parts)


def options(arch: str, defines: dict[str, int] | None = None) -> list[str]:
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device",
            f"--include-path={KERNEL_DIR}"]
    for k, v in sorted((defines or {}).items()):
        opts.append(f"-D{k}={int(v)}")
    return opts


_lock = threading.Lock()


def compile_source(source: str, arch: str, defines: dict[str, int] | None = None, *,
                   use_cache: bool = True) -> Compiled:
    """Compile one kernel source for ``arch`` (``sm_XY`` -> cubin, ``compute_XY`` -> PTX)."""
    if source not in SOURCES:
        raise CompileError(f"unknown kernel source {source!r}; have {sorted(SOURCES)}")
    nv = nvrtc()
    ver = version()
    opts = options(arch, defines)
    h = hashlib.sha256(_source_blob(source))
    h.update(repr(([o for o in opts if not o.startswith("--include-path")], ver)).encode())
    key = f"{Path(source).stem}-{arch}-{h.hexdigest()[:24]}"
    ext = ".cubin" if arch.startswith("sm_") else ".ptx"
    path = cache_dir() / (key + ext)
    if use_cache:
        try:
            return Compiled(source, arch, path.read_bytes(), key, True)
        except OSError:
            pass
    with _lock:
        image = _compile(nv, source, opts, arch.startswith("sm_"))
    if use_cache:
        _write_atomic(path, image)
    return Compiled(source, arch, image, key, False)


def _compile(nv, source: str, opts: Sequence[str], cubin: bool) -> bytes:
    src = (KERNEL_DIR / source).read_bytes()
    err, prog = nv.nvrtcCreateProgram(src, source.encode(), 0, [], [])
    _check(nv, err, "nvrtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        (err,) = nv.nvrtcCompileProgram(prog, len(bopts), bopts)
        _, n = nv.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nv.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").strip("\0 \n")
        if err != nv.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {source} ({' '.join(opts[:1])})",
                               log_text)
        if cubin:
            _, size = nv.nvrtcGetCUBINSize(prog)
            out = b" " * size
            (err,) = nv.nvrtcGetCUBIN(prog, out)
        else:
            _, size = nv.nvrtcGetPTXSize(prog)
            out = b" " * size
            (err,) = nv.nvrtcGetPTX(prog, out)
        _check(nv, err, "nvrtcGetCUBIN/PTX")
        return bytes(out)
    finally:
        nv.nvrtcDestroyProgram(prog)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so concurrent processes never read a torn file.
    A cache that cannot be written is not an error (the image is still returned)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
