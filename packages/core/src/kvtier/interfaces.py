"""The three extension points: host allocators, L3 stores and transfer engines.

A backend is a subclass of one of these, registered under the matching entry-point group
(``kvtier.host_allocators``, ``kvtier.l3_stores``, ``kvtier.transfer_engines``). Every backend
declares ``name``, the ``INTERFACE_VERSION`` it implements, a frozen-dataclass ``Config`` and a
classmethod ``probe()`` that exercises its runtime and says why it cannot run; what it can do
is a `Capabilities` from ``capabilities()``, which core reads instead of a backend's name.
The helpers a backend validates with (`check_keys`, `check_nbytes`) are here too; the
contract suites in `kvtier.testing` check all of it (docs/backends.md is the guide).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .device_pool import DeviceKVPool
    from .host_pool import HostKVPool
    from .spec import KVSpec

#: Version of the backend interfaces below; a backend built for another one is refused.
INTERFACE_VERSION = 1

HOST_ALLOCATORS = "kvtier.host_allocators"
L3_STORES = "kvtier.l3_stores"
TRANSFER_ENGINES = "kvtier.transfer_engines"
GROUPS = (HOST_ALLOCATORS, L3_STORES, TRANSFER_ENGINES)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; when not, why and how to fix it."""

    ok: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def available(cls, note: str = "") -> "Availability":
        return cls(True, note, "")

    @classmethod
    def unavailable(cls, reason: str, hint: str = "") -> "Availability":
        return cls(False, reason, hint)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as flags rather than surprises. Each field is read by core (the
    contract suites, the benchmarks, the controller's checks), never a backend's name."""

    #: Stores and engines: the host-pool layouts they work with.
    host_layouts: tuple[str, ...] = ("page_first", "layer_first")
    #: Transfer engines: torch device types they move data for ("any torch device": all).
    device_types: tuple[str, ...] = ()
    #: Transfer engines: page indices are read on the host (copy addresses are built by the
    #: CPU), so callers pass Python lists or CPU tensors; device tensors cost a sync.
    host_indices: bool = False
    #: Transfer engines: a KV row (``spec.row_bytes``) must be a multiple of this many bytes
    #: (16 for engines that move 16-byte units); other geometries raise LayoutError.
    row_alignment: int = 1
    #: Transfer engines: rank for ``transfer_engine="auto"`` among the available engines that
    #: move data for the device type (higher first); None: never chosen automatically.
    auto_priority: int | None = None
    #: Transfer engines: ``load`` takes ``layers=(lo, hi)`` and moves layers ``lo`` to
    #: ``hi - 1`` only (its handle answers ``wait_layer`` for those), so a load can follow
    #: L3 reads that land layer group by layer group (`L3Store.read_groups`).
    layer_ranges: bool = False


class Backend(abc.ABC):
    """Common part of every backend class."""

    #: The name users ask for (the entry-point name must equal it).
    name: ClassVar[str] = ""
    #: INTERFACE_VERSION this backend was built for. Deliberately no default: every backend
    #: declares it (vendor packages from their own constant), so a stale build is caught.
    interface_version: ClassVar[int]

    @dataclass(frozen=True)
    class Config:
        """Typed configuration; subclasses define their own frozen dataclass."""

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> Availability:
        """Exercise the runtime this backend needs (not just find_spec) and report."""

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities()

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        """A small config that works on this machine (contract tests, ``kvtier backends``);
        ``workdir`` is a scratch directory the backend may use."""
        return {}


# --------------------------------------------------------------------------------------------
# Host allocators
# --------------------------------------------------------------------------------------------
@dataclass
class HostBuffer:
    """A block of host memory and an honest account of what backs it."""

    ptr: int
    nbytes: int
    tensor: "torch.Tensor"                   # 1-D uint8 view of the whole block
    backing: str                            # e.g. "hugetlb-2MiB", "thp", "anonymous", "cuda-pinned"
    numa_node: int | None = None            # where the pages really are, None if unknown
    device_addressable: bool = False        # a device can DMA/address it directly (pinned etc.)
    page_size_bytes: int = 4096             # OS page size backing it
    details: dict[str, Any] = field(default_factory=dict)
    _release: Any = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Release the memory; idempotent. Views of ``tensor`` must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        release, self._release = self._release, None
        import torch
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if release is not None:
            release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostAllocator(Backend):
    """Allocates host memory for the L2 pool. Subclasses implement ``_allocate``; callers use
    ``allocate``, which checks the size first."""

    def __init__(self, config: Any = None):
        from .config import build_config
        self.config = build_config(type(self).Config, config, section=self.name)

    def allocate(self, nbytes: int) -> HostBuffer:
        """Allocate ``nbytes`` (no power-of-two rounding visible to the caller); a size that is
        not a positive int is an InvalidArgumentError before anything is allocated."""
        return self._allocate(check_nbytes(nbytes, self.name))

    @abc.abstractmethod
    def _allocate(self, nbytes: int) -> HostBuffer:
        """Allocate ``nbytes`` (already checked: a positive int)."""


def check_nbytes(nbytes: object, backend: str = "") -> int:
    """A byte count must be a positive int (not a bool); raise a typed error naming it."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        from .errors import InvalidArgumentError
        raise InvalidArgumentError(f"{backend}: nbytes must be a positive int, got {nbytes!r}",
                                   argument="nbytes", value=nbytes)
    return nbytes


# --------------------------------------------------------------------------------------------
# L3 stores
# --------------------------------------------------------------------------------------------
@dataclass
class StoreStats:
    """Counters every store keeps; stores may add their own in ``extra``."""

    gets: int = 0
    get_hits: int = 0
    sets: int = 0
    set_ok: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    corrupted: int = 0
    evictions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("extra"))
        return d


