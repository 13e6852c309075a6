"""The controller's health and shutdown.

Health: a tier that fails (L3, reported by `L3IO`; the transfer completion thread) is recorded
and raised once, as `TierFailureError`, from the next public call (`check`). Shutdown: `close`
finishes or cancels queued L3 work (``close_policy``), stops the threads and closes what the
cache created, all within ``close_timeout_s``; a host pool that a store call stuck past its
deadline may still write into is left open rather than freed. A cache its owner never closed
is closed at interpreter exit (`close_on_exit`), while every thread still runs.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError, TierFailureError
from .l3tasks import WriteTask

if TYPE_CHECKING:
    from .controller import TieredKVCache

log = logging.getLogger("kvtier.cache")

__all__ = ["check", "tier_failed", "completer_died", "close", "close_on_exit",
           "EXIT_CLOSE_TIMEOUT_S"]

#: At interpreter exit an unclosed cache is closed within this many seconds at most.
EXIT_CLOSE_TIMEOUT_S = 10.0
_live: "weakref.WeakSet[TieredKVCache]" = weakref.WeakSet()


# ----- health ---------------------------------------------------------------------------------
def check(c: "TieredKVCache", report: bool = True) -> None:
    """Refuse calls on a closed cache; raise a tier failure not reported yet."""
    if c._closed or c._closing:
        raise InvalidArgumentError("the cache is closed", argument="cache")
    if c._l3 is not None:
        c._l3.check_workers()
    if report and not c._failure_reported:
        with c._lock:
            failure, c._failure_reported = c._failure, True
        if failure is not None:
            raise failure


def tier_failed(c: "TieredKVCache", tier: str, message: str, cause: BaseException | None
                ) -> None:
    exc = TierFailureError(f"{tier} tier failed: {message}", tier=tier, cause=cause)
    exc.__cause__ = cause
    with c._lock:
        c._failure = exc
        c._failure_reported = False


def completer_died(c: "TieredKVCache", exc: BaseException) -> None:
    message = f"completion thread died: {type(exc).__name__}: {exc}"
    c.metrics_registry.add("transfer_failures")
    log.error("kvtier cache: transfer tier failed: %s", message, exc_info=exc)
    tier_failed(c, "transfer", message, exc)


# ----- shutdown -------------------------------------------------------------------------------
def close(c: "TieredKVCache", timeout: float) -> None:
    """Close ``c`` within ``timeout`` seconds (idempotent)."""
    with c._lock:
        if c._closed or c._closing:
            return
        c._closing = True
    _live.discard(c)
    cfg = c.config
    deadline = time.perf_counter() + timeout
    left = lambda: max(0.0, deadline - time.perf_counter())  # noqa: E731
    c._completer.wait_idle(left())
    io = c._l3
    if io is not None:
        for task in io.queue.drain() if cfg.close_policy == "cancel" else []:
            task.abort(cancelled=True)
        if cfg.close_policy == "flush" and c._l3_usable() and c.write_policy.l3_on_l2_evict:
            with c._lock:
                dirty = [n for n in c._index.nodes.values() if n.host_page is not None
                         and not n.in_l3 and not n.wb_pending]
                for n in dirty:
                    n.l2_pins += 1
            if dirty:
                io.submit(WriteTask(c, dirty, evict_after=False))
        for task in io.queue.drain(reads_only=True):   # they only fill L2, going away
            task.abort(cancelled=True)
        if not io.wait_idle(left()):
            log.error("kvtier cache: close timed out with L3 work in flight")
        io.stop(left())
    c._completer.stop(left())
    with c._lock:
        c._closed = True
    stuck = io is not None and io.stuck_calls() > 0
    for obj in reversed(c._owned):
        if stuck and obj is c.host_pool:
            # a store call past its deadline may still write into these pages
            log.error("kvtier cache: an L3 call is stuck; the host pool is left open")
            continue
        closer = threading.Thread(target=_close_one, args=(obj,), daemon=True,
                                  name="kvtier-cache-close")
        closer.start()
        closer.join(left())
        if closer.is_alive():
            log.error("kvtier cache: closing %s did not return within close_timeout_s",
                      type(obj).__name__)


def _close_one(obj: Any) -> None:
    try:
        obj.close()
    except Exception as exc:
        log.warning("kvtier cache: closing %s failed: %s", type(obj).__name__, exc)


def _close_at_exit(ref: "weakref.ref[TieredKVCache] | None" = None) -> None:
    for cache in [ref()] if ref is not None else list(_live):
        if cache is not None:
            close(cache, min(cache.config.close_timeout_s, EXIT_CLOSE_TIMEOUT_S))


def close_on_exit(cache: "TieredKVCache") -> None:
    """Close ``cache`` at exit if its owner did not, while every thread still runs: before
    the interpreter shuts down thread pools (which the stores use) and leaves threads that
    are still copying to be torn down (which aborted the process)."""
    _live.add(cache)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_close_at_exit, weakref.ref(cache))
            return
        except RuntimeError:                 # already shutting down
            pass


atexit.register(_close_at_exit)              # the fallback (and a no-op for closed caches)


def register_gauges(cache: Any) -> None:
    """The controller's gauges (read at every metrics snapshot or scrape)."""
    m = cache.metrics_registry
    io = cache._l3
    m.gauge("l1_pages", lambda: cache._index.l1_count)
    m.gauge("l2_pages", lambda: cache._index.l2_count)
    m.gauge("l2_free_pages", lambda: cache.host_pool.free_count)
    m.gauge("l2_capacity_pages", lambda: cache.host_pool.num_pages)
    m.gauge("l3_read_queue_pages", lambda: io.depths()[0] if io else 0)
    m.gauge("l3_write_queue_pages", lambda: io.depths()[1] if io else 0)
    m.gauge("transfer_queue", lambda: cache._completer.depth())
    m.gauge("backups_in_flight", lambda: cache._index.backups_inflight)
    m.gauge("l3_unreadable_keys", lambda: len(cache.unreadable))
    m.gauge("l3_state", lambda: io.state if io else "none")
    m.gauge("page_bytes", lambda: cache.spec.page_bytes)
    m.gauge("page_size", lambda: cache.spec.page_size)
    m.gauge("transfer_engine", lambda: cache.engine.name)   # what "auto" chose, say
    cost = cache.cost
    m.gauge("cost_aware_fetch", lambda: int(cost.enabled))
    m.gauge("recompute_tokens_per_s", lambda: cost.recompute_tokens_per_s or 0.0)
    m.gauge("recompute_fixed_s", lambda: cost.recompute_fixed_s or 0.0)
    m.gauge("recompute_attn_s_per_pair", lambda: cost.recompute_attn_s)
    m.gauge("l2_load_bytes_per_s", lambda: cost.h2d_bytes_per_s or 0.0)
    m.gauge("l3_read_bytes_per_s", lambda: cost.l3_bytes_per_s or 0.0)
