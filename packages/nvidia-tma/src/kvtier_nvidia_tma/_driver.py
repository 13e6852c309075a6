"""Thin helpers over the CUDA driver API (``cuda.bindings.driver``), imported only by backends.

Modules are loaded into the device's primary context (the one PyTorch uses) and launched on
the caller's stream. ``cuTensorMapEncodeTiled`` and ``cuMemcpyBatchAsync`` are called through
ctypes on libcuda: the first needs a 64-byte aligned output the bindings do not guarantee,
the second takes address arrays straight from NumPy (no Python object per copy).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from kvtier.errors import TransferError

from . import _nvrtc
from ._plan import TensorMapGeometry


def drv():
    from cuda.bindings import driver   # only in backend code paths
    return driver


def check(result: Any, what: str, backend: str = "nvidia") -> Any:
    """Unpack a cuda.bindings result tuple; raise TransferError naming the CUresult."""
    d = drv()
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != d.CUresult.CUDA_SUCCESS:
        _, name = d.cuGetErrorName(err)
        label = name.decode() if isinstance(name, bytes) else str(err)
        raise TransferError(f"{backend}: {what} failed: {label}", backend=backend,
                            code=int(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@dataclass
class Device:
    """A CUDA device's primary context and the attributes the engines need."""

    ordinal: int
    handle: Any
    ctx: Any
    cc: int
    sms: int
    max_smem_optin: int
    host_ptr_ok: bool          # registered host memory has the same address on the device
    name: str

    def make_current(self) -> None:
        d = drv()
        cur = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(cur) != int(self.ctx):
            check(d.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")


_devices: dict[int, Device] = {}
_dev_lock = threading.Lock()


def device(ordinal: int) -> Device:
    with _dev_lock:
        if ordinal in _devices:
            return _devices[ordinal]
        d = drv()
        check(d.cuInit(0), "cuInit")
        count = check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise TransferError(f"CUDA device {ordinal} does not exist ({count} device(s))",
                                backend="nvidia")
        h = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        ctx = check(d.cuDevicePrimaryCtxRetain(h), "cuDevicePrimaryCtxRetain")
        A = d.CUdevice_attribute

        def attr(a):
            return int(check(d.cuDeviceGetAttribute(a, h), "cuDeviceGetAttribute"))
        major = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        name = check(d.cuDeviceGetName(256, h), "cuDeviceGetName")
        dev = Device(ordinal, h, ctx, major * 10 + minor,
                     attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                     attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                     bool(attr(A.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)),
                     name.split(b"\0")[0].decode(errors="replace"))
        _devices[ordinal] = dev
        return dev


# ----------------------------------------------------------------------------------------------
# Modules and launches
# ----------------------------------------------------------------------------------------------
@dataclass
class Kernel:
    func: Any
    name: str
    arch: str
    num_regs: int
    local_bytes: int
    smem_set: int = 0


_modules: dict[tuple[int, str], tuple[Any, dict[str, Kernel]]] = {}
_mod_lock = threading.Lock()


def load_kernel(dev: Device, source: str, name: str, defines: dict[str, int] | None = None
                ) -> Kernel:
    """Compile (or take from the disk cache) and load ``name`` from ``source`` for ``dev``."""
    arch = _nvrtc.target_for(dev.cc, source)
    compiled = _nvrtc.compile_source(source, arch, defines)
    key = (dev.ordinal, compiled.key)
    with _mod_lock:
        if key not in _modules:
            dev.make_current()
            image = compiled.image if arch.startswith("sm_") else compiled.image + b"\0"
            mod = check(drv().cuModuleLoadData(image), f"cuModuleLoadData({source})")
            _modules[key] = (mod, {})
        mod, funcs = _modules[key]
        if name not in funcs:
            d = drv()
            f = check(d.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
            FA = d.CUfunction_attribute
            regs = check(d.cuFuncGetAttribute(FA.CU_FUNC_ATTRIBUTE_NUM_REGS, f), "attr")
            local = check(d.cuFuncGetAttribute(FA.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "attr")
            funcs[name] = Kernel(f, name, arch, int(regs), int(local))
        return funcs[name]


def set_dynamic_smem(k: Kernel, nbytes: int) -> None:
    if nbytes > k.smem_set:
        d = drv()
        check(d.cuFuncSetAttribute(
            k.func, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            nbytes), "cuFuncSetAttribute(max dynamic shared memory)")
        k.smem_set = nbytes


def launch(k: Kernel, grid: int, threads: int, smem: int, stream: int, *args: Any) -> None:
    """Launch with each argument given as a ctypes object (copied at launch time)."""
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    d = drv()
    check(d.cuLaunchKernel(k.func, grid, 1, 1, threads, 1, 1, smem, d.CUstream(stream),
                           ctypes.addressof(ptrs), 0), f"cuLaunchKernel({k.name})")


def stream_wait_geq(stream: int, addr: int, value: int) -> None:
    """Work queued on ``stream`` after this waits until the u32 at device address ``addr``
    reaches ``value`` (cyclic >=; ``cuStreamWaitValue32``)."""
    d = drv()
    check(d.cuStreamWaitValue32(d.CUstream(stream), d.CUdeviceptr(addr), value,
                                d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue32")


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------
def host_device_pointer(ptr: int) -> int | None:
    """Device-visible address of registered/pinned host memory, or None if CUDA does not
    know the address (pageable memory)."""
    d = drv()
    PA = d.CUpointer_attribute
    res = d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if res[0] != d.CUresult.CUDA_SUCCESS or int(res[1]) != int(d.CUmemorytype.CU_MEMORYTYPE_HOST):
        return None
    res = d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ptr)
    if res[0] != d.CUresult.CUDA_SUCCESS:
        return None
    return int(res[1])


def register_host(ptr: int, nbytes: int) -> None:
    d = drv()
    flags = d.CU_MEMHOSTREGISTER_PORTABLE | d.CU_MEMHOSTREGISTER_DEVICEMAP
    check(d.cuMemHostRegister(ptr, nbytes, flags), f"cuMemHostRegister({nbytes} B)",
          "cuda-host-register")


def unregister_host(ptr: int) -> None:
    d = drv()
    check(d.cuMemHostUnregister(ptr), "cuMemHostUnregister", "cuda-host-register")


# ----------------------------------------------------------------------------------------------
# libcuda through ctypes
# ----------------------------------------------------------------------------------------------
_libcuda: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


CU_TENSOR_MAP_DATA_TYPE_UINT64 = 4


class TensorMap:
    """A 64-byte aligned CUtensorMap (128 bytes) passed by value as a kernel argument."""

    SIZE = 128

    def __init__(self, geo: TensorMapGeometry | None = None):
        self._raw = (ctypes.c_ubyte * (self.SIZE + 64))()
        addr = ctypes.addressof(self._raw)
        self.address = (addr + 63) & ~63
        self.arg = (ctypes.c_ubyte * self.SIZE).from_address(self.address)
        self.geometry = geo
        if geo is not None:
            self._encode(geo)

    def _encode(self, g: TensorMapGeometry) -> None:
        lib = libcuda()
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        u64x4, u64x3, u32x4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
        rc = f(ctypes.c_void_p(self.address), ctypes.c_int(CU_TENSOR_MAP_DATA_TYPE_UINT64),
               ctypes.c_uint32(4), ctypes.c_void_p(g.base), u64x4(*g.dims), u64x3(*g.strides),
               u32x4(*g.box), u32x4(1, 1, 1, 1), ctypes.c_int(0),   # no interleave
               ctypes.c_int(0),                                     # no swizzle
               ctypes.c_int(2),                                     # L2 promotion 128B
               ctypes.c_int(0))                                     # OOB fill: zeros
        if rc != 0:
            raise TransferError(f"nvidia-tma: cuTensorMapEncodeTiled failed (CUresult {rc}) "
                                f"for {g}", backend="nvidia-tma", code=rc)


class _MemcpyAttributes(ctypes.Structure):
    # CUmemcpyAttributes: srcAccessOrder, srcLocHint{type,id}, dstLocHint{type,id}, flags
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocType", ctypes.c_int),
                ("srcLocId", ctypes.c_int), ("dstLocType", ctypes.c_int),
                ("dstLocId", ctypes.c_int), ("flags", ctypes.c_uint)]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
#: ``attrsIdxs`` of every batch call: one attribute, from the first copy on (read only by the
#: driver, so one object serves every call).
_ATTR_INDEX = ctypes.c_size_t(0)


def batch_sizes(n: int, max_batch: int = 0, first: int = 0) -> list[int]:
    """Copies per ``cuMemcpyBatchAsync`` call for ``n`` copies: at most ``max_batch`` each (0:
    no limit); with ``first`` > 0 the first call queues ``first`` copies and each next one 4x
    more, so the DMA engines start once a few copies are queued instead of a whole batch
    (queuing costs the host 0.5-0.95 us per copy on the H200, about a 32 KiB copy's time on the
    link)."""
    cap = max_batch if max_batch > 0 else n
    out, k, left = [], min(first, cap) if first > 0 else cap, n
    while left > 0:
        take = min(k, left)
        out.append(take)
        left -= take
        k = min(cap, k * 4)
    return out


#: ``CUDA_MEMCPY3D_BATCH_OP`` (cuda.h, CUDA 12.8+) with two pointer operands: per operand the
#: operand type (1: pointer), the address, the row length (bytes from one row to the next: a
#: pitch) and the layer height (rows), the location hint left zero; then the extent (width in
#: bytes, height in rows, depth), the source access order and flags. 112 bytes.
OP3D = np.dtype({
    "names": ["src_type", "src_ptr", "src_row", "src_height", "dst_type", "dst_ptr", "dst_row",
              "dst_height", "width", "height", "depth", "order", "flags"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8",
                "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 40, 48, 56, 64, 80, 88, 96, 104, 108],
    "itemsize": 112})
CU_MEMCPY_OPERAND_TYPE_POINTER = 1


def pointer_ops(src, dst, src_row, dst_row, width, height) -> np.ndarray:
    """:data:`OP3D` copies between pointers, one per element of ``src``/``dst`` (the other
    arguments broadcast): ``height`` rows of ``width`` bytes, ``src_row``/``dst_row`` bytes
    apart, in stream order."""
    src = np.asarray(src)
    ops = np.zeros(src.size, dtype=OP3D)
    ops["src_type"] = ops["dst_type"] = CU_MEMCPY_OPERAND_TYPE_POINTER
    ops["src_ptr"], ops["dst_ptr"] = src, dst
    ops["src_row"], ops["dst_row"] = src_row, dst_row
    ops["src_height"] = ops["dst_height"] = ops["height"] = height
    ops["width"] = width
    ops["depth"] = 1
    ops["order"] = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    return ops


def max_pitch(dev: Device) -> int:
    """The largest row pitch (bytes) a strided copy may use on ``dev``."""
    d = drv()
    return int(check(d.cuDeviceGetAttribute(
        d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev.handle), "cuDeviceGetAttribute"))


class StridedCopier:
    """``cuMemcpy3DBatchAsync`` (CUDA 12.8+ drivers; the CUDA 13 ``_v2`` entry point has no
    failIdx): batches of strided copies, each ``height`` rows of ``width`` bytes at a pitch of
    its own on each side (:data:`OP3D`). ``available`` is False (with ``why``) where the driver
    has no such entry point."""

    def __init__(self) -> None:
        lib = libcuda()
        self._fn = None
        self.kind = ""
        for sym, kind in (("cuMemcpy3DBatchAsync_v2", "v2"), ("cuMemcpy3DBatchAsync", "v1")):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                self._fn, self.kind = fn, kind
                break
        self.why = "" if self._fn is not None else "the driver has no cuMemcpy3DBatchAsync"

    @property
    def available(self) -> bool:
        return self._fn is not None

    def __call__(self, ops: np.ndarray, stream: int, max_batch: int = 0, first: int = 0) -> None:
        """Queue ``ops`` (an :data:`OP3D` array) on ``stream`` in calls of
        :func:`batch_sizes` copies."""
        if self._fn is None:
            raise TransferError(f"nvidia-copy-engine: {self.why}", backend="nvidia-copy-engine")
        ops = np.ascontiguousarray(ops, dtype=OP3D)
        i = 0
        for k in batch_sizes(int(ops.size), max_batch, first):
            args: list[Any] = [ctypes.c_size_t(k),
                               ctypes.c_void_p(ops.ctypes.data + i * OP3D.itemsize)]
            if self.kind == "v1":
                fail = ctypes.c_size_t(0)
                args.append(ctypes.byref(fail))
            args += [ctypes.c_ulonglong(0), ctypes.c_void_p(stream)]
            rc = self._fn(*args)
            if rc != 0:
                raise TransferError(f"nvidia-copy-engine: cuMemcpy3DBatchAsync failed "
                                    f"(CUresult {rc})", backend="nvidia-copy-engine", code=rc)
            i += k


class BatchCopier:
    """``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers; the CUDA 13 ``_v2`` entry point has no
    failIdx) with a per-copy ``cuMemcpyAsync`` loop where the driver has neither."""

    def __init__(self) -> None:
        lib = libcuda()
        self.kind = "loop"
        self._fn: Any = None
        for sym, kind in (("cuMemcpyBatchAsync_v2", "batch-v2"), ("cuMemcpyBatchAsync", "batch")):
            try:
                fn = getattr(lib, sym)
            except AttributeError:
                continue
            fn.restype = ctypes.c_int
            self._fn, self.kind = fn, kind
            break
        self._attr = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._copy = lib.cuMemcpyAsync
        self._copy.restype = ctypes.c_int

    def __call__(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int,
                 max_batch: int = 0, first: int = 0) -> None:
        """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` on ``stream``, in batches of at
        most ``max_batch`` copies (0: one batch); with ``first``, the batches start at
        ``first`` copies and grow 4x each call up to that (see :func:`batch_sizes`)."""
        n = int(sizes.size)
        if n == 0:
            return
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        i = 0
        for k in batch_sizes(n, max_batch, first):
            self._batch(dst[i:i + k], src[i:i + k], sizes[i:i + k], stream)
            i += k

    def queue_layers(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray,
                     bounds: Sequence[int], stream: int, max_batch: int = 0, first: int = 0,
                     after: Callable[[int], None] | None = None) -> None:
        """Copies ``bounds[l]:bounds[l + 1]`` of the arrays, layer by layer, each layer as
        :meth:`__call__` queues it, with ``after(l)`` once layer ``l``'s copies are queued (an
        event per layer). The arrays are made contiguous once and each batch call gets its
        addresses by offset, not from NumPy slices and ctypes casts of its own: a per-layer
        transfer makes a call per layer, and its host time is what bounds it on an idle
        GPU."""
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        pd, ps, pz = dst.ctypes.data, src.ctypes.data, sizes.ctypes.data
        step = np.dtype(np.uint64).itemsize
        for layer in range(len(bounds) - 1):
            a, b = int(bounds[layer]), int(bounds[layer + 1])
            for k in batch_sizes(b - a, max_batch, first):
                o = step * a
                if self._fn is None or not self._call(pd + o, ps + o, pz + o, k, stream):
                    self._batch(dst[a:a + k], src[a:a + k], sizes[a:a + k], stream)
                a += k
            if after is not None:
                after(layer)

    def _call(self, dst: int, src: int, sizes: int, n: int, stream: int) -> bool:
        """One batch call over ``n`` copies whose address and size arrays start at these
        addresses. False where the driver does not support it (``CUDA_ERROR_NOT_SUPPORTED``):
        the per-copy loop is used from then on."""
        args: list[Any] = [ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_void_p(sizes),
                           ctypes.c_size_t(n), ctypes.byref(self._attr),
                           ctypes.byref(_ATTR_INDEX), ctypes.c_size_t(1)]
        if self.kind == "batch":
            args.append(ctypes.byref(ctypes.c_size_t(0)))     # failIdx (CUDA 12.8 form)
        args.append(ctypes.c_void_p(stream))
        rc = self._fn(*args)
        if rc == 801:
            self._fn, self.kind = None, "loop"
            return False
        if rc != 0:
            raise TransferError(f"nvidia-copy-engine: cuMemcpyBatchAsync failed "
                                f"(CUresult {rc})", backend="nvidia-copy-engine", code=rc)
        return True

    def _batch(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if self._fn is not None and self._call(dst.ctypes.data, src.ctypes.data,
                                               sizes.ctypes.data, int(sizes.size), stream):
            return
        for a, b, s in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            rc = self._copy(ctypes.c_uint64(a), ctypes.c_uint64(b), ctypes.c_size_t(s),
                            ctypes.c_void_p(stream))
            if rc != 0:
                raise TransferError(f"nvidia-copy-engine: cuMemcpyAsync failed (CUresult {rc})",
                                    backend="nvidia-copy-engine", code=rc)