class L3Store(Backend):
    """Page-granular object store for KV pages, attached to a host pool.

    Reads go straight into host-pool pages; writes come straight from them. ``batch_get`` and
    ``batch_set`` return one bool per key and callers act only on leading successes. A store
    never returns bytes it cannot vouch for: a corrupted or truncated object is a miss and a
    counted error. Store failures are misses and counted errors, not exceptions, except for
    caller mistakes (bad arguments), which raise typed errors before anything is touched.
    """

    def __init__(self, config: Any = None, *, spec: "KVSpec"):
        from .config import build_config
        self.config = build_config(type(self).Config, config, section=self.name)
        self.spec = spec
        self.host_pool: "HostKVPool | None" = None
        self._stats = StoreStats()
        self._stats_lock = threading.Lock()

    def attach(self, host_pool: "HostKVPool") -> None:
        """Bind to the host pool whose pages are read into / written from."""
        from .errors import ConfigError
        if host_pool.spec.fingerprint != self.spec.fingerprint:
            raise ConfigError(f"{self.name}: host pool spec {host_pool.spec} does not match the "
                              f"store's {self.spec}", key="spec")
        self.host_pool = host_pool

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """Number of consecutive leading keys that exist."""

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        """Read each key into the given host page; True where the page now holds it."""

    @abc.abstractmethod
    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        """Write each host page under its key; True where it is stored."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete keys; returns how many existed."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Delete everything this store holds (for its namespace)."""

    def _copy_into_page(self, page: int, data: "torch.Tensor") -> None:
        """Copy ``data`` (one page's bytes, flat uint8, logical order) into host page ``page``
        of the attached pool, whatever its layout."""
        assert self.host_pool is not None, "attach(host_pool) first"
        off = 0
        for seg in self.host_pool.page_segments(page):
            seg.copy_(data[off:off + seg.numel()])
            off += seg.numel()

    def object_nbytes(self) -> int:
        """Bytes one stored page counts against the store's ``capacity_bytes`` (if it has
        one), once attached: the page itself unless the store adds framing or padding."""
        return self.spec.page_bytes

    def read_groups(self) -> tuple[tuple[int, int], ...]:
        """The layer ranges ``(lo, hi)`` that `batch_get_layers` reads one at a time, in
        layer order, covering every layer: each range of an object is checked on its own, so
        a reader may use layers ``lo..hi-1`` of a page before the rest has arrived (streamed
        loads). Empty (the default): whole pages only, through `batch_get`."""
        return ()

    def batch_get_layers(self, keys: Sequence[bytes], host_pages: Sequence[int],
                         group: int, through: int | None = None) -> list[bool]:
        """Read layer range ``read_groups()[group]`` of each key into its host page (the
        pool's other bytes of the page are not touched): True where those layers now hold
        the key's bytes, verified against that range's own checksum (an object without one is
        read and verified whole). With ``through`` (a group after ``group``), groups
        ``group`` through ``through`` are read as one range, verified as one: fewer, larger
        calls where the reader needs those layers at once. A page is the key's only once every
        group came back True for it. Stores with no `read_groups` do not implement it."""
        from .errors import InvalidArgumentError
        raise InvalidArgumentError(f"{self.name}: this store reads whole pages only "
                                   "(read_groups() is empty)", argument="group", value=group)

    def _check_span(self, group: Any, through: Any, n: int) -> int:
        """Validate `batch_get_layers`'s ``group`` and ``through`` against ``n`` groups;
        returns ``through`` (``group`` where None)."""
        from .errors import InvalidArgumentError
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < n:
            raise InvalidArgumentError(f"{self.name}: group must be an int in [0, {n}), got "
                                       f"{group!r}", argument="group", value=group)
        if through is None:
            return group
        if isinstance(through, bool) or not isinstance(through, int) \
                or not group <= through < n:
            raise InvalidArgumentError(f"{self.name}: through must be an int in [{group}, "
                                       f"{n}), got {through!r}", argument="through",
                                       value=through)
        return through

    def in_place_reads(self) -> "InPlaceReads | None":
        """Where the store's objects sit in host memory that a transfer engine can read
        directly (a shared-memory arena), the region and how to hold objects in it while
        they are copied; None (the default) where reads go through a host pool page."""
        return None

    def stage(self, keys: Sequence[bytes]) -> Any:
        """Start copying ``keys`` into the region `in_place_reads` exposes, from wherever
        else the store holds them, without the caller's threads doing the copy; returns at
        once with a ticket (``wait(timeout) -> bool``, ``done()``, ``cancel()``, ``staged``,
        ``t0`` its start on ``time.perf_counter()``, ``timeout_s`` the store's longest wait
        for it), or None (the default) where the store has nothing to stage (every page it holds is
        already in place, or it has no such region). The store may hold the staged pages in
        that region until ``cancel()``, which the caller calls once it has pinned them for
        its load, or when the request leaves."""
        return None

    def _check_batch(self, keys: Sequence[bytes], host_pages: Sequence[int] | None = None,
                     *, distinct_pages: bool = False) -> list[int]:
        """Validate a batch before anything is touched; returns the pages as ints.

        ``distinct_pages`` (every ``batch_get``): a host page named twice would end up
        holding only one of its keys while both report a hit, so it is refused."""
        from .errors import InvalidArgumentError
        check_keys(keys, self.name)
        if host_pages is None:
            return []
        if self.host_pool is None:
            raise InvalidArgumentError(f"{self.name}: store is not attached to a host pool; "
                                       "call attach(host_pool) first", argument="host_pool")
        pages = self.host_pool.check_pages(host_pages).tolist()
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{self.name}: {len(keys)} keys but {len(pages)} host "
                                       "pages", argument="host_pages", value=len(pages))
        if distinct_pages and len(set(pages)) != len(pages):
            raise InvalidArgumentError(f"{self.name}: batch_get got a host page twice",
                                       argument="host_pages")
        return pages

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return self._stats.as_dict()

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def close(self) -> None:
        """Release resources; idempotent."""

    def __enter__(self) -> "L3Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InPlaceReads(abc.ABC):
    """A store's objects read in place: ``buffer`` is host memory laid out as ``num_slots``
    page-first pages of ``spec.page_bytes`` each (slot i at ``i * page_bytes``), so a host
    pool over it lets a transfer engine load slot i into a device page with no copy through
    another host page. ``pin`` holds the slots of the leading run of keys it finds so that
    no writer (of any process) changes them until ``unpin``."""

    buffer: "HostBuffer"
    num_slots: int

    @abc.abstractmethod
    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """The slots holding the leading run of ``keys`` (stops at the first miss), each
        held until `unpin`; counted as reads by the store."""

    @abc.abstractmethod
    def unpin(self, slots: Sequence[int]) -> None:
        """Let go of slots `pin` returned (each once)."""


