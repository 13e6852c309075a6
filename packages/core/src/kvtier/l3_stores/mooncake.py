"""`mooncake`: a distributed L3 on Mooncake Store, shared by every engine that uses one master.

Every client (this store, in each engine process) may contribute a memory *segment* to one
cluster-wide pool; the master places objects in segments and any client reads any object. That
is what makes L3 shared across servers: process A commits a prompt's pages, process B -- another
engine, another host -- matches and fetches them.

How kvtier maps onto it:

* **Keys.** A page key (already folding model, KV geometry, TP rank and salt, see
  :mod:`kvtier.keys`) becomes ``<namespace>/<spec fingerprint>/<key hex>``, so two models,
  layouts or deployments never collide and ``clear()`` wipes one namespace only.
* **Zero copy.** ``attach()`` registers the host pool's buffer once; a ``page_first`` pool's
  pages are read/written in place (``batch_get_into`` / ``batch_upsert_from`` with page
  pointers). A ``layer_first`` pool reads in place too (``batch_get_into_multi_buffers`` over
  the page's chunks) but writes through Mooncake's local buffer (``upsert_parts``, one copy),
  because Mooncake has no multi-buffer upsert; ``local_buffer_size`` must then hold a page.
* **Failures are misses.** Every Mooncake error code becomes a miss (or an unstored page) and a
  counted error (``stats()["error_codes"]``). No call waits longer than ``timeout_s``: Mooncake's
  own RPC and transfer timeouts are set to a quarter of it, writes are refused at once while
  the client's health check says the master is unreachable, and a watchdog returns misses if a
  call still overruns (see ``_run``). A full pool answers puts with ``NO_AVAILABLE_HANDLE``:
  those pages are simply not stored.
* **Atomicity.** Mooncake publishes an object only when its writer ends the put; an object
  whose writer died mid-transfer stays unreadable (``REPLICA_IS_NOT_READY``) until the master
  discards it, so a reader never sees half an object. A read whose size differs from a page is
  a miss and counted as ``corrupted``. ``batch_set`` upserts: an existing object of the same
  size is rewritten in place (new reads wait it out as not ready, a read already transferring
  could mix old and new bytes). Page keys name their content, so a rewrite stores the same
  bytes; don't reuse a key for different bytes while others read it.
* **Leases.** Mooncake leases an object to a client that queried or read it, and refuses to
  remove it meanwhile. ``delete`` waits up to ``lease_wait_s`` for leases to lapse and only
  then (with ``force_remove``) forces; ``clear`` always forces (it is a reset: don't run it
  while other clients read the namespace).

Deployment: run ``mooncake_master`` (it ships in the wheel) with ``--rpc_address`` set to the
address clients use, and leave its HTTP metadata server off: clients here use P2P handshakes
(``metadata_server="P2PHANDSHAKE"``). Note that the TCP transport of
mooncake-transfer-engine 0.3.13 listens on every interface and serves raw reads/writes of
registered memory to whoever connects; keep Mooncake hosts on a private network.

One Mooncake client serves every store of a process with the same cluster settings (a client is
a transfer engine, a master connection and a mounted segment; Mooncake's close holds the GIL for
1-2 s, so idle clients are reused and closed at exit). Mooncake reads its timeouts and bind
address from process-wide ``MC_*`` environment variables when a client is created; this store
sets them from its config just before creating one.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from ..errors import BackendUnavailableError, ConfigError, StoreError
from ..interfaces import INTERFACE_VERSION, Availability, Capabilities, L3Store
from ..layout import PAGE_FIRST, page_ranges

log = logging.getLogger(__name__)

#: Mooncake Store error codes (mooncake-store/include/types.h), for readable stats.
ERROR_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND", -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION", -400: "INVALID_KEY",
    -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK", -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS", -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200
#: Codes that mean "not there (yet)": a plain miss, not an error.
_MISS_CODES = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)

ENV_PREFIX = "KVTIER_MOONCAKE_"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
_MIN_TIMEOUT_S = 2.5
_MIN_SEGMENT = 16 << 20
_REGEX_SPECIAL = set(".^$|?*+()[]{}\\")
_INSTALL_HINT = ("pip install 'kvtier-core[mooncake]' (mooncake-transfer-engine-non-cuda; "
                 "the CUDA build is mooncake-transfer-engine) and, on Debian/Ubuntu, "
                 "apt-get install libibverbs1")


def _code_name(code: int) -> str:
    return ERROR_CODES.get(code, f"code_{code}")


class _Refused(Exception):
    """A call refused before reaching Mooncake (master unreachable)."""


class MooncakeStore(L3Store):
    """L3 store on a Mooncake Store cluster (one master, segments contributed by clients)."""

    name = "mooncake"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: ``host:port`` of the mooncake_master RPC service.
        master_address: str = "127.0.0.1:50051"
        #: Address other clients reach this one at (its segment and transfers).
        local_hostname: str = "127.0.0.1"
        #: Transfer-engine metadata: "P2PHANDSHAKE" (no metadata server) or an etcd/HTTP URL.
        metadata_server: str = "P2PHANDSHAKE"
        protocol: Literal["tcp", "rdma"] = "tcp"
        #: RDMA devices ("mlx5_0,mlx5_1"); empty for TCP.
        rdma_devices: str = ""
        #: Bytes of memory this client contributes to the shared pool (0: store nothing here).
        global_segment_size: int = 1 << 30
        #: Client-side staging buffer (writes of layer_first pools go through it).
        local_buffer_size: int = 64 << 20
        #: Copies of each page kept in the pool (on distinct segments).
        replica_num: int = 1
        #: Prefix of every key, so deployments and tests sharing a master never collide.
        namespace: str = "kvtier"
        #: The most any call on this store waits (seconds); Mooncake's own RPC and transfer
        #: timeouts are set to a quarter of it.
        timeout_s: float = 5.0
        #: Threads issuing Mooncake calls (concurrent batches from different caller threads).
        io_threads: int = 4
        #: How long ``delete`` waits for other clients' read leases to lapse.
        lease_wait_s: float = 1.0
        #: After ``lease_wait_s``, remove leased objects anyway (a reader mid-transfer may then
        #: race a new object placed in the freed memory: keep False unless nobody reads).
        force_remove: bool = False
        #: Client creation attempts (each ~4.5 s when the master refuses connections).
        connect_retries: int = 3
        #: Sets MC_TCP_BIND_ADDRESS; empty: ``local_hostname``. (The listeners of
        #: mooncake-transfer-engine 0.3.13 still bind every interface: see the module doc.)
        tcp_bind_address: str = ""

    # ----- discovery ----------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        try:
            from mooncake.store import MooncakeDistributedStore
            MooncakeDistributedStore()          # constructs the C++ client (no connection yet)
        except (ImportError, OSError, RuntimeError) as exc:
            reason = f"mooncake store client unusable: {type(exc).__name__}: {exc}"
            hint = _INSTALL_HINT
            if "libibverbs" in str(exc):
                hint = "apt-get install libibverbs1 (the wheel links against it even for TCP)"
            return Availability.unavailable(reason, hint)
        return Availability.available(f"mooncake-transfer-engine {_mooncake_version()}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(zero_copy=True, shared_across_processes=True, persistent=False,
                            host_layouts=("page_first", "layer_first"))

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        """Points at ``$KVTIER_MOONCAKE_MASTER_ADDRESS`` (test fixtures start a master there);
        a namespace unique to ``workdir`` keeps concurrent users apart."""
        ns = "kvtier-example-" + hashlib.sha256(os.fsencode(workdir)).hexdigest()[:12]
        return {"master_address": os.environ.get(ENV_PREFIX + "MASTER_ADDRESS",
                                                 cls.Config.master_address),
                "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                "namespace": ns, "timeout_s": 5.0}

    @classmethod
    def config_from_env(cls, environ: dict[str, str] | None = None,
                        base: dict[str, Any] | None = None) -> "MooncakeStore.Config":
        """Config from ``KVTIER_MOONCAKE_<FIELD>`` variables layered over ``base``."""
        from ..config import config_from_env
        return config_from_env(cls.Config, ENV_PREFIX, environ, base)

    # ----- life cycle ---------------------------------------------------------------------
    def __init__(self, config: Any = None, *, spec):
        if config is None:
            config = self.config_from_env()
        super().__init__(config, spec=spec)
        self._check_config()
        self._closed = False
        self._lock = threading.Lock()
        self._extra: dict[str, Any] = {"timeouts": 0, "refused": 0, "no_space": 0,
                                       "wedged": 0, "late_completions": 0, "leased": 0,
                                       "error_codes": {}}
        self._stuck = 0
        self._registered: tuple[int, int] | None = None
        self._prefix = f"{self.config.namespace}/{spec.fingerprint}/"
        try:
            from mooncake.store import ReplicateConfig
        except (ImportError, OSError, RuntimeError) as exc:
            raise BackendUnavailableError(
                f"mooncake: cannot import the Mooncake store client: {exc}", kind="l3_store",
                name=self.name, reason=str(exc), hint=_INSTALL_HINT) from exc
        self._client_key = _client_key(self.config)
        self._client = _acquire_client(self.config)
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = self.config.replica_num
        self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads,
                                        thread_name_prefix="kvtier-mooncake")

    def _check_config(self) -> None:
        c = self.config
        where = self.name

        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{where}.{key}={getattr(c, key)!r}: {why}", key=f"{where}.{key}",
                               value=getattr(c, key))
        if not _NAMESPACE_RE.match(c.namespace):
            raise bad("namespace", "use 1-64 characters from [A-Za-z0-9_.:-]")
        if ":" not in c.master_address:
            raise bad("master_address", "expected host:port")
        if c.global_segment_size < 0 or c.local_buffer_size < 0:
            key = "global_segment_size" if c.global_segment_size < 0 else "local_buffer_size"
            raise bad(key, "must be >= 0")
        if 0 < c.global_segment_size < _MIN_SEGMENT:
            raise bad("global_segment_size", f"Mooncake needs 0 (contribute nothing) or at "
                      f"least {_MIN_SEGMENT} bytes")
        if c.replica_num < 1:
            raise bad("replica_num", "must be >= 1")
        if c.timeout_s < _MIN_TIMEOUT_S:
            raise bad("timeout_s", f"must be >= {_MIN_TIMEOUT_S} (Mooncake's transfer timeout "
                      "has a 1 s granularity)")
        if c.io_threads < 1:
            raise bad("io_threads", "must be >= 1")
        if c.lease_wait_s < 0:
            raise bad("lease_wait_s", "must be >= 0")
        if c.connect_retries < 1:
            raise bad("connect_retries", "must be >= 1")

    def attach(self, host_pool) -> None:
        """Bind to a host pool and register its whole buffer with Mooncake once."""
        if self._closed:
            raise StoreError("mooncake: store is closed", backend=self.name)
        previous = self.host_pool
        super().attach(host_pool)                              # spec check
        if host_pool.layout != PAGE_FIRST and \
                self.config.local_buffer_size < self.spec.page_bytes:
            self.host_pool = previous
            raise ConfigError(
                f"mooncake: a layer_first host pool writes through the local buffer, so "
                f"mooncake.local_buffer_size={self.config.local_buffer_size} must hold a page "
                f"of {self.spec.page_bytes} bytes (or use a page_first pool)",
                key="mooncake.local_buffer_size", value=self.config.local_buffer_size)
        ptr, nbytes = host_pool.raw.data_ptr(), host_pool.nbytes
        if self._registered != (ptr, nbytes):
            rc = _register(self._client, ptr, nbytes)
            if rc != 0:
                self.host_pool = previous
                raise StoreError(f"mooncake: registering the host pool ({nbytes} bytes) failed "
                                 f"({_code_name(rc)})", backend=self.name)
            if self._registered is not None:
                _unregister(self._client, *self._registered)
            self._registered = (ptr, nbytes)

    def close(self) -> None:
        """Unregister the host pool and give the client back to the process's client pool.

        Clients are shared per process and cluster config (see ``_acquire_client``): Mooncake's
        own close holds the GIL for 1-2 s, so idle clients are closed at interpreter exit,
        when their segments leave the cluster.
        """
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + self.config.timeout_s
        while self._stuck and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._stuck:   # a call still inside Mooncake: never reuse or close under it
            log.error("mooncake: %d call(s) still running after %.1fs; retiring the client "
                      "with them", self._stuck, self.config.timeout_s)
            _release_client(self._client_key, self._client, reusable=False)
            return
        if self._registered is not None:
            _unregister(self._client, *self._registered)
            self._registered = None
        _release_client(self._client_key, self._client, reusable=True)

    # ----- keys and bookkeeping -----------------------------------------------------------
    def object_key(self, key: bytes) -> str:
        """The Mooncake key of one kvtier page key."""
        return self._prefix + key.hex()

    def _count_code(self, code: int) -> None:
        name = _code_name(code)
        with self._lock:
            codes = self._extra["error_codes"]
            codes[name] = codes.get(name, 0) + 1
            if code == NO_AVAILABLE_HANDLE:
                self._extra["no_space"] += 1
        self._count(errors=1)

    def _bump(self, field: str, n: int = 1) -> None:
        with self._lock:
            self._extra[field] += n

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        with self._lock:
            d.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in self._extra.items()})
            d["stuck_calls"] = self._stuck
        return d

    # ----- calls with a deadline ----------------------------------------------------------
    def _run(self, op: str, fn: Callable[[], Any],
             on_late: Callable[[Any], None] | None = None) -> Any:
        """Run ``fn`` (one Mooncake call) on the I/O pool; its result, or None on failure.

        None (a miss for the caller) when Mooncake raised, the call was refused, or it ran past
        ``timeout_s``. A call past its deadline that already started cannot be stopped: it is
        left to finish on its thread (``on_late`` then sees its result: a late put's objects
        are removed, since the pages it read may have changed since), and while ``io_threads``
        such calls are pending every new call fails at once instead of queueing behind them.
        """
        if self._closed:
            raise StoreError("mooncake: store is closed", backend=self.name)
        with self._lock:
            wedged = self._stuck >= self.config.io_threads
        if wedged:
            self._bump("wedged")
            self._count(errors=1)
            return None
        fut = self._pool.submit(fn)
        try:
            return fut.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self._bump("timeouts")
            self._count(errors=1)
            if not fut.cancel():
                with self._lock:
                    self._stuck += 1
                log.warning("mooncake: %s ran past %.1fs; returning misses", op,
                            self.config.timeout_s)
                fut.add_done_callback(lambda f: self._late(op, f, on_late))
            return None
        except _Refused:
            self._bump("refused")
            self._count(errors=1)
            return None
        except Exception as exc:       # whatever the binding raises is a failed call
            log.warning("mooncake: %s failed: %s: %s", op, type(exc).__name__, exc)
            self._count(errors=1)
            return None

    def _late(self, op: str, fut, on_late: Callable[[Any], None] | None) -> None:
        with self._lock:
            self._stuck -= 1
            self._extra["late_completions"] += 1
        if on_late is None or fut.cancelled() or fut.exception() is not None:
            return
        try:
            on_late(fut.result())
        except Exception as exc:
            log.error("mooncake: cleaning up after a late %s failed: %s", op, exc)

    def _require_master(self) -> None:
        """Writes and removes retry connecting for seconds when the master is gone; refuse
        them while the client's (cached, instant) health check says it is unreachable."""
        if self._client.health_check() != 0:
            raise _Refused()

    # ----- the L3Store API ----------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        if not keys:
            return 0
        mkeys = [self.object_key(k) for k in keys]
        codes = self._run("batch_exists", lambda: self._client.batch_is_exist(mkeys))
        if codes is None:
            return 0
        n = 0
        for c in codes:
            if c == 1:
                n += 1
                continue
            if c < 0:
                self._count_code(c)
            break
        return n

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        if not keys:
            return []
        mkeys = [self.object_key(k) for k in keys]
        pool, page_bytes = self.host_pool, self.spec.page_bytes
        if pool.layout == PAGE_FIRST:
            ptrs, sizes = pool.get_page_buffer_meta(pages)
            fn = lambda: self._client.batch_get_into(mkeys, ptrs, sizes)
        else:
            all_ptrs, all_sizes = self._chunks(pages)
            fn = lambda: self._client.batch_get_into_multi_buffers(mkeys, all_ptrs, all_sizes)
        res = self._run("batch_get", fn, on_late=lambda r: log.error(
            "mooncake: a timed-out batch_get completed late; host pages %s were reported as "
            "misses but may since have been written", pages))
        out = [False] * len(keys)
        if res is not None:
            for i, r in enumerate(res):
                if r == page_bytes:
                    out[i] = True
                elif r >= 0:            # an object of the wrong size: never a hit
                    self._count(corrupted=1, errors=1)
                elif r not in _MISS_CODES:
                    self._count_code(r)
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * page_bytes)
        return out

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages)
        if not keys:
            return []
        mkeys = [self.object_key(k) for k in keys]
        pool, rcfg = self.host_pool, self._replicate
        if pool.layout == PAGE_FIRST:
            ptrs, sizes = pool.get_page_buffer_meta(pages)

            def fn() -> list[int]:
                self._require_master()
                return self._client.batch_upsert_from(mkeys, ptrs, sizes, rcfg)
        else:
            parts = [[seg.numpy().data for seg in pool.page_segments(p)] for p in pages]

            def fn() -> list[int]:
                self._require_master()
                return [self._client.upsert_parts(k, *ps, config=rcfg)
                        for k, ps in zip(mkeys, parts)]

        def late(codes: list[int]) -> None:
            stored = [k for k, c in zip(mkeys, codes) if c == 0]
            if stored:
                self._client.batch_remove(stored, True)

        codes = self._run("batch_set", fn, on_late=late)
        out = [False] * len(keys)
        if codes is not None:
            for i, c in enumerate(codes):
                if c == 0:
                    out[i] = True
                else:
                    self._count_code(c)
        ok = sum(out)
        self._count(sets=len(keys), set_ok=ok, bytes_written=ok * self.spec.page_bytes)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        if not keys:
            return 0
        pending = [self.object_key(k) for k in keys]
        removed = 0
        deadline = time.monotonic() + min(self.config.lease_wait_s, self.config.timeout_s)
        force = False
        while pending:
            batch = pending

            def fn(batch=batch, force=force) -> list[int]:
                self._require_master()
                return self._client.batch_remove(batch, force)
            codes = self._run("delete", fn)
            if codes is None:
                return removed
            pending = []
            for k, c in zip(batch, codes):
                if c == 0:
                    removed += 1
                elif c == OBJECT_HAS_LEASE:
                    pending.append(k)
                elif c != OBJECT_NOT_FOUND:
                    self._count_code(c)
            if not pending or force:
                break
            if time.monotonic() >= deadline:
                if not self.config.force_remove:
                    break
                force = True
            else:
                time.sleep(0.02)
        if pending:
            self._bump("leased", len(pending))
            self._count(errors=len(pending))
        return removed

    def clear(self) -> None:
        """Remove every object of this namespace (and KV geometry), forcing past leases."""
        pattern = "^" + "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in self._prefix)

        def fn() -> int:
            self._require_master()
            return self._client.remove_by_regex(pattern, True)
        n = self._run("clear", fn)
        if n is not None and n < 0:
            self._count_code(n)

    # ----- helpers ------------------------------------------------------------------------
    def _chunks(self, pages: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per page, the pointers and sizes of its (layer, component) chunks."""
        pool = self.host_pool
        base = pool.raw.data_ptr()
        all_ptrs, all_sizes = [], []
        for p in pages:
            ranges = page_ranges(self.spec, pool.num_pages, pool.layout, p)
            all_ptrs.append([base + off for off, _ in ranges])
            all_sizes.append([n for _, n in ranges])
        return all_ptrs, all_sizes


# --------------------------------------------------------------------------------------------
# One Mooncake client per process and cluster config, shared by the stores that use it.
# A client is a transfer engine, a master connection and a mounted segment; stores of several
# models in one process share it, and a store re-created after close() gets it back at once.
_clients_lock = threading.Lock()
_create_lock = threading.Lock()


@dataclass
class _Shared:
    client: Any
    refs: int = 0


#: cluster config -> the process's client for it (refs == 0: idle, kept for reuse)
_clients: dict[tuple, _Shared] = {}
#: clients we will never close (a timed-out call may still be inside them)
_abandoned: list[Any] = []
_CLIENT_FIELDS = ("master_address", "local_hostname", "metadata_server", "protocol",
                  "rdma_devices", "global_segment_size", "local_buffer_size", "timeout_s",
                  "connect_retries", "tcp_bind_address")


def _client_key(config: MooncakeStore.Config) -> tuple:
    return tuple(getattr(config, f) for f in _CLIENT_FIELDS)


def _client_environment(c: MooncakeStore.Config) -> dict[str, str]:
    """Mooncake's process-wide settings, read when a client is created."""
    inner_ms = int(c.timeout_s * 1000 / 4)
    return {"MC_TCP_BIND_ADDRESS": c.tcp_bind_address or c.local_hostname,
            "MC_RPC_TIMEOUT_MS": str(inner_ms), "MC_RPC_CONNECT_TIMEOUT_MS": str(inner_ms),
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(max(1, inner_ms // 1000)),
            "MC_TCP_STATUS_TIMEOUT_SEC": str(max(1, inner_ms // 1000)),
            "MC_STORE_CLIENT_SETUP_RETRIES": str(c.connect_retries)}


def _acquire_client(c: MooncakeStore.Config) -> Any:
    key = _client_key(c)
    with _create_lock:                    # one creation at a time: MC_* are process-wide
        with _clients_lock:
            shared = _clients.get(key)
            if shared is not None:
                shared.refs += 1
                return shared.client
        from mooncake.store import MooncakeDistributedStore
        os.environ.update(_client_environment(c))
        client = MooncakeDistributedStore()
        rc = client.setup(c.local_hostname, c.metadata_server, c.global_segment_size,
                          c.local_buffer_size, c.protocol, c.rdma_devices, c.master_address)
        if rc != 0:
            raise StoreError(f"mooncake: could not start a client against master "
                             f"{c.master_address} ({_code_name(rc)}); is mooncake_master "
                             "running there?", backend=MooncakeStore.name)
        with _clients_lock:
            _clients[key] = _Shared(client, 1)
        return client


def _release_client(key: tuple, client: Any, reusable: bool) -> None:
    with _clients_lock:
        shared = _clients.get(key)
        if shared is None or shared.client is not client:
            return
        shared.refs -= 1
        if not reusable:      # a call may still be inside it: never hand it out or close it
            del _clients[key]
            _abandon(client)


_registrations: dict[tuple[int, int, int], int] = {}


def _register(client: Any, ptr: int, nbytes: int) -> int:
    """Register a buffer with a (shared) client once, however many stores attach it."""
    key = (id(client), ptr, nbytes)
    with _clients_lock:
        if _registrations.get(key):
            _registrations[key] += 1
            return 0
        rc = client.register_buffer(ptr, nbytes)
        if rc == 0:
            _registrations[key] = 1
        return rc


def _unregister(client: Any, ptr: int, nbytes: int) -> None:
    key = (id(client), ptr, nbytes)
    with _clients_lock:
        _registrations[key] -= 1
        if _registrations[key] == 0:
            del _registrations[key]
            client.unregister_buffer(ptr)


def close_idle_clients(master_address: str | None = None) -> int:
    """Close the idle clients (of one master, or all); returns how many.

    Each close takes Mooncake 1-2 s and holds the GIL; call this while their master is still
    up (a client whose master is gone spends its close retrying the connection)."""
    with _clients_lock:
        picked = [k for k, sh in _clients.items()
                  if sh.refs == 0 and (master_address is None or k[0] == master_address)]
        clients = [_clients.pop(k).client for k in picked]
    for client in clients:
        _close_or_abandon(client)
    return len(clients)


def _close_or_abandon(client: Any) -> None:
    """Close a client whose master answers; leave one whose master is gone to the OS (its
    close would spend many seconds reconnecting, and so would its destructor, hence the
    extra reference: the master drops it after its client TTL)."""
    try:
        if client.health_check() == 0:
            client.close()
            return
    except Exception as exc:
        log.warning("mooncake: closing a client failed: %s", exc)
    _abandon(client)


def _abandon(client: Any) -> None:
    """Keep a client alive to the end of the process: never closed, never destroyed."""
    import ctypes
    _abandoned.append(client)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


@atexit.register
def _close_clients() -> None:
    with _clients_lock:
        clients = [sh.client for sh in _clients.values()]
        _clients.clear()
    for client in clients:
        _close_or_abandon(client)


def _mooncake_version() -> str:
    from importlib import metadata
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "(version unknown)"
