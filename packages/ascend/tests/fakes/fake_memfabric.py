"""FAKE ``memfabric_hybrid`` (its ``offload`` module) for CPU tests of kvtier-ascend. Not memfabric.

Follows memfabric-hybrid 1.3.0 as shipped in its wheel: the package exposes ``offload`` (a
pybind11 submodule, reached as ``memfabric_hybrid.offload``, not importable on its own) and
``set_extern_logger``/``set_log_level``/``get_and_clear_last_err_msg``. ``offload`` has
``OffloadConfig()`` (attributes ``device_id``, ``reserve_size``, ``alloc_size``, ``scene``,
``flags``, ``rank_id``, ``world_size``, ``local_world_size``, ``store_url``), ``Scene.LOCAL/
SHARED``, ``OFFLOAD_FLAG_GIANT_PAGE``, ``initialize(cfg) -> 0 | -1``, ``uninitialize()``,
``malloc(size, flags=0) -> address | 0``, ``free(ptr, flags=0)``, ``get_dva(ptr) -> dva | 0``,
``empty(sizes, dtype=None, pin_memory=False)`` and ``kv_exchange_copy(meta_tensor, device) ->
int`` (the wrapper passes ``meta.data_ptr()`` and ``device.index`` to the launcher, which queues
the kernel on torch_npu's current stream of that device). Failures are return codes plus log
lines, as in the real library (LOCAL also needs ``reserve_size == alloc_size``).

Memory is real: ``initialize`` reserves a host buffer; ``malloc`` carves blocks out of it;
``get_dva`` maps an address into a separate device address space (``DVA_BASE`` + offset) that
only the fake kernel maps back. The fake kernel implements the metadata semantics of
``acc_offload_kv_exchange.h``: it reads the metadata and the token indices from memory when it
*runs* (not at launch), walks pages/components/layers like the page_first and layer_first
walkers (2 vector cores, block partition and peek-ahead merging of consecutive pages in
layer_first mode, 88 KiB splits) and moves bytes with memmove. It is stricter than the kernel:
a host address outside a live ``malloc`` block's DVA range, a device address inside the host
pool or the DVA space, a non-zero reserved word, an unknown direction or mode, or more than 4
components is a ``FakeKernelFault`` (raised when the work runs, like an NPU error on sync).
"""

from __future__ import annotations

import ctypes
import enum
import types
from typing import Callable

import torch

#: Base of the fake device virtual address space (above any user-space host address).
DVA_BASE = 0x0001_2000_0000_0000
ALIGN = 4096
UB_BUFFER_SIZE = 88 * 1024
START_DIM, BLOCK_DIM = 46, 48                 # A3: blocks 46, 47 do the work
META_HEADER, META_STRIDE, MAX_COMPONENTS = 8, 9, 4
OFFLOAD_FLAG_GIANT_PAGE = 1


class FakeKernelFault(RuntimeError):
    """The fake kernel met an address or metadata value the real one would mis-handle."""


class Scene(enum.IntEnum):
    LOCAL = 0
    SHARED = 1


class OffloadConfig:
    def __init__(self) -> None:
        self.device_id = 0
        self.reserve_size = 0
        self.alloc_size = 0
        self.scene = Scene.LOCAL
        self.flags = 0
        self.rank_id = 0
        self.world_size = 0
        self.local_world_size = 0
        self.store_url = ""


