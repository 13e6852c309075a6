"""`umbp`: L3 store on mori's ``UMBPClient`` (amd-mori 1.2.4), as SGLang's UMBP backend uses it.

One kvtier page is one UMBP object, read and written in place through UMBP's pointer API
(``batch_get_into_ptr`` / ``batch_put_from_ptr_with_depth``) straight from a ``page_first``
host pool, whose memory ``attach`` registers with the client for zero-copy transfers.

Object names follow SGLang's UMBP store: the page key in hex, then for MHA the tensor-parallel
rank (each rank holds different heads), for MLA no rank (every rank holds the same latent rows,
so ranks whose page keys agree share one object), then ``kv`` (the object holds the whole page,
K and V of every layer -- SGLang's ``_k``/``_v`` objects hold one half each, which kvtier's
contiguous pages never need)::

    MHA: {key.hex()}_{tp_rank}_kv        MLA: {key.hex()}__kv

UMBP 1.2.4 keeps the first object written under a name (a second put of the name succeeds and
keeps the old bytes) and has no per-key remove. kvtier's contract is overwrite-and-delete, so a
key deleted or rewritten by this store moves to a new generation name (``..._g{n}``): the old
object is never read again and ages out through UMBP's eviction. Generations live in this
process; see the package README for what that means for stores shared between processes.

``batch_set`` passes each page's depth in its prefix chain to UMBP (``depths=``, or
``start_depth + position in the call``), which UMBP uses for prefix-aware eviction (deepest
pages go first) and forwards to the master in distributed deployments.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Literal, Sequence

from kvtier import Availability, Capabilities, L3Store
from kvtier.errors import (BackendUnavailableError, ConfigError, InvalidArgumentError,
                           LayoutError, StoreError)
from kvtier.layout import PAGE_FIRST

from . import KVTIER_INTERFACE_VERSION, _probe

log = logging.getLogger(__name__)
_node_ids = count()

GPU_HINT = ("run on a ROCm 7 host with an AMD Instinct GPU visible to this process (/dev/kfd, "
            "HIP_VISIBLE_DEVICES)")


@dataclass(frozen=True)
class DramConfig:
    """UMBPDramConfig: the DRAM medium (allocated up front)."""

    capacity_bytes: int = 1 << 30
    #: UMBP evicts from ``high_watermark`` of capacity down to ``low_watermark``.
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    hugepages: bool = False
    hugepage_size: int = 2 << 20
    numa_nodes: tuple[int, ...] = ()
    numa_strict: bool = False
    prefault: bool = True


@dataclass(frozen=True)
class SsdConfig:
    """UMBPSsdConfig: the SSD medium (``medium: ssd``)."""

    #: Directory for the segment log; several comma-separated directories stripe drives.
    storage_dir: str = ""
    capacity_bytes: int = 32 << 30
    segment_size_bytes: int = 256 << 20
    io_backend: Literal["io_uring", "posix"] = "io_uring"
    durability: Literal["strict", "relaxed"] = "strict"
    #: CRC on write, verified on read: a corrupt record is a miss, never wrong KV.
    verify_crc: bool = True
    direct_io: bool = True
    background_gc: bool = True


@dataclass(frozen=True)
class EvictionConfig:
    """UMBPEvictionConfig."""

    policy: Literal["lru", "prefix_aware_lru"] = "prefix_aware_lru"
    #: LRU-tail candidates compared by depth under ``prefix_aware_lru``.
    candidate_window: int = 16
    promote_on_read: bool = True


@dataclass(frozen=True)
class DistributedConfig:
    """UMBPDistributedConfig. Without ``master_address`` the store is embedded: one process,
    no master, no sockets (what UMBP itself does when no deployment is configured)."""

    master_address: str = ""
    node_id: str = ""
    node_address: str = ""
    io_engine_host: str = ""
    io_engine_port: int = 0
    peer_service_port: int = 0
    staging_buffer_size: int = 64 << 20
    cache_remote_fetches: bool = True


_ROLES = {"standalone": "Standalone", "shared_ssd_leader": "SharedSSDLeader",
          "shared_ssd_follower": "SharedSSDFollower"}


class UmbpStore(L3Store):
    name = "umbp"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: The one medium this node serves (UMBP serves one per node).
        medium: Literal["dram", "ssd"] = "dram"
        #: This process's tensor-parallel rank: part of MHA object names.
        tp_rank: int = 0
        #: UMBPRole; the shared-SSD roles let MLA ranks share one SSD (leader writes).
        role: Literal["standalone", "shared_ssd_leader", "shared_ssd_follower"] = "standalone"
        #: Register the host pool with the client at attach: ``auto`` warns if UMBP refuses,
        #: ``required`` makes that an error, ``off`` never registers.
        zero_copy: Literal["auto", "required", "off"] = "auto"
        #: A set of a key that exists: ``replace`` writes the new bytes (a new generation),
        #: ``keep`` trusts content addressing and skips the write.
        on_existing: Literal["replace", "keep"] = "replace"
        dram: DramConfig = field(default_factory=DramConfig)
        ssd: SsdConfig = field(default_factory=SsdConfig)
        eviction: EvictionConfig = field(default_factory=EvictionConfig)
        distributed: DistributedConfig = field(default_factory=DistributedConfig)

    # ----- construction -----------------------------------------------------------------------
    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)
        self._validate()
        av, mod = _probe.probe_umbp()
        if not av.ok:
            raise BackendUnavailableError(f"l3_store 'umbp' is unavailable: {av.reason}",
                                          kind="l3_store", name=self.name, reason=av.reason,
                                          hint=av.hint)
        n, why = _probe.amd_gpus()
        if n == 0:
            raise BackendUnavailableError(f"l3_store 'umbp' is unavailable: {why}",
                                          kind="l3_store", name=self.name, reason=why,
                                          hint=GPU_HINT)
        self._mod = mod
        self._lock = threading.RLock()
        self._gen: dict[bytes, int] = {}
        self._registered: int | None = None
        self._zero_copy = False
        self._suffix = (f"_{self.config.tp_rank}_kv" if spec.kind == "mha" else "__kv")
        umbp_config = self._umbp_config()
        try:
            self._client = mod.UMBPClient(umbp_config)
        except Exception as exc:
            raise StoreError(f"umbp: UMBPClient could not start: {type(exc).__name__}: {exc}",
                             backend=self.name) from exc

    def _validate(self) -> None:
        c, page = self.config, self.spec.page_bytes

        def bad(key: str, value: object, why: str) -> ConfigError:
            return ConfigError(f"umbp.{key}={value!r}: {why}", key=f"umbp.{key}", value=value)

        if c.tp_rank < 0:
            raise bad("tp_rank", c.tp_rank, "must be >= 0")
        for section in ("dram", "ssd"):
            s = getattr(c, section)
            if section == "ssd" and c.medium != "ssd":
                continue
            if s.capacity_bytes < page:
                raise bad(f"{section}.capacity_bytes", s.capacity_bytes,
                          f"holds no page of {page} bytes")
        d = c.dram
        if not 0 < d.low_watermark < d.high_watermark <= 1:
            raise bad("dram.low_watermark", d.low_watermark,
                      f"need 0 < low_watermark < high_watermark <= 1 (high={d.high_watermark})")
        hp = d.hugepage_size
        if hp < 4096 or hp & (hp - 1):
            raise bad("dram.hugepage_size", hp, "must be a power of two >= 4096")
        if any(n < 0 for n in d.numa_nodes):
            raise bad("dram.numa_nodes", d.numa_nodes, "node ids are >= 0")
        if c.eviction.candidate_window < 1:
            raise bad("eviction.candidate_window", c.eviction.candidate_window, "must be >= 1")
        if c.medium == "ssd":
            if not c.ssd.storage_dir.strip():
                raise bad("ssd.storage_dir", c.ssd.storage_dir, "medium 'ssd' needs a directory")
            seg = c.ssd.segment_size_bytes
            if seg <= 0 or seg % 4096:
                raise bad("ssd.segment_size_bytes", seg, "must be a positive multiple of 4096")
        dist = c.distributed
        if not 0 <= dist.io_engine_port < 65536 or not 0 <= dist.peer_service_port < 65536:
            raise bad("distributed", (dist.io_engine_port, dist.peer_service_port),
                      "ports must be in [0, 65535]")

    def _umbp_config(self) -> Any:
        """The typed kvtier config written onto a fresh UMBPConfig (UMBP_* environment
        variables are not consulted: this config is the one source of truth)."""
        mod, c = self._mod, self.config
        cfg = mod.UMBPConfig()
        dram = cfg.dram                        # pybind returns struct members by reference
        dram.capacity_bytes = c.dram.capacity_bytes
        dram.high_watermark = float(c.dram.high_watermark)
        dram.low_watermark = float(c.dram.low_watermark)
        dram.use_hugepages = c.dram.hugepages
        dram.hugepage_size = c.dram.hugepage_size
        dram.numa_nodes = list(c.dram.numa_nodes)
        dram.numa_strict = c.dram.numa_strict
        dram.prefault = c.dram.prefault
        ssd = cfg.ssd
        ssd.enabled = c.medium == "ssd"
        if c.medium == "ssd":
            ssd.storage_dir = c.ssd.storage_dir
            ssd.capacity_bytes = c.ssd.capacity_bytes
            ssd.segment_size_bytes = c.ssd.segment_size_bytes
            ssd.io.backend = (mod.UMBPIoBackend.IoUring if c.ssd.io_backend == "io_uring"
                              else mod.UMBPIoBackend.Posix)
            ssd.durability.mode = (mod.UMBPDurabilityMode.Strict if c.ssd.durability == "strict"
                                   else mod.UMBPDurabilityMode.Relaxed)
            ssd.durability.enable_background_gc = c.ssd.background_gc
            ssd.verify_crc = c.ssd.verify_crc
            ssd.direct_io = c.ssd.direct_io
        ev = cfg.eviction
        ev.policy = c.eviction.policy
        ev.candidate_window = c.eviction.candidate_window
        ev.auto_promote_on_read = c.eviction.promote_on_read
        cfg.role = getattr(mod.UMBPRole, _ROLES[c.role])

        # Always an explicit deployment block: it carries the page size (one UMBP page per
        # kvtier page instead of UMBP's 2 MiB default, which would hold one small page per
        # 2 MiB), and without a master it is exactly what UMBP builds for an embedded store.
        d = c.distributed
        embedded = not d.master_address
        dist = mod.UMBPDistributedConfig()
        mc = dist.master_config
        mc.master_address = d.master_address
        mc.node_id = d.node_id or (f"kvtier-{socket.gethostname()}-{os.getpid()}-"
                                   f"{next(_node_ids)}")
        mc.node_address = d.node_address or "127.0.0.1"
        mc.auto_heartbeat = not embedded
        dist.io_engine.host = d.io_engine_host
        dist.io_engine.port = d.io_engine_port
        dist.peer_service_port = d.peer_service_port
        dist.staging_buffer_size = d.staging_buffer_size
        dist.cache_remote_fetches = d.cache_remote_fetches and not embedded
        dist.medium = mod.UMBPMedium.SSD if c.medium == "ssd" else mod.UMBPMedium.DRAM
        dist.dram_page_size = self.spec.page_bytes
        if embedded:
            for attr, value in (("ranged_scratch_size", 0), ("ranged_locality_prefetch", False),
                                ("local_first", True)):
                if hasattr(dist, attr):
                    setattr(dist, attr, value)
        cfg.distributed = dist                 # copied in: assign only when complete
        return cfg

    # ----- discovery ----------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        av, _ = _probe.probe_umbp()
        if not av.ok:
            return av
        n, why = _probe.amd_gpus()
        if n == 0:
            return Availability.unavailable(why, GPU_HINT)
        return Availability.available(f"mori.umbp loaded; {why}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(host_layouts=(PAGE_FIRST,))

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        return {"dram": {"capacity_bytes": 64 << 20, "prefault": False},
                "eviction": {"policy": "prefix_aware_lru"}}

    # ----- helpers ------------------------------------------------------------------------------
    def object_name(self, key: bytes) -> str:
        """The UMBP object name this store reads and writes ``key`` under now."""
        gen = self._gen.get(key, 0)
        return key.hex() + self._suffix + (f"_g{gen}" if gen else "")

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        with self._lock:
            return [self.object_name(k) for k in keys]

    def _live(self) -> Any:
        client = getattr(self, "_client", None)
        if client is None:
            raise StoreError("umbp: the store is closed", backend=self.name)
        return client

    def _call(self, what: str, *args: Any) -> Any:
        """One client call; a raising client is a counted error (the caller turns it into
        misses), never an exception out of a data-path call."""
        client = self._live()
        try:
            return getattr(client, what)(*args)
        except Exception as exc:
            self._count(errors=1)
            with self._stats_lock:
                self._stats.extra["last_error"] = f"{what}: {type(exc).__name__}: {exc}"
            log.warning("umbp: UMBPClient.%s raised %s: %s", what, type(exc).__name__, exc)
            return None

    def _bools(self, what: str, got: Any, n: int) -> list[bool] | None:
        """A per-key result list, or None when the call failed or answered nonsense."""
        if not isinstance(got, (list, tuple)) or len(got) != n:
            if got is not None:                 # None: _call already counted the error
                self._count(errors=1)
                log.warning("umbp: UMBPClient.%s returned %r for %d keys", what, got, n)
            return None
        return [bool(x) for x in got]

    def _page_meta(self, pages: list[int]) -> tuple[list[int], list[int]]:
        assert self.host_pool is not None
        return self.host_pool.get_page_buffer_meta(pages)

    # ----- attach -------------------------------------------------------------------------------
    def attach(self, host_pool) -> None:
        """Bind to a page_first host pool and register its memory for zero-copy I/O."""
        super().attach(host_pool)
        if host_pool.layout != PAGE_FIRST:
            self.host_pool = None
            raise LayoutError(f"umbp: the UMBP store reads and writes whole pages through one "
                              f"pointer each and needs a page_first host pool, got "
                              f"{host_pool.layout!r}")
        self._deregister()
        self._zero_copy = False
        if self.config.zero_copy == "off":
            return
        ptr, nbytes = host_pool.raw.data_ptr(), host_pool.nbytes
        ok = self._call("register_memory", ptr, nbytes)
        if ok:
            self._registered = ptr
            self._zero_copy = True
            return
        msg = (f"umbp: UMBPClient.register_memory(0x{ptr:x}, {nbytes}) refused the host pool "
               "memory")
        if self.config.zero_copy == "required":
            self.host_pool = None
            raise StoreError(msg + " (zero_copy: required)", backend=self.name)
        log.warning("%s; transfers go through UMBP's staging buffers", msg)

    def _deregister(self) -> None:
        if self._registered is not None and getattr(self, "_client", None) is not None:
            self._call("deregister_memory", self._registered)
        self._registered = None

    # ----- data path ----------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        self._live()
        if not keys:
            return 0
        got = self._call("batch_exists_consecutive", self._names(keys))
        if isinstance(got, bool) or not isinstance(got, int):
            if got is not None:
                self._count(errors=1)
            return 0
        return max(0, min(int(got), len(keys)))

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        self._live()
        if not keys:
            return []
        ptrs, sizes = self._page_meta(pages)
        got = self._bools("batch_get_into_ptr",
                          self._call("batch_get_into_ptr", self._names(keys), ptrs, sizes),
                          len(keys)) or [False] * len(keys)
        hits = sum(got)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes)
        return got

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int], *,
                  depths: Sequence[int] | None = None, start_depth: int = 0) -> list[bool]:
        """Write each host page under its key; True where UMBP holds it.

        ``depths[i]`` is page i's position in its prefix chain (0 = first page after the
        namespace root); without ``depths`` the pages are taken as consecutive pages of one
        chain starting at ``start_depth``.
        """
        pages = self._check_batch(keys, host_pages)
        depth_list = self._depths(len(pages), depths, start_depth)
        self._live()
        if not keys:
            return []
        present = self._bools("batch_exists", self._call("batch_exists", self._names(keys)),
                              len(keys))
        if present is None:
            # Without knowing what exists, a write could land on a name UMBP already holds and
            # keep its old bytes while reporting success: fail the batch instead.
            self._count(sets=len(keys))
            return [False] * len(keys)
        keep = self.config.on_existing == "keep"
        out = [False] * len(keys)
        todo: list[int] = []
        with self._lock:
            for i, k in enumerate(keys):
                if present[i] and keep:
                    out[i] = True
                    continue
                if present[i]:
                    self._gen[k] = self._gen.get(k, 0) + 1
                todo.append(i)
            names = [self.object_name(keys[i]) for i in todo]
        if todo:
            ptrs, sizes = self._page_meta([pages[i] for i in todo])
            got = self._bools("batch_put_from_ptr_with_depth",
                              self._call("batch_put_from_ptr_with_depth", names, ptrs, sizes,
                                         [depth_list[i] for i in todo]), len(todo))
            for i, ok in zip(todo, got or [False] * len(todo)):
                out[i] = ok
        written = sum(out[i] for i in todo)
        self._count(sets=len(keys), set_ok=sum(out), errors=len(todo) - written,
                    bytes_written=written * self.spec.page_bytes)
        if len(keys) - len(todo):
            with self._stats_lock:
                extra = self._stats.extra
                extra["set_skipped_existing"] = (extra.get("set_skipped_existing", 0)
                                                 + len(keys) - len(todo))
        return out

    @staticmethod
    def _depths(n: int, depths: Sequence[int] | None, start_depth: int) -> list[int]:
        if isinstance(start_depth, bool) or not isinstance(start_depth, int) or start_depth < 0:
            raise InvalidArgumentError(f"umbp: start_depth must be an int >= 0, got "
                                       f"{start_depth!r}", argument="start_depth",
                                       value=start_depth)
        if depths is None:
            return [start_depth + i for i in range(n)]
        if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence):
            raise InvalidArgumentError(f"umbp: depths must be a sequence of ints, got "
                                       f"{type(depths).__name__}", argument="depths")
        if len(depths) != n:
            raise InvalidArgumentError(f"umbp: {n} keys but {len(depths)} depths",
                                       argument="depths", value=len(depths))
        for d in depths:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise InvalidArgumentError(f"umbp: depth {d!r} is not an int >= 0",
                                           argument="depths", value=d)
        return list(depths)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Make keys read as missing; returns how many existed. UMBP 1.2.4 has no remove: the
        objects stay until evicted, under names this store no longer reads."""
        self._check_batch(keys)
        self._live()
        if not keys:
            return 0
        present = self._bools("batch_exists", self._call("batch_exists", self._names(keys)),
                              len(keys))
        with self._lock:
            for i, k in enumerate(keys):
                # Unknown (the query failed): move the key anyway, so it reads as deleted.
                if present is None or present[i]:
                    self._gen[k] = self._gen.get(k, 0) + 1
        return sum(present) if present is not None else 0

    def clear(self) -> None:
        """Clear the UMBP client: everything it holds, which for a store shared through a master
        or standalone server includes other processes' objects."""
        ok = self._call("clear")
        if ok is False or ok is None:
            raise StoreError("umbp: UMBPClient.clear() did not reach the empty state",
                             backend=self.name)
        with self._lock:
            self._gen.clear()

    def flush(self) -> bool:
        """Persist pending write-back data (SSD medium); True when UMBP reports success."""
        return bool(self._call("flush"))

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        with self._lock:
            d.update(medium=self.config.medium, zero_copy=self._zero_copy,
                     deployment="distributed" if self.config.distributed.master_address
                     else "embedded", relocated_keys=len(self._gen))
        return d

    def close(self) -> None:
        """Deregister the pool, flush, and drop the client (UMBP closes it on destruction)."""
        if getattr(self, "_client", None) is None:
            return
        try:
            self._deregister()
            if self._call("flush") is False:
                log.warning("umbp: flush at close reported failure")
        finally:
            self._client = None
