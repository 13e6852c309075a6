"""`mmap`: anonymous memory mapped through libc, with 2 MiB hugepages when the system has them.

Hugepages are tried in order: a hugetlbfs mapping (``MAP_HUGETLB``, 2 MiB pages reserved by the
administrator in ``/proc/sys/vm/nr_hugepages``), then transparent hugepages
(``madvise(MADV_HUGEPAGE)``), then plain 4 KiB pages. Whatever the kernel really gave is what
``HostBuffer.backing`` says; a hugepage request that ended on 4 KiB pages is logged once per
process (WARNING) and recorded in ``HostBuffer.details``, never hidden.

Sizes are rounded only to the page size actually used (4 KiB, or 2 MiB for hugepages), never
to a power of two, so tens of GiB cost what they say. Optional NUMA binding goes through
libnuma's ``mbind`` where libnuma is installed; ``numa_node`` reports the node the pages were
seen on (or bound to), ``None`` when unknown. Prefaulting uses ``MADV_POPULATE_WRITE`` (Linux
5.14+; a failure is an error, not a later SIGBUS), else touches one byte per page, optionally
from several threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap as _mmap
import os
import platform
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import AllocationError, ConfigError
from ..logutil import warn_once
from ..interfaces import INTERFACE_VERSION, Availability, HostAllocator, HostBuffer

log = logging.getLogger(__name__)

HUGE_2M = 2 << 20
BASE_PAGE = _mmap.PAGESIZE

_PROT_RW = _mmap.PROT_READ | _mmap.PROT_WRITE
_MAP_PRIVATE = _mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(_mmap, "MAP_ANONYMOUS", 0x20)
# MAP_HUGETLB is 0x40000 on x86, arm64, riscv, loongarch and s390; other arches differ.
_MAP_HUGETLB = getattr(_mmap, "MAP_HUGETLB", 0x40000)
_MAP_HUGE_SHIFT = 26
_MAP_HUGE_2MB = 21 << _MAP_HUGE_SHIFT
_MADV_HUGEPAGE = getattr(_mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(_mmap, "MADV_POPULATE_WRITE", 23)
_MAP_FAILED = ctypes.c_void_p(-1).value
_HUGE_ARCHES = {"x86_64", "amd64", "aarch64", "arm64", "riscv64", "loongarch64", "s390x"}

# NUMA constants (linux/mempolicy.h)
_MPOL_BIND = 2
_MPOL_F_NODE = 1 << 0
_MPOL_F_ADDR = 1 << 1
_MPOL_MF_STRICT = 1 << 0
_MPOL_MF_MOVE = 1 << 1



def _warn_once(what: str, message: str) -> None:
    warn_once(log, what, message)


# --------------------------------------------------------------------------------------------
# libc / libnuma through ctypes
# --------------------------------------------------------------------------------------------
class _Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib = lib

    def mmap(self, length: int, flags: int) -> tuple[int | None, int]:
        """(address, 0) or (None, errno)."""
        ctypes.set_errno(0)
        addr = self.lib.mmap(None, length, _PROT_RW, flags, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            return None, ctypes.get_errno()
        return addr, 0

    def munmap(self, addr: int, length: int) -> int:
        return 0 if self.lib.munmap(addr, length) == 0 else ctypes.get_errno()

    def madvise(self, addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(0)
        return 0 if self.lib.madvise(addr, length, advice) == 0 else ctypes.get_errno()


class _Numa:
    """The few libnuma calls used here; ``None`` from :func:`_numa` when libnuma is absent."""

    def __init__(self, lib: ctypes.CDLL):
        lib.numa_available.restype = ctypes.c_int
        lib.numa_max_node.restype = ctypes.c_int
        lib.mbind.restype = ctypes.c_long
        lib.mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong, ctypes.c_uint]
        lib.get_mempolicy.restype = ctypes.c_long
        lib.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong,
                                      ctypes.c_void_p, ctypes.c_ulong]
        self.lib = lib
        self.max_node = int(lib.numa_max_node())

    def mbind(self, addr: int, length: int, node: int, strict: bool) -> int:
        words = node // 64 + 1
        mask = (ctypes.c_ulong * words)()
        mask[node // 64] = 1 << (node % 64)
        flags = (_MPOL_MF_STRICT | _MPOL_MF_MOVE) if strict else 0
        ctypes.set_errno(0)
        rc = self.lib.mbind(addr, length, _MPOL_BIND, mask, words * 64 + 1, flags)
        return 0 if rc == 0 else ctypes.get_errno()

    def node_of(self, addr: int) -> int | None:
        """The node of the (already faulted) page at ``addr``."""
        node = ctypes.c_int(-1)
        rc = self.lib.get_mempolicy(ctypes.byref(node), None, 0, addr,
                                    _MPOL_F_NODE | _MPOL_F_ADDR)
        return int(node.value) if rc == 0 and node.value >= 0 else None


_libc_cache: _Libc | None = None
_numa_cache: tuple[_Numa | None, str] | None = None


def _libc() -> _Libc:
    global _libc_cache
    if _libc_cache is None:
        _libc_cache = _Libc()
    return _libc_cache


def _numa() -> tuple[_Numa | None, str]:
    """(libnuma wrapper, "") or (None, why not)."""
    global _numa_cache
    if _numa_cache is None:
        name = ctypes.util.find_library("numa") or "libnuma.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            if lib.numa_available() < 0:
                _numa_cache = (None, "libnuma reports no NUMA support on this system")
            else:
                _numa_cache = (_Numa(lib), "")
        except (OSError, AttributeError) as exc:
            _numa_cache = (None, f"libnuma not loadable ({exc}); install libnuma1")
    return _numa_cache


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def thp_mode() -> str:
    """The kernel's THP setting ('always', 'madvise', 'never'), or '' when unknown."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if "[" in text:
        return text[text.index("[") + 1:text.index("]")]
    return ""


