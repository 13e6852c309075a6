"""L3 pages loaded in place: straight from a store's shared-memory arena into device pages.

A store whose objects sit in host memory (`L3Store.in_place_reads`, the `shm` store) lets the
controller skip the L3 -> L2 copy: the arena's slots are seen as a page-first host pool, a
second transfer engine of the cache's own kind is bound to it (the memory registered with the
device where the device needs that: CUDA's page-locked registration), and a fetch loads the
match's L3 run from the slots it pins, beside its L2 hit, layer by layer. A pinned slot holds
a shared lock that keeps every writer (of any process) off it until the load has landed; a
slot that is absent or being written ends the run there (the rest is recomputed).

Where any part is missing (another store, a slot that is not exactly one page, a device whose
memory cannot be registered, an engine that refuses the region) the cache reads through L2
as before and says why once (``in_place_why_not``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..interfaces import L3Store
from ..layout import PAGE_FIRST

if TYPE_CHECKING:
    from .config import CacheConfig
    from ..device_pool import DeviceKVPool
    from ..interfaces import InPlaceReads, TransferEngine
    from ..host_pool import HostKVPool

log = logging.getLogger("kvtier.cache")

__all__ = ["InPlace", "open_in_place", "store_loads_in_place", "says_why_not",
           "register_host_memory", "wait_staged"]


class _Registration:
    def __init__(self, release: Callable[[], None] | None):
        self._release = release

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def register_host_memory(ptr: int, nbytes: int, device: Any) -> tuple[Any, str]:
    """Make ``nbytes`` of host memory at ``ptr`` readable by ``device``'s copies: (an object
    whose ``close()`` undoes it, "") or (None, why not). CPU devices need nothing; CUDA (and
    ROCm's HIP through torch.cuda) takes a page-locked registration."""
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return _Registration(None), ""
    if kind != "cuda":
        return None, f"registering host memory with a {kind} device is not supported here"
    try:
        import torch
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(ptr, nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            return None, f"cudaHostRegister of {nbytes} B failed (error {code})"
    except Exception as exc:            # no CUDA runtime binding in this torch
        return None, f"cudaHostRegister unavailable: {exc}"

    def release() -> None:
        try:
            rt.cudaHostUnregister(ptr)
        except Exception as exc:        # pragma: no cover (a runtime torn down at exit)
            log.debug("kvtier cache: cudaHostUnregister failed: %s", exc)
    return _Registration(release), ""


@dataclass(frozen=True, eq=False)
class InPlace:
    """The in-place path of one cache: the store's region (``reads.pin``/``unpin`` its
    slots), the pool over it and its engine."""

    reads: "InPlaceReads"
    pool: "HostKVPool"
    engine: "TransferEngine"


def open_in_place(cfg: "CacheConfig", store: "L3Store | None", device_pool: "DeviceKVPool",
                  engine_name: str, owned: list[Any]) -> tuple[InPlace | None, str]:
    """Build the in-place path of a data path whose loads run on ``engine_name``, appending
    what it creates to ``owned`` (closed before the store); (None, why not) where it cannot
    be had. The controller and the executor both build theirs here."""
    from ..host_pool import HostKVPool
    from ..registry import create_transfer_engine
    if not cfg.l3_in_place_loads:
        return None, "off (l3_in_place_loads)"
    if store is None:
        return None, "no L3 store"
    reads = store.in_place_reads()
    if reads is None:
        why = getattr(getattr(store, "inner", store), "in_place_why_not", "")
        return None, why or f"the {store.name} store reads through a host page"
    buf = reads.buffer
    reg, why = register_host_memory(buf.ptr, buf.nbytes, device_pool.device)
    if reg is None:
        return None, why
    owned.append(reg)
    buf.device_addressable = True
    try:
        pool = HostKVPool(device_pool.spec, reads.num_slots, layout=PAGE_FIRST, buffer=buf)
        owned.append(pool)
        engine = create_transfer_engine(engine_name, device_pool, pool, cfg.transfer_config)
        owned.append(engine)
    except Exception as exc:
        return None, f"the {engine_name} engine over the arena: {exc}"
    return InPlace(reads, pool, engine), ""


def store_loads_in_place(cfg: "CacheConfig", store: "L3Store | None") -> bool:
    """Can a data path on ``store`` load in place, as far as the store and the config say?
    (What a planner may assume before its data path reports; the device may still refuse.)"""
    if not cfg.l3_in_place_loads or store is None:
        return False
    try:
        return store.in_place_reads() is not None
    except Exception as exc:           # a broken store: its reads say so
        log.debug("kvtier: in_place_reads failed: %s", exc)
        return False


def wait_staged(ticket: Any, metrics: Any, budget_s: float = float("inf")) -> bool:
    """Wait for a staging ticket (`L3Store.stage`) until ``budget_s`` or the store's own
    ``timeout_s``, whichever comes first, counted from the staging's start (``t0``); True if
    every part is back, else False and counted (``l3_stage_late_fetches``)."""
    if ticket.done():
        return True
    left = min(budget_s, ticket.timeout_s) - (time.perf_counter() - ticket.t0)
    if ticket.wait(max(0.0, left)):
        return True
    metrics.add("l3_stage_late_fetches")
    return False


def says_why_not(why: str, store: "L3Store | None") -> None:
    """Log once, at start, why a store that can load in place does not here."""
    inner = getattr(store, "inner", store)
    if why and inner is not None and type(inner).in_place_reads is not L3Store.in_place_reads:
        log.info("kvtier: L3 pages load through L2: %s", why)