def _cdiv(a: int, b: int) -> int:
    """C++ integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class FakeMemfabric:
    """State of the fake offload entity plus the ``memfabric_hybrid`` module built over it."""

    def __init__(self, num_devices: int = 1):
        self.num_devices = num_devices
        # failure injection
        self.init_failure: list[tuple[int, str]] | None = None   # log lines, initialize -> -1
        self.kernel_library_built = True
        self.next_kv_rc: list[int] = []                          # codes returned by launches
        self.fail_malloc = False
        self.fail_get_dva = False
        self.device_regions: list[tuple[int, int]] = []          # optional strict device check
        # state
        self.initialized = False
        self.config: OffloadConfig | None = None
        self.init_calls = 0
        self.uninit_calls = 0
        self.reservation: torch.Tensor | None = None
        self.base = 0
        self.size = 0
        self.blocks: dict[int, int] = {}                         # hva -> nbytes
        self.freed: list[int] = []
        self.errors: list[str] = []                              # bad frees etc.
        self.launches: list[int] = []                            # meta pointers launched
        self.kernel_runs = 0
        self.copies = 0
        self._graveyard: list[torch.Tensor] = []
        self._logger: Callable[[int, str], None] | None = None
        self.log_lines: list[tuple[int, str]] = []
        self.module = self._build_module()

    # ----- logging --------------------------------------------------------------------------
    def _log(self, level: int, text: str) -> None:
        self.log_lines.append((level, text))
        if self._logger is not None:
            self._logger(level, text)
        else:
            print(f"FAKE-MEMFABRIC {level} {text}")

    # ----- offload API ----------------------------------------------------------------------
    def initialize(self, cfg: OffloadConfig) -> int:
        self.init_calls += 1
        if self.init_failure is not None:
            for level, text in self.init_failure:
                self._log(level, text)
            self._log(5, f"[OFFLOAD acc_offload.cpp:22 offload_init] offload_init ret: -1, "
                         f"deviceId: {cfg.device_id}, reserveSize: {cfg.reserve_size}")
            return -1
        if self.initialized:
            self._log(3, "[OFFLOAD fake] offload entity already initialised")
            return -1
        if not 0 <= cfg.device_id < self.num_devices:
            self._log(3, f"[OFFLOAD acc_offload.cpp] invalid deviceId {cfg.device_id}")
            return -1
        if cfg.scene != Scene.LOCAL:
            self._log(3, f"[OFFLOAD fake] scene {cfg.scene} not modelled by the fake")
            return -1
        if cfg.reserve_size <= 0 or cfg.reserve_size != cfg.alloc_size:
            self._log(3, "[OFFLOAD acc_offload_local_dram_entry.cpp] local dram requires "
                         f"reserveSize == allocSize, reserveSize: {cfg.reserve_size}, "
                         f"allocSize: {cfg.alloc_size}")
            return -1
        self.reservation = torch.empty(cfg.reserve_size + ALIGN, dtype=torch.uint8)
        ptr = self.reservation.data_ptr()
        self.base = -(-ptr // ALIGN) * ALIGN
        self.size = cfg.reserve_size
        self.blocks = {}
        self.config = cfg
        self.initialized = True
        return 0

    def uninitialize(self) -> None:
        self.uninit_calls += 1
        if self.blocks and self.reservation is not None:   # keep live views valid for the test
            self._graveyard.append(self.reservation)
        self.initialized = False
        self.reservation = None
        self.blocks = {}

    def malloc(self, size: int, flags: int = 0) -> int:
        if not self.initialized:
            self._log(3, f"[OFFLOAD acc_offload_entry_manager.cpp:86 MallocHost] entry is null, "
                         f"malloc failed, size: {size}")
            return 0
        if self.fail_malloc or size <= 0:
            self._log(3, f"[OFFLOAD acc_offload_mem_manager.h] memory manager allocate fail, "
                         f"size:{size}")
            return 0
        cursor = self.base
        for ptr in sorted(self.blocks):                      # first fit
            if ptr - cursor >= size:
                break
            cursor = -(-(ptr + self.blocks[ptr]) // ALIGN) * ALIGN
        if cursor + size > self.base + self.size:
            self._log(3, f"[OFFLOAD acc_offload_mem_manager.h] memory manager allocate fail, "
                         f"size:{size}")
            return 0
        self.blocks[cursor] = size
        return cursor

    def free(self, ptr: int, flags: int = 0) -> None:
        if ptr not in self.blocks:
            self.errors.append(f"free of unknown pointer {ptr:#x}")
            self._log(3, "[OFFLOAD acc_offload_mem_manager.h] memory manager release fail, "
                         "not in range")
            return
        del self.blocks[ptr]
        self.freed.append(ptr)

    def get_dva(self, ptr: int) -> int:
        if self.initialized and not self.fail_get_dva and self._block_of(ptr, 1) is not None:
            return ptr - self.base + DVA_BASE
        self._log(3, f"[OFFLOAD acc_offload_entry_manager.cpp:104 GetDva] entry is null or "
                     f"dvaPtr is null, get dva failed, hostPtr: {ptr}")
        return 0

    def empty(self, sizes, dtype=None, pin_memory=False) -> torch.Tensor:
        dtype = dtype or torch.bfloat16
        numel = 1
        for s in sizes:
            numel *= s
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        ptr = self.malloc(nbytes)
        if ptr == 0:
            raise Exception("malloc failed")
        buf = (ctypes.c_int8 * nbytes).from_address(ptr)
        return torch.frombuffer(buf, dtype=dtype).reshape(sizes)

    def kv_exchange_copy(self, meta: torch.Tensor, device: torch.device) -> int:
        """The Python wrapper: ``impl(meta.data_ptr(), device.index)``."""
        return self._kv_exchange_copy_impl(meta.data_ptr(), device.index)

    def _kv_exchange_copy_impl(self, meta_ptr: int, device_id: int) -> int:
        if not isinstance(device_id, int):
            raise TypeError("kv_exchange_copy(): incompatible function arguments "
                            f"(deviceId={device_id!r})")
        if not self.initialized:
            self._log(3, "[OFFLOAD acc_offload_entry_manager.cpp:134 KvExchangeCopy] entry is "
                         "null, kv exchange copy failed")
            return -1
        if not self.kernel_library_built:
            self._log(3, "[OFFLOAD acc_offload_launch_api.cpp] offload launch load library "
                         "failed")
            return -1
        if self.next_kv_rc:
            rc = self.next_kv_rc.pop(0)
            if rc != 0:
                self._log(3, f"[OFFLOAD fake] kv exchange copy launch failed, ret: {rc}")
                return rc
        import sys
        torch_npu = sys.modules.get("torch_npu")
        if torch_npu is None:
            self._log(3, "[OFFLOAD fake] torch_npu is not loaded")
            return -1
        self.launches.append(meta_ptr)
        stream = torch_npu.npu.current_stream(device_id)
        torch_npu.__kvtier_fake__.enqueue(stream, lambda: self._run_kernel(meta_ptr))
        return 0

    # ----- the fake kernel -------------------------------------------------------------------
    def _block_of(self, hva: int, nbytes: int) -> int | None:
        for ptr, size in self.blocks.items():
            if ptr <= hva and hva + nbytes <= ptr + size:
                return ptr
        return None

    def _host(self, dva: int, nbytes: int) -> int:
        hva = dva - DVA_BASE + self.base
        if not DVA_BASE <= dva < DVA_BASE + self.size or self._block_of(hva, nbytes) is None:
            raise FakeKernelFault(
                f"host range {dva:#x}+{nbytes} is not inside a live offload block's DVA range"
                + (" (an HVA where the kernel needs a DVA?)" if self._in_pool(dva) else ""))
        return hva

    def read_dva(self, dva: int, nbytes: int) -> bytes:
        """The bytes a device would read at ``dva`` (for tests)."""
        return ctypes.string_at(self._host(dva, nbytes), nbytes)

    def _in_pool(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.size

    def _device(self, addr: int, nbytes: int) -> int:
        if addr <= 0 or self._in_pool(addr) or self._in_pool(addr + nbytes - 1) \
                or addr >= DVA_BASE:
            raise FakeKernelFault(f"device range {addr:#x}+{nbytes} is not device memory")
        if self.device_regions and not any(lo <= addr and addr + nbytes <= hi
                                           for lo, hi in self.device_regions):
            raise FakeKernelFault(f"device range {addr:#x}+{nbytes} is outside every "
                                  "registered device buffer")
        return addr

    @staticmethod
    def _read(ptr: int, i: int) -> int:
        return ctypes.c_int64.from_address(ptr + 8 * i).value

    def _run_kernel(self, meta_ptr: int) -> None:
        self.kernel_runs += 1
        rd = lambda i: self._read(meta_ptr, i)
        ncomp, npages, S, direction, dev_idx, host_idx, mode, reserved = (rd(i) for i in range(8))
        if reserved != 0:
            raise FakeKernelFault(f"reserved metadata word is {reserved}, must be 0")
        if direction not in (1, 2):
            raise FakeKernelFault(f"direction {direction} is neither 1 (H2D) nor 2 (D2H)")
        if mode not in (0, 1):
            raise FakeKernelFault(f"host_layout_mode {mode} is neither 0 nor 1")
        if not 0 <= ncomp <= MAX_COMPONENTS:
            raise FakeKernelFault(f"{ncomp} components (at most {MAX_COMPONENTS})")
        if npages <= 0 or ncomp <= 0:
            return
        if S <= 0 or dev_idx == 0 or host_idx == 0:
            raise FakeKernelFault(f"page_size {S}, index pointers {dev_idx:#x}/{host_idx:#x}")
        comps = []
        for c in range(ncomp):
            o = META_HEADER + META_STRIDE * c
            comps.append([rd(o + k) for k in range(META_STRIDE)])
        live = [c for c in comps if not (c[6] <= 0 or c[7] >= c[8])]

        def pages(p: int) -> tuple[int, int]:
            return (_cdiv(self._read(dev_idx, p * S), S), _cdiv(self._read(host_idx, p * S), S))

        def move(c: list[int], layer: int, dpage: int, hpage: int, width: int) -> None:
            dbase, hbase, dlp, dpp, hpp, hlp = c[:6]
            drow = dbase + layer * dlp + dpage * dpp
            hrow = hbase + hpage * hpp + layer * hlp
            for off in range(0, width, UB_BUFFER_SIZE):
                n = min(UB_BUFFER_SIZE, width - off)
                d = self._device(drow + off, n)
                h = self._host(hrow + off, n)
                src, dst = (d, h) if direction == 2 else (h, d)
                ctypes.memmove(dst, src, n)
                self.copies += 1

        cores = BLOCK_DIM - START_DIM
        if mode == 0:                       # page-outer, round-robin over cores
            for core in range(cores):
                for p in range(core, npages, cores):
                    dpage, hpage = pages(p)
                    for c in live:
                        for layer in range(c[7], c[8]):
                            move(c, layer, dpage, hpage, c[6])
            return
        per, rem = divmod(npages, cores)    # layer-outer, block partition, merged runs
        for core in range(cores):
            start = core * (per + 1) if core < rem else rem * (per + 1) + (core - rem) * per
            end = start + (per + 1 if core < rem else per)
            for c in live:
                for layer in range(c[7], c[8]):
                    pos = start
                    while pos < end:
                        dpage, hpage = pages(pos)
                        merge = 1
                        while pos + merge < end:
                            nd, nh = pages(pos + merge)
                            if nh != hpage + merge or nd != dpage + merge:
                                break
                            merge += 1
                        move(c, layer, dpage, hpage, merge * c[6])
                        pos += merge

    # ----- module ---------------------------------------------------------------------------
    def _build_module(self) -> types.ModuleType:
        off = types.ModuleType("_pymf_acc_offload.offload")
        off.__doc__ = "FAKE memfabric_hybrid.offload (kvtier-ascend tests)"
        off.OffloadConfig = OffloadConfig
        off.Scene = Scene
        off.LOCAL, off.SHARED = Scene.LOCAL, Scene.SHARED
        off.OFFLOAD_FLAG_GIANT_PAGE = OFFLOAD_FLAG_GIANT_PAGE
        for name in ("initialize", "uninitialize", "malloc", "free", "get_dva", "empty",
                     "kv_exchange_copy"):
            setattr(off, name, getattr(self, name))
        mod = types.ModuleType("memfabric_hybrid")
        mod.__doc__ = "FAKE memfabric_hybrid 1.3.0 (kvtier-ascend tests)"
        mod.offload = off
        mod.set_extern_logger = self._set_logger
        mod.set_log_level = lambda level: 0
        mod.get_last_err_msg = lambda: ""
        mod.get_and_clear_last_err_msg = lambda: ""
        mod.__kvtier_fake__ = self
        return mod

    def _set_logger(self, fn: Callable[[int, str], None]) -> int:
        self._logger = fn
        return 0


#: What the real 1.3.0 logs when initialize meets a machine without a usable Ascend driver.
NO_DRIVER_LOG = [
    (3, "[HYBM hybm_gva_version.cpp:203 HalGvaPrecheck] Failed to determine driver version"),
    (3, "[HYBM hybm_entry.cpp:97 hybm_init] the current version of ascend driver does not "
        "support mf!"),
    (3, "[OFFLOAD acc_offload_local_dram_entry.cpp:41 Initialize] init hybm failed, result: -1"),
    (2, "[HYBM hybm_entry.cpp:124 hybm_uninit] hybm not initialized."),
    (3, "[OFFLOAD acc_offload_entry_manager.cpp:54 Initialize] entry initialize failed, "
        "scene: 0, ret: -1"),
]

FakeMemfabric.NO_DRIVER_LOG = NO_DRIVER_LOG
