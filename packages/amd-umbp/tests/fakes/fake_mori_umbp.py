"""FAKE of ``mori.umbp`` from amd-mori 1.2.4 -- for kvtier's adapter tests only.

amd-mori has no wheel for this Python and its native libraries need ROCm 7, so the adapters are
tested against this stand-in. It follows the 1.2.4 Python bindings (``src/pybind/
pybind_umbp.cpp``, checked against the names in the 1.2.4 wheel's ``libmori_pybinds.so``):

* ``UMBPHostMemAllocator.alloc(size, backing=Anonymous, hugepage_size=2 MiB, numa_node=-1,
  prefault=True)`` maps real memory (mmap / memfd_create through libc), never throws, returns a
  falsy handle on failure, rounds ``mapped_size`` up to the page (or huge page) and falls back
  from hugetlb to 4 KiB pages when the kernel has none free, saying so in ``actual_backing``;
  ``free(handle)`` unmaps and makes the handle falsy. NUMA binding is a best-effort mbind.
* ``UMBPClient(UMBPConfig)`` is an in-process DRAM (or SSD-medium) pool paged by
  ``distributed.dram_page_size`` (2 MiB when no deployment is configured, shrunk to hold 8 pages,
  as UMBP's embedded defaults do) with watermark eviction (``lru`` or ``prefix_aware_lru`` by
  depth, as ``LocalStorageManager::SelectVictim``). Data really moves: puts copy from the given
  pointers and gets copy into them with ``ctypes``. A second put of an existing name succeeds and
  keeps the first bytes (UMBP's duplicate-commit rule); a get whose size differs from the stored
  size is a miss; vector length mismatches fail the whole batch; there is no ``remove`` and no
  ``close`` (1.2.4 binds neither).
* Config structs are typed like pybind's ``def_readwrite`` (a wrong type is a TypeError); nested
  structs come back by reference, ``distributed``/``standalone_process`` (std::optional) by copy.

It is installed into ``sys.modules`` only by the tests' fixtures (``tests/conftest.py``) and is
never part of an install. ``FAKE`` holds test-only switches that the real module does not have.
"""

from __future__ import annotations

import copy
import ctypes
import enum
import errno
import math
import os
import platform
import threading
from collections import OrderedDict
from typing import Any

__version__ = "1.2.4"
FAKE_OF = "amd-mori 1.2.4 mori.umbp"

MiB = 1 << 20