def check_keys(keys: Sequence[bytes], backend: str = "") -> None:
    """Keys must be a sequence of non-empty bytes; raise a typed error naming the bad one."""
    from .errors import InvalidArgumentError
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(f"{backend}: keys must be a sequence of bytes, got "
                                   f"{type(keys).__name__}", argument="keys")
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or not k:
            raise InvalidArgumentError(f"{backend}: key {i} must be non-empty bytes, got {k!r}",
                                       argument="keys", value=k)


# --------------------------------------------------------------------------------------------
# Transfer engines
# --------------------------------------------------------------------------------------------
class TransferHandle(abc.ABC):
    """Completion of one load/backup: whole (``wait``/``done``) or per layer (``wait_layer``),
    for the caller's stream, and ``synchronize`` for the calling thread (the controller calls
    it before it hands a host page to L3 or frees a source page)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Make the caller's stream (or thread, on CPU) wait for every layer."""

    @abc.abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Make the caller wait for layer ``layer`` only."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every layer has landed (non-blocking)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until every layer has really landed."""

    def busy_seconds(self) -> float | None:
        """Seconds the copies themselves ran, once landed, where the engine measures them
        (None: not measured -- callers time the transfer from start to landed). Engines
        whose copies run on the host's cores give it: there, start to landed also counts the
        time their thread waited for a core or the interpreter beside the engine's compute,
        which is not the copies' bandwidth."""
        return None