def hugetlb_free_2m() -> int:
    """Free 2 MiB hugetlb pages on this machine (0 when none are reserved)."""
    text = _read("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
    return int(text) if text.isdigit() else 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def anon_huge_bytes(addr: int, length: int) -> int | None:
    """Bytes of [addr, addr+length) the kernel backs with transparent hugepages, from
    /proc/self/smaps (None when smaps is unreadable)."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    total, inside, end = 0, False, addr + length
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, _, hi = head.partition("-")
            try:
                a, b = int(lo, 16), int(hi, 16)
            except ValueError:
                inside = False
                continue
            inside = a < end and b > addr
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


# --------------------------------------------------------------------------------------------
class _Mapping:
    """One mapping; ``unmap`` is idempotent and thread-safe (close() or garbage collection)."""

    def __init__(self, addr: int, length: int):
        self.addr, self.length = addr, length
        self._lock = threading.Lock()
        self._live = True

    def unmap(self) -> None:
        with self._lock:
            if not self._live:
                return
            self._live = False
        err = _libc().munmap(self.addr, self.length)
        if err:  # only a bug could cause this; say so rather than leak silently
            log.error("munmap(%#x, %d) failed: %s", self.addr, self.length, os.strerror(err))


class MmapAllocator(HostAllocator):
    """Anonymous mmap with hugepages, NUMA binding and prefaulting; honest about each."""

    name = "mmap"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: "auto": hugetlb 2 MiB, then THP, then 4 KiB pages; "hugetlb" / "thp": start there
        #: (then fall back the same way); "off": plain 4 KiB pages.
        hugepages: Literal["auto", "hugetlb", "thp", "off"] = "auto"
        #: Refuse (AllocationError) instead of ending on 4 KiB pages after a hugepage request.
        require_hugepages: bool = False
        #: Bind the memory to this NUMA node with mbind (libnuma); None leaves the kernel policy.
        numa_node: int | None = None
        #: A failed binding is an AllocationError (else logged once and reported).
        numa_strict: bool = False
        #: Fault every page in before returning (no first-touch stalls during transfers; lets
        #: the real THP coverage and NUMA node be measured).
        prefault: bool = True
        #: Threads for prefaulting; 0 = one per CPU, at most 8.
        prefault_threads: int = 0

    def __init__(self, config: Any = None):
        super().__init__(config)
        c = self.config
        if c.numa_node is not None and c.numa_node < 0:
            raise ConfigError(f"mmap.numa_node must be >= 0, got {c.numa_node}",
                              key="mmap.numa_node", value=c.numa_node)
        if c.prefault_threads < 0:
            raise ConfigError(f"mmap.prefault_threads must be >= 0, got {c.prefault_threads}",
                              key="mmap.prefault_threads", value=c.prefault_threads)

    @classmethod
    def probe(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability.unavailable(f"needs Linux mmap/madvise, this is {sys.platform}")
        try:
            libc = _libc()
        except (OSError, AttributeError) as exc:
            return Availability.unavailable(f"libc not loadable through ctypes: {exc}")
        addr, err = libc.mmap(BASE_PAGE, _MAP_PRIVATE | _MAP_ANONYMOUS)
        if addr is None:
            return Availability.unavailable(f"anonymous mmap failed: {os.strerror(err)}")
        try:
            ctypes.memset(addr, 0x5A, BASE_PAGE)
            ok = ctypes.string_at(addr + BASE_PAGE - 1, 1) == b"\x5a"
        finally:
            libc.munmap(addr, BASE_PAGE)
        if not ok:
            return Availability.unavailable("anonymous mmap did not read back what was written")
        numa, why = _numa()
        parts = [f"hugetlb 2 MiB free: {hugetlb_free_2m()}", f"THP: {thp_mode() or 'unknown'}",
                 f"NUMA nodes: {numa.max_node + 1}" if numa else f"NUMA: {why}"]
        return Availability.available("; ".join(parts))

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        return {"prefault": True, "prefault_threads": 2}

    # ----------------------------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> HostBuffer:
        c = self.config
        if nbytes > sys.maxsize:
            # mmap's length is a size_t: ctypes would wrap a larger count to a small one, and
            # some kernels map that (seen on the H200 machine for 2**64).
            raise AllocationError(f"{self.name}: {nbytes} bytes exceed the address space",
                                  backend=self.name, nbytes=nbytes)
        libc = _libc()
        attempts: list[dict[str, Any]] = []
        order = {"auto": ["hugetlb", "thp", "base"], "hugetlb": ["hugetlb", "thp", "base"],
                 "thp": ["thp", "base"], "off": ["base"]}[c.hugepages]
        addr = length = None
        kind = ""
        for kind in order:
            addr, length, why = self._map(libc, kind, nbytes)
            attempts.append({"backing": _BACKING[kind], "ok": addr is not None,
                             **({"reason": why} if why else {})})
            if addr is not None:
                break
        if addr is None or length is None:
            raise AllocationError(f"{self.name}: mmap of {nbytes} bytes failed: "
                                  f"{attempts[-1].get('reason')}", backend=self.name,
                                  nbytes=nbytes)
        mapping = _Mapping(addr, length)
        try:
            return self._finish(libc, mapping, kind, nbytes, attempts)
        except BaseException:
            mapping.unmap()
            raise

    def _map(self, libc: _Libc, kind: str, nbytes: int) -> tuple[int | None, int | None, str]:
        """Map for one backing kind: (addr, length, "") or (None, None, why not)."""
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS
        if kind == "hugetlb":
            if platform.machine().lower() not in _HUGE_ARCHES:
                return None, None, f"MAP_HUGETLB value unknown on {platform.machine()}"
            length = _round_up(nbytes, HUGE_2M)
            addr, err = libc.mmap(length, flags | _MAP_HUGETLB | _MAP_HUGE_2MB)
            if addr is None:
                return None, None, (f"{errno.errorcode.get(err, err)}: no {length >> 21} free "
                                    f"2 MiB hugetlb pages (free now: {hugetlb_free_2m()}; "
                                    "reserve them in /proc/sys/vm/nr_hugepages)")
            return addr, length, ""
        if kind == "thp":
            mode = thp_mode()
            if mode not in ("always", "madvise"):
                return None, None, f"transparent hugepages are '{mode or 'unavailable'}'"
            length = _round_up(nbytes, HUGE_2M)
            # Over-map by one hugepage and trim, so the region starts on a 2 MiB boundary.
            addr, err = libc.mmap(length + HUGE_2M, flags)
            if addr is None:
                return None, None, f"mmap failed: {os.strerror(err)}"
            start = _round_up(addr, HUGE_2M)
            if start > addr:
                libc.munmap(addr, start - addr)
            tail = addr + length + HUGE_2M - (start + length)
            if tail:
                libc.munmap(start + length, tail)
            err = libc.madvise(start, length, _MADV_HUGEPAGE)
            if err:
                libc.munmap(start, length)
                return None, None, f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}"
            return start, length, ""
        length = _round_up(nbytes, BASE_PAGE)
        addr, err = libc.mmap(length, flags)
        if addr is None:
            return None, None, f"mmap failed: {os.strerror(err)}"
        return addr, length, ""

    def _finish(self, libc: _Libc, mapping: _Mapping, kind: str, nbytes: int,
                attempts: list[dict[str, Any]]) -> HostBuffer:
        c = self.config
        addr, length = mapping.addr, mapping.length
        details: dict[str, Any] = {"mapped_bytes": length, "requested": c.hugepages,
                                   "attempts": attempts, "prefaulted": False}
        numa_node = self._bind(addr, length, details)
        page = HUGE_2M if kind in ("hugetlb", "thp") else BASE_PAGE
        if c.prefault:
            self._prefault(libc, addr, length, page)
            details["prefaulted"] = True
        backing = _BACKING[kind]
        if kind == "thp":
            huge = anon_huge_bytes(addr, length) if c.prefault else None
            details["thp_bytes"] = huge        # None: not measured (no prefault)
            if huge == 0:
                details["thp_demoted"] = "the kernel backed the THP region with 4 KiB pages"
                backing, page = _BACKING["base"], BASE_PAGE
        if c.prefault:
            seen = self._nodes_seen(addr, length, page)
            details["numa_nodes_seen"] = sorted(seen) if seen is not None else None
            if seen is not None and len(seen) == 1:
                numa_node = next(iter(seen))
            elif seen is not None and len(seen) > 1:
                numa_node = None
        if c.hugepages != "off" and backing != _BACKING[order_first(c.hugepages)]:
            demotion = (f"{self.name}: asked for {_BACKING[order_first(c.hugepages)]} "
                        f"pages, got {backing} (" + "; ".join(
                            f"{a['backing']}: {a['reason']}" for a in attempts if "reason" in a)
                        + (f"; {details['thp_demoted']}" if "thp_demoted" in details else "")
                        + ")")
            details["demoted"] = demotion
            if backing == _BACKING["base"] and c.require_hugepages:
                raise AllocationError(demotion + "; require_hugepages is set",
                                      backend=self.name, nbytes=nbytes)
            if c.hugepages != "auto" or backing == _BACKING["base"]:
                _warn_once(f"demote:{c.hugepages}->{backing}", demotion)
        arr = (ctypes.c_uint8 * nbytes).from_address(addr)
        tensor = torch.frombuffer(arr, dtype=torch.uint8)
        # Unmap when close() is called, or when the last view of the memory is gone.
        weakref.finalize(arr, mapping.unmap)
        return HostBuffer(ptr=addr, nbytes=nbytes, tensor=tensor, backing=backing,
                          numa_node=numa_node, device_addressable=False,
                          page_size_bytes=page, details=details, _release=mapping.unmap)

    def _bind(self, addr: int, length: int, details: dict[str, Any]) -> int | None:
        node = self.config.numa_node
        if node is None:
            return None
        numa, why = _numa()
        if numa is not None and node > numa.max_node:
            why = f"node {node} does not exist (max node {numa.max_node})"
            numa = None
        if numa is not None:
            err = numa.mbind(addr, length, node, self.config.numa_strict)
            if not err:
                details["numa_bound"] = node
                return node      # MPOL_BIND: pages can only come from this node
            why = f"mbind failed: {os.strerror(err)}"
        details["numa_bind_error"] = why
        msg = f"{self.name}: cannot bind host memory to NUMA node {node}: {why}"
        if self.config.numa_strict:
            raise AllocationError(msg, backend=self.name, nbytes=length)
        _warn_once(f"numa:{node}:{why}", msg)
        return None

    def _prefault(self, libc: _Libc, addr: int, length: int, page: int) -> None:
        threads = self.config.prefault_threads or min(8, os.cpu_count() or 1)
        chunk = max(page, _round_up(-(-length // threads), page))
        ranges = [(a, min(chunk, addr + length - a)) for a in range(addr, addr + length, chunk)]

        def populate(r: tuple[int, int]) -> int:
            return libc.madvise(r[0], r[1], _MADV_POPULATE_WRITE)

        errs = self._run(populate, ranges)
        if all(e == 0 for e in errs):
            return
        if any(e not in (0, errno.EINVAL) for e in errs):
            bad = next(e for e in errs if e not in (0, errno.EINVAL))
            raise AllocationError(f"{self.name}: prefaulting {length} bytes failed: "
                                  f"{os.strerror(bad)}", backend=self.name, nbytes=length)
        # Kernel without MADV_POPULATE_WRITE: write one byte per page (zero, as mapped).
        whole = torch.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=torch.uint8)

        def touch(r: tuple[int, int]) -> int:
            off, n = r[0] - addr, r[1]
            whole[off:off + n].as_strided((-(-n // page),), (page,)).zero_()
            return 0

        self._run(touch, ranges)

    @staticmethod
    def _run(fn, items: list) -> list:
        if len(items) == 1:
            return [fn(items[0])]
        with ThreadPoolExecutor(len(items), thread_name_prefix="kvtier-prefault") as ex:
            return list(ex.map(fn, items))

    @staticmethod
    def _nodes_seen(addr: int, length: int, page: int) -> set[int] | None:
        """NUMA nodes of up to 64 evenly spread (faulted) pages; None when unknown."""
        numa, _ = _numa()
        if numa is None:
            return None
        npages = length // page
        step = max(1, npages // 64)
        seen = set()
        for i in range(0, npages, step):
            node = numa.node_of(addr + i * page)
            if node is None:
                return None
            seen.add(node)
        return seen


_BACKING = {"hugetlb": "hugetlb-2MiB", "thp": "thp", "base": "anonymous"}


def order_first(hugepages: str) -> str:
    """The backing kind a ``hugepages`` setting asks for first."""
    return {"auto": "hugetlb", "hugetlb": "hugetlb", "thp": "thp", "off": "base"}[hugepages]