class _Switches:
    """Test-only behaviour switches (not part of the real API)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.deny_hugetlb = False           # behave as a kernel with no free huge pages
        self.fail_alloc = False             # every alloc returns an invalid handle
        self.register_ok = True             # register_memory result for valid arguments
        self.master_reachable = False       # a master_address connects (else Init fails)
        self.raise_on: dict[str, BaseException] = {}   # client method -> exception to raise
        self.fail_puts = False              # every put returns False (full / failing medium)
        self.clients: list[UMBPClient] = []
        self.last_config: UMBPConfig | None = None
        self.live: dict[int, int] = {}      # ptr -> mapped size of every mapping not freed


FAKE = _Switches()


# --------------------------------------------------------------------------------------------
# Enums (pybind11 py::enum_; export_values() also puts the members in the module)
# --------------------------------------------------------------------------------------------
class UMBPHostBufferBacking(enum.IntEnum):
    Anonymous = 0
    AnonymousHugetlb = 1
    AnonymousShm = 2
    AnonymousShmHugetlb = 3


class UMBPTierType(enum.IntEnum):
    Unknown = 0
    HBM = 1
    DRAM = 2
    SSD = 3


class UMBPRole(enum.IntEnum):
    Standalone = 0
    SharedSSDLeader = 1
    SharedSSDFollower = 2


class UMBPDeploymentMode(enum.IntEnum):
    Local = 0
    StandaloneProcess = 1
    Distributed = 2


class UMBPSsdLayoutMode(enum.IntEnum):
    SegmentedLog = 1


class UMBPIoBackend(enum.IntEnum):
    Posix = 0
    IoUring = 1


class UMBPDurabilityMode(enum.IntEnum):
    Strict = 0
    Relaxed = 1


class CacheRemoteAdmission(enum.IntEnum):   # bound without export_values
    SIZE = 0
    NEVER = 1
    ALWAYS = 2


class UMBPMedium(enum.IntEnum):             # bound without export_values
    DRAM = 0
    HBM = 1
    SSD = 2


for _enum in (UMBPHostBufferBacking, UMBPTierType, UMBPRole, UMBPDeploymentMode,
              UMBPSsdLayoutMode, UMBPIoBackend, UMBPDurabilityMode):
    globals().update(_enum.__members__)


# --------------------------------------------------------------------------------------------
# Typed struct fields, as pybind's def_readwrite casts them
# --------------------------------------------------------------------------------------------
def _incompatible(owner: str, name: str, value: Any) -> TypeError:
    return TypeError(f"(): incompatible function arguments. The following argument types are "
                     f"supported: {owner}.{name} setter; invoked with: {value!r}")


class _Field:
    def __init__(self, kind: Any, default: Any):
        self.kind, self.default = kind, default

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner.__name__, name

    def _check(self, value: Any) -> Any:
        k = self.kind
        if k in ("size_t", "uint16", "uint32", "uint64"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if k == "uint16":
                ok = ok and value < 1 << 16
        elif k == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif k == "double":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif k == "bool":
            ok = isinstance(value, bool)
        elif k == "str":
            ok = isinstance(value, str)
        elif k in ("list[str]", "list[int]"):
            item = str if k == "list[str]" else int
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, item) and not isinstance(v, bool) for v in value)
            value = list(value) if ok else value
        elif isinstance(k, type) and issubclass(k, enum.Enum):
            ok = isinstance(value, k)
        elif isinstance(k, type):             # nested struct: copied in
            ok = isinstance(value, k)
            value = copy.deepcopy(value) if ok else value
        else:                                 # ("optional", StructType)
            ok = value is None or isinstance(value, k[1])
            value = copy.deepcopy(value)
        if not ok:
            raise _incompatible(self.owner, self.name, value)
        return value

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        if self.name not in obj.__dict__:
            d = self.default
            obj.__dict__[self.name] = d() if callable(d) and not isinstance(d, enum.Enum) else d
        value = obj.__dict__[self.name]
        if isinstance(self.kind, tuple) or self.kind in ("list[str]", "list[int]"):
            return copy.deepcopy(value)       # std::optional / std::vector: by value
        return value                          # scalars; nested structs by reference

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = self._check(value)


class _Struct:
    def __repr__(self) -> str:
        fields = [n for n, v in type(self).__dict__.items() if isinstance(v, _Field)]
        return f"<{type(self).__name__} " + " ".join(f"{n}={getattr(self, n)!r}"
                                                     for n in fields) + ">"


class UMBPDramConfig(_Struct):
    capacity_bytes = _Field("size_t", 4 << 30)
    use_shared_memory = _Field("bool", False)
    shm_name = _Field("str", "/umbp_dram")
    high_watermark = _Field("double", 0.9)
    low_watermark = _Field("double", 0.7)
    use_hugepages = _Field("bool", False)
    hugepage_size = _Field("size_t", 2 * MiB)
    numa_nodes = _Field("list[int]", list)
    numa_strict = _Field("bool", False)
    prefault_threads = _Field("int", 0)
    prefault = _Field("bool", True)

    @property
    def numa_node(self) -> int:
        """Deprecated: use numa_nodes. Setting this property replaces the node list."""
        nodes = self.numa_nodes
        return nodes[0] if nodes else -1

    @numa_node.setter
    def numa_node(self, node: int) -> None:
        self.numa_nodes = [node] if node >= 0 else []


class UMBPIoConfig(_Struct):
    backend = _Field(UMBPIoBackend, UMBPIoBackend.IoUring)
    queue_depth = _Field("size_t", 4096)


class UMBPDurabilityConfig(_Struct):
    mode = _Field(UMBPDurabilityMode, UMBPDurabilityMode.Strict)
    enable_background_gc = _Field("bool", True)


class UMBPSsdConfig(_Struct):
    enabled = _Field("bool", True)
    storage_dir = _Field("str", "/tmp/umbp_ssd")
    capacity_bytes = _Field("size_t", 32 << 30)
    layout_mode = _Field(UMBPSsdLayoutMode, UMBPSsdLayoutMode.SegmentedLog)
    segment_size_bytes = _Field("size_t", 256 * MiB)
    shard_io_threads = _Field("int", 0)
    tier_io_threads = _Field("int", 4)
    direct_io = _Field("bool", True)
    verify_crc = _Field("bool", True)
    single_flight_reads = _Field("bool", True)
    high_watermark = _Field("double", 0.9)
    low_watermark = _Field("double", 0.7)
    io = _Field(UMBPIoConfig, UMBPIoConfig)
    durability = _Field(UMBPDurabilityConfig, UMBPDurabilityConfig)
    ssd_backend = _Field("str", "file")
    spdk_bdev_name = _Field("str", "")
    spdk_nvme_pci_addr = _Field("str", "")
    spdk_proxy_shm_name = _Field("str", "/umbp_spdk_proxy")
    spdk_proxy_auto_start = _Field("bool", True)


class UMBPEvictionConfig(_Struct):
    policy = _Field("str", "lru")
    candidate_window = _Field("size_t", 16)
    auto_promote_on_read = _Field("bool", True)


class UMBPCopyPipelineConfig(_Struct):
    async_enabled = _Field("bool", True)
    queue_depth = _Field("size_t", 4096)
    worker_threads = _Field("size_t", 2)
    batch_max_ops = _Field("size_t", 128)


class UMBPMasterClientConfig(_Struct):
    master_address = _Field("str", "")
    node_id = _Field("str", "")
    node_address = _Field("str", "")
    auto_heartbeat = _Field("bool", True)
    tags = _Field("list[str]", list)


class UMBPIoEngineConfig(_Struct):
    host = _Field("str", "")
    port = _Field("uint16", 0)


class UMBPHbmConfig(_Struct):
    device = _Field("int", 0)
    capacity_bytes = _Field("uint64", 0)


class UMBPDistributedConfig(_Struct):
    master_config = _Field(UMBPMasterClientConfig, UMBPMasterClientConfig)
    io_engine = _Field(UMBPIoEngineConfig, UMBPIoEngineConfig)
    staging_buffer_size = _Field("size_t", 64 * MiB)
    ranged_scratch_size = _Field("size_t", 0)
    ssd_staging_buffer_size = _Field("size_t", 256 * MiB)
    ssd_staging_buffer_slots = _Field("int", 16)
    ssd_staging_use_hugepages = _Field("bool", False)
    ssd_staging_hugepage_size = _Field("size_t", 2 * MiB)
    peer_service_port = _Field("uint16", 0)
    cache_remote_fetches = _Field("bool", True)
    ranged_locality_prefetch = _Field("bool", True)
    local_first = _Field("bool", False)
    cache_remote_admission = _Field(CacheRemoteAdmission, CacheRemoteAdmission.SIZE)
    admission_max_block_bytes = _Field("size_t", 0)
    dram_page_size = _Field("uint64", 0)
    backend_policy_path = _Field("str", "")
    medium = _Field(UMBPMedium, UMBPMedium.DRAM)
    hbm = _Field(UMBPHbmConfig, UMBPHbmConfig)


class UMBPStandaloneProcessConfig(_Struct):
    address = _Field("str", "")
    auto_start = _Field("bool", True)
    startup_timeout_ms = _Field("int", 10000)
    worker_node_id = _Field("str", "")
    worker_node_address = _Field("str", "")
    tags = _Field("list[str]", list)


class UMBPConfig(_Struct):
    dram = _Field(UMBPDramConfig, UMBPDramConfig)
    ssd = _Field(UMBPSsdConfig, UMBPSsdConfig)
    eviction = _Field(UMBPEvictionConfig, UMBPEvictionConfig)
    copy_pipeline = _Field(UMBPCopyPipelineConfig, UMBPCopyPipelineConfig)
    role = _Field(UMBPRole, UMBPRole.Standalone)
    follower_mode = _Field("bool", False)
    force_ssd_copy_on_write = _Field("bool", False)
    distributed = _Field(("optional", UMBPDistributedConfig), None)
    standalone_process = _Field(("optional", UMBPStandaloneProcessConfig), None)

    @staticmethod
    def from_environment() -> "UMBPConfig":
        cfg = UMBPConfig()
        env = os.environ
        if "UMBP_DRAM_CAPACITY" in env:
            cfg.dram.capacity_bytes = int(env["UMBP_DRAM_CAPACITY"])
        if "UMBP_EVICTION_POLICY" in env:
            cfg.eviction.policy = env["UMBP_EVICTION_POLICY"]
        if "UMBP_SSD_ENABLED" in env:
            cfg.ssd.enabled = env["UMBP_SSD_ENABLED"] not in ("0", "false", "off")
        return cfg


class UMBPExternalKvMatch(_Struct):
    node_id = _Field("str", "")
    peer_address = _Field("str", "")

    def matched_hash_count(self) -> int:
        return 0


class UMBPExternalKvHitCountEntry(_Struct):
    hash = _Field("str", "")
    hit_count_total = _Field("uint64", 0)


# --------------------------------------------------------------------------------------------
# Host memory: UMBPHostMemAllocator over real mmap
# --------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_RW, _MAP_SHARED, _MAP_PRIVATE, _MAP_ANONYMOUS = 3, 0x01, 0x02, 0x20
_MAP_HUGETLB, _MAP_HUGE_SHIFT, _MFD_HUGETLB = 0x40000, 26, 0x0004
_MADV_POPULATE_WRITE, _MPOL_BIND = 23, 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class UMBPHostBufferHandle:
    def __init__(self) -> None:
        self._ptr = 0
        self._requested_size = 0
        self._mapped_size = 0
        self._actual_backing = UMBPHostBufferBacking.Anonymous
        self._actual_alignment = 0
        self._fd = -1

    ptr = property(lambda self: self._ptr)
    requested_size = property(lambda self: self._requested_size)
    mapped_size = property(lambda self: self._mapped_size)
    actual_backing = property(lambda self: self._actual_backing)
    actual_alignment = property(lambda self: self._actual_alignment)

    def __bool__(self) -> bool:
        return self._ptr != 0

    def __repr__(self) -> str:
        return (f"<UMBPHostBufferHandle ptr=0x{self._ptr:x} requested_size="
                f"{self._requested_size} mapped_size={self._mapped_size}>")


class UMBPHostMemAllocator:
    """Never throws for a failed allocation: the handle is falsy."""

    def __init__(self) -> None:
        self.events: list[str] = []          # what UMBP would log (fallbacks, mbind failures)

    def alloc(self, size: int, backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
              hugepage_size: int = 2 * MiB, numa_node: int = -1,
              prefault: bool = True) -> UMBPHostBufferHandle:
        for name, value, kinds in (("size", size, int), ("hugepage_size", hugepage_size, int),
                                   ("numa_node", numa_node, int), ("prefault", prefault, bool)):
            if not isinstance(value, kinds) or (kinds is int and isinstance(value, bool)):
                raise _incompatible("UMBPHostMemAllocator", f"alloc({name})", value)
        if size < 0 or hugepage_size < 0:
            raise _incompatible("UMBPHostMemAllocator", "alloc(size_t)", size)
        if not isinstance(backing, UMBPHostBufferBacking):
            raise _incompatible("UMBPHostMemAllocator", "alloc(backing)", backing)
        h = UMBPHostBufferHandle()
        if size == 0 or FAKE.fail_alloc:
            return h
        B = UMBPHostBufferBacking
        shm = backing in (B.AnonymousShm, B.AnonymousShmHugetlb)
        huge = backing in (B.AnonymousHugetlb, B.AnonymousShmHugetlb)
        if huge and not _pow2(hugepage_size):
            self.events.append(f"invalid hugepage_size={hugepage_size}; falling back")
            huge = False
        if huge:
            if self._map(h, size, hugepage_size, shm=shm, huge=True):
                return self._post(h, numa_node, prefault)
            self.events.append("MAP_HUGETLB allocation failed; falling back to anonymous pages")
        if self._map(h, size, _PAGE, shm=shm, huge=False):
            return self._post(h, numa_node, prefault)
        return h

    def _map(self, h: UMBPHostBufferHandle, size: int, align: int, *, shm: bool,
             huge: bool) -> bool:
        mapped = _align_up(size, align)
        if huge and FAKE.deny_hugetlb:
            return False
        fd, flags = -1, (_MAP_SHARED if shm else _MAP_PRIVATE | _MAP_ANONYMOUS)
        if huge:
            flags |= _MAP_HUGETLB | ((align.bit_length() - 1) << _MAP_HUGE_SHIFT)
        if shm:
            try:
                fd = os.memfd_create("umbp_host_buffer_hugetlb" if huge else "umbp_host_buffer",
                                     os.MFD_CLOEXEC | (_MFD_HUGETLB if huge else 0))
                os.ftruncate(fd, mapped)
            except OSError:
                if fd >= 0:
                    os.close(fd)
                return False
        ptr = _libc.mmap(None, mapped, _PROT_RW, flags, fd, 0)
        if ptr is None or ptr == _MAP_FAILED:
            if fd >= 0:
                os.close(fd)
            return False
        B = UMBPHostBufferBacking
        h._ptr, h._requested_size, h._mapped_size = ptr, size, mapped
        h._actual_backing = ((B.AnonymousShmHugetlb if huge else B.AnonymousShm) if shm
                             else (B.AnonymousHugetlb if huge else B.Anonymous))
        h._actual_alignment, h._fd = align, fd
        FAKE.live[ptr] = mapped
        return True

    def _post(self, h: UMBPHostBufferHandle, numa_node: int,
              prefault: bool) -> UMBPHostBufferHandle:
        if numa_node >= 0:
            if _SYS_MBIND is None:
                self.events.append("NUMA binding unavailable; continuing without binding")
            else:
                words = numa_node // 64 + 1
                mask = (ctypes.c_ulong * words)()
                mask[numa_node // 64] = 1 << (numa_node % 64)
                rc = _libc.syscall(_SYS_MBIND, ctypes.c_void_p(h._ptr),
                                   ctypes.c_size_t(h._mapped_size), _MPOL_BIND, mask,
                                   ctypes.c_ulong(words * 64), ctypes.c_uint(0))
                if rc != 0:
                    err = ctypes.get_errno()
                    self.events.append(f"mbind(node={numa_node}) failed ({err}: "
                                       f"{errno.errorcode.get(err, err)})")
        if prefault:
            if _libc.madvise(h._ptr, h._mapped_size, _MADV_POPULATE_WRITE) != 0:
                ctypes.memset(h._ptr, 0, h._mapped_size)
        return h

    def free(self, handle: UMBPHostBufferHandle) -> None:
        if not isinstance(handle, UMBPHostBufferHandle):
            raise _incompatible("UMBPHostMemAllocator", "free(handle)", handle)
        if not handle:
            return
        _libc.munmap(handle._ptr, handle._mapped_size)
        FAKE.live.pop(handle._ptr, None)
        if handle._fd >= 0:
            os.close(handle._fd)
        handle._ptr, handle._requested_size, handle._mapped_size, handle._fd = 0, 0, 0, -1


# --------------------------------------------------------------------------------------------
# UMBPClient: an in-process paged pool with UMBP's put/get/evict rules
# --------------------------------------------------------------------------------------------
def _str_list(owner: str, values: Any) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise _incompatible("UMBPClient", owner, values)
    out = []
    for v in values:
        if isinstance(v, bytes):
            v = v.decode("utf-8", "surrogateescape")
        if not isinstance(v, str):
            raise _incompatible("UMBPClient", owner, values)
        out.append(v)
    return out


def _int_list(owner: str, values: Any, *, unsigned: bool = True) -> list[int]:
    if not isinstance(values, (list, tuple)) or any(
            not isinstance(v, int) or isinstance(v, bool) or (unsigned and v < 0)
            for v in values):
        raise _incompatible("UMBPClient", owner, values)
    return list(values)


class _Object:
    __slots__ = ("data", "pages", "depth")

    def __init__(self, data: bytes, pages: int, depth: int):
        self.data, self.pages, self.depth = data, pages, depth


def _validate(cfg: UMBPConfig) -> str | None:
    """The checks UMBPConfig::Validate makes that a kvtier config could trip."""
    d, s = cfg.dram, cfg.ssd
    if d.capacity_bytes == 0:
        return "dram.capacity_bytes must be > 0"
    if not (0 < d.low_watermark < d.high_watermark <= 1):
        return "dram watermarks must satisfy 0 < low_watermark < high_watermark <= 1"
    dist = cfg.distributed
    if dist is not None:
        if not dist.master_config.node_id:
            return "distributed.master_config.node_id must not be empty"
        if not dist.master_config.node_address:
            return "distributed.master_config.node_address must not be empty"
        if dist.medium == UMBPMedium.SSD:
            if s.capacity_bytes == 0:
                return "ssd.capacity_bytes must be > 0 when distributed.medium is SSD"
            if s.segment_size_bytes == 0 or s.segment_size_bytes % 4096:
                return "ssd.segment_size_bytes must be a multiple of 4096"
    if cfg.eviction.policy not in ("lru", "prefix_aware_lru"):
        return f"unknown eviction policy '{cfg.eviction.policy}'"
    return None


class UMBPClient:
    def __init__(self, config: UMBPConfig | None = None):
        if config is None:
            config = UMBPConfig()
        if not isinstance(config, UMBPConfig):
            raise _incompatible("UMBPClient", "__init__(config)", config)
        self._maybe_raise("__init__")
        cfg = copy.deepcopy(config)
        why = _validate(cfg)
        if why:
            raise RuntimeError(f"invalid UMBP config: {why}")
        dist = cfg.distributed
        self._distributed = dist is not None and bool(dist.master_config.master_address)
        if self._distributed and not FAKE.master_reachable:
            raise RuntimeError("DistributedClient: PoolClient::Init() failed")
        medium_ssd = dist is not None and dist.medium == UMBPMedium.SSD
        self.capacity = cfg.ssd.capacity_bytes if medium_ssd else cfg.dram.capacity_bytes
        page = dist.dram_page_size if dist is not None and dist.dram_page_size else 2 * MiB
        if dist is None:                      # embedded defaults: fit at least 8 pages
            while page > 4096 and page > self.capacity // 8:
                page //= 2
        self.page_size = page
        self.total_pages = self.capacity // page
        self.high = cfg.dram.high_watermark
        self.low = cfg.dram.low_watermark
        self.policy = cfg.eviction.policy
        self.window = max(1, cfg.eviction.candidate_window)
        self.config = cfg
        self._objects: OrderedDict[str, _Object] = OrderedDict()   # oldest first
        self._used = 0
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self.evicted: list[str] = []
        FAKE.last_config = cfg
        FAKE.clients.append(self)

    def _maybe_raise(self, what: str) -> None:
        exc = FAKE.raise_on.get(what)
        if exc is not None:
            raise exc

    # ----- eviction -----------------------------------------------------------------------------
    def _victim(self) -> str | None:
        if not self._objects:
            return None
        if self.policy != "prefix_aware_lru":
            return next(iter(self._objects))
        best, best_depth = None, -2
        for i, (name, obj) in enumerate(self._objects.items()):
            if i >= self.window:
                break
            score = obj.depth if obj.depth >= 0 else 0
            if best is None or score > best_depth:
                best, best_depth = name, score
        return best

    def _make_room(self, need: int) -> bool:
        if need > self.total_pages:
            return False
        if self._used + need > self.high * self.total_pages:
            target = self.low * self.total_pages
            while self._objects and (self._used + need > target):
                victim = self._victim()
                obj = self._objects.pop(victim)
                self._used -= obj.pages
                self.evicted.append(victim)
        return self._used + need <= self.total_pages

    # ----- data path ----------------------------------------------------------------------------
    def _put(self, key: str, src: int, size: int, depth: int) -> bool:
        if size == 0 or FAKE.fail_puts:
            return False
        if key in self._objects:             # duplicate commit: keep the prior slot
            self._objects.move_to_end(key)
            return True
        need = max(1, math.ceil(size / self.page_size))
        if not self._make_room(need):
            return False
        self._objects[key] = _Object(ctypes.string_at(src, size), need, depth)
        self._used += need
        return True

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        self._maybe_raise("put_from_ptr")
        return self.batch_put_from_ptr([key], [src], [size])[0]

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        self._maybe_raise("get_into_ptr")
        return self.batch_get_into_ptr([key], [dst], [size])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_put_from_ptr(self, keys: list[str], ptrs: list[int],
                           sizes: list[int]) -> list[bool]:
        self._maybe_raise("batch_put_from_ptr")
        return self.batch_put_from_ptr_with_depth(keys, ptrs, sizes, [])

    def batch_put_from_ptr_with_depth(self, keys: list[str], ptrs: list[int], sizes: list[int],
                                      depths: list[int]) -> list[bool]:
        self._maybe_raise("batch_put_from_ptr_with_depth")
        keys = _str_list("batch_put_from_ptr_with_depth(keys)", keys)
        ptrs = _int_list("batch_put_from_ptr_with_depth(ptrs)", ptrs)
        sizes = _int_list("batch_put_from_ptr_with_depth(sizes)", sizes)
        depths = _int_list("batch_put_from_ptr_with_depth(depths)", depths, unsigned=False)
        if len(ptrs) != len(keys) or len(sizes) != len(keys) or (
                depths and len(depths) != len(keys)):
            return [False] * len(keys)        # "[PoolClient] BatchPut: vector length mismatch"
        with self._lock:
            return [self._put(k, p, s, depths[i] if depths else -1)
                    for i, (k, p, s) in enumerate(zip(keys, ptrs, sizes))]

    def batch_get_into_ptr(self, keys: list[str], ptrs: list[int],
                           sizes: list[int]) -> list[bool]:
        self._maybe_raise("batch_get_into_ptr")
        keys = _str_list("batch_get_into_ptr(keys)", keys)
        ptrs = _int_list("batch_get_into_ptr(ptrs)", ptrs)
        sizes = _int_list("batch_get_into_ptr(sizes)", sizes)
        if len(ptrs) != len(keys) or len(sizes) != len(keys):
            return [False] * len(keys)        # "[PoolClient] BatchGet: vector length mismatch"
        out = []
        with self._lock:
            for k, p, s in zip(keys, ptrs, sizes):
                obj = self._objects.get(k)
                if obj is None or len(obj.data) != s:
                    out.append(False)         # miss, or "size mismatch": dst untouched
                    continue
                ctypes.memmove(p, obj.data, s)
                self._objects.move_to_end(k)
                out.append(True)
        return out

    def batch_exists(self, keys: list[str]) -> list[bool]:
        self._maybe_raise("batch_exists")
        keys = _str_list("batch_exists(keys)", keys)
        with self._lock:
            return [k in self._objects for k in keys]

    def batch_exists_consecutive(self, keys: list[str]) -> int:
        self._maybe_raise("batch_exists_consecutive")
        keys = _str_list("batch_exists_consecutive(keys)", keys)
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._objects:
                    break
                n += 1
        return n

    def clear(self) -> bool:
        self._maybe_raise("clear")
        with self._lock:
            self._objects.clear()
            self._used = 0
        return True

    def flush(self) -> bool:
        self._maybe_raise("flush")
        return True

    def is_distributed(self) -> bool:
        return self._distributed

    def get_deployment_mode(self) -> UMBPDeploymentMode:
        return UMBPDeploymentMode.Distributed

    def get_backend_mode(self) -> UMBPDeploymentMode:
        return UMBPDeploymentMode.Distributed

    def supports_ranged_io(self) -> bool:
        return False

    def register_memory(self, ptr: int, size: int) -> bool:
        self._maybe_raise("register_memory")
        if not isinstance(ptr, int) or not isinstance(size, int) or ptr < 0 or size < 0:
            raise _incompatible("UMBPClient", "register_memory", (ptr, size))
        if ptr == 0 or size == 0 or not FAKE.register_ok:
            return False                      # "[PoolClient] RegisterMemory: invalid args"
        with self._lock:
            have = self._registered.get(ptr)
            if have is not None and have < size:
                return False                  # "already registered with smaller size"
            self._registered[ptr] = max(size, have or 0)
        return True

    def deregister_memory(self, ptr: int) -> None:
        with self._lock:
            self._registered.pop(ptr, None)

    # state for tests (not part of the real API)
    def _fake_objects(self) -> dict[str, _Object]:
        with self._lock:
            return dict(self._objects)


__all__ = ["CacheRemoteAdmission", "UMBPClient", "UMBPConfig", "UMBPCopyPipelineConfig",
           "UMBPDeploymentMode", "UMBPDistributedConfig", "UMBPDramConfig", "UMBPDurabilityConfig",
           "UMBPDurabilityMode", "UMBPHbmConfig", "UMBPHostBufferBacking", "UMBPHostBufferHandle",
           "UMBPHostMemAllocator", "UMBPIoBackend", "UMBPIoConfig", "UMBPMedium", "UMBPRole",
           "UMBPStandaloneProcessConfig", "UMBPSsdConfig", "UMBPEvictionConfig", "UMBPTierType",
           "UMBPExternalKvMatch", "UMBPExternalKvHitCountEntry"]