class CompletedHandle(TransferHandle):
    """A handle for work that finished synchronously."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def wait(self) -> None:
        return None

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            from .errors import LayoutError
            raise LayoutError(f"layer {layer} out of range [0, {self.num_layers})")

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class TransferEngine(Backend):
    """Moves pages between a device pool (layer_first) and a host pool.

    ``load`` is host -> device, ``backup`` device -> host. Index lists may be Python sequences or
    int64 tensors (on the device, to avoid a host sync). No hidden stream synchronisation.
    """

    def __init__(self, device_pool: "DeviceKVPool", host_pool: "HostKVPool", config: Any = None):
        from .config import build_config
        from .errors import ConfigError
        self.config = build_config(type(self).Config, config, section=self.name)
        if device_pool.spec.fingerprint != host_pool.spec.fingerprint:
            raise ConfigError(f"{self.name}: device pool spec {device_pool.spec} differs from "
                              f"host pool spec {host_pool.spec}", key="spec")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.spec = device_pool.spec

    @abc.abstractmethod
    def load(self, host_pages: "Sequence[int] | torch.Tensor",
             device_pages: "Sequence[int] | torch.Tensor",
             layers: tuple[int, int] | None = None) -> TransferHandle:
        """Copy host pages into device pages (H2D), layer by layer. ``layers=(lo, hi)``
        (engines whose capabilities say ``layer_ranges``; others raise): only layers ``lo``
        to ``hi - 1``, the rest of the pages untouched; the handle then answers
        ``wait_layer`` for those layers (others raise `LayoutError`)."""

    @abc.abstractmethod
    def backup(self, device_pages: "Sequence[int] | torch.Tensor",
               host_pages: "Sequence[int] | torch.Tensor") -> TransferHandle:
        """Copy device pages into host pages (D2H)."""

    def indices_on_host(self, direction: str) -> bool:
        """Whether this engine reads the page indices of a transfer in ``direction`` ("h2d" or
        "d2h") on the host, so that callers holding both kinds pass Python lists or CPU
        tensors there (device tensors cost a sync) and device tensors otherwise. Default: the
        class's ``capabilities().host_indices``; an engine that routes each direction to an
        engine of its own answers per direction."""
        if direction not in ("h2d", "d2h"):
            from .errors import InvalidArgumentError
            raise InvalidArgumentError(f"direction must be 'h2d' or 'd2h', got {direction!r}",
                                       argument="direction", value=direction)
        return type(self).capabilities().host_indices

    def close(self) -> None:
        """Release resources; idempotent."""
