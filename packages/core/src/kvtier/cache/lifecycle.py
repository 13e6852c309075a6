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
import contextlib
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError, TierFailureError
from .l3tasks import enqueue_write

if TYPE_CHECKING:
    from .controller import TieredKVCache

log = logging.getLogger("kvtier.cache")

__all__ = ["check", "tier_failed", "close", "close_on_exit", "set_switch_interval",
           "EXIT_CLOSE_TIMEOUT_S"]

#: At interpreter exit an unclosed cache is closed within this many seconds at most.
EXIT_CLOSE_TIMEOUT_S = 10.0
_live: "weakref.WeakSet[TieredKVCache]" = weakref.WeakSet()


def set_switch_interval(seconds: float | None) -> None:
    """Set the interpreter's thread switch interval (``switch_interval_s``) for the whole
    process; None leaves it. Logged where it changes."""
    if seconds is None:
        return
    before = sys.getswitchinterval()
    if abs(before - seconds) > 1e-7:
        sys.setswitchinterval(seconds)
        log.info("interpreter switch interval %g s (was %g s): switch_interval_s", seconds,
                 before)


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


# ----- shutdown -------------------------------------------------------------------------------
def close(c: "TieredKVCache", timeout: float) -> None:
    """Close ``c`` within ``timeout`` seconds (idempotent)."""
    with c._lock:
        if c._closed or c._closing:
            return
        c._closing = True
    _live.discard(c)
    cfg = c.config

    def flush() -> None:
        """Write-back: the dirty L2 pages go to L3 before the pool goes away."""
        if cfg.close_policy != "flush" or not c.write_policy.l3_on_l2_evict:
            return
        with c._lock:
            dirty = [n for n in c._index.nodes.values() if n.host_page is not None
                     and not n.in_l3 and not n.wb_pending]
            for n in dirty:
                n.l2_pins += 1
            if dirty:
                enqueue_write(c, dirty, evict_after=False)
    c._ex.close(timeout, cancel_writes=cfg.close_policy == "cancel", flush=flush)
    with c._lock:
        c._closed = True


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
        with contextlib.suppress(RuntimeError):      # already shutting down
            register(_close_at_exit, weakref.ref(cache))


atexit.register(_close_at_exit)              # the fallback (and a no-op for closed caches)


def register_gauges(cache: Any) -> None:
    """The controller's gauges (read at every metrics snapshot or scrape; ``l3_state`` and
    ``plans_running`` are its executor's)."""
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
    m.gauge("page_bytes", lambda: cache.spec.page_bytes)
    m.gauge("page_size", lambda: cache.spec.page_size)
    m.gauge("transfer_engine", lambda: cache.engine.name)   # what "auto" chose, say
    cost = cache.cost
    m.gauge("cost_aware_fetch", lambda: int(cost.enabled))
    m.gauge("recompute_tokens_per_s", lambda: cost.recompute_tokens_per_s or 0.0)
    m.gauge("recompute_fixed_s", lambda: cost.recompute_fixed_s or 0.0)
    m.gauge("recompute_attn_s_per_pair", lambda: cost.recompute_attn_s)
    m.gauge("recompute_knee_tokens", lambda: cost.recompute_knee_tokens)
    m.gauge("l2_load_bytes_per_s", lambda: cost.h2d_bytes_per_s or 0.0)
    m.gauge("l3_read_bytes_per_s", lambda: cost.l3_bytes_per_s or 0.0)
