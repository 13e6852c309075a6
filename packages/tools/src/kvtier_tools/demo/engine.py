"""A minimal inference "engine" around `TieredKVCache`: it owns the device KV pool (L1) and
its free list, and serves one request at a time -- match (which starts the L3 -> L2 read),
fetch (the cost-aware controller decides how many hit pages to load), prefill the rest with
layer ``i`` waiting only for layer ``i`` of the restored prefix, commit, release -- timing
each request from its arrival to its first token's logits. Every page restored from L2/L3 is
checked against the digest recorded when it was committed (`kvtier_tools.demo.digest`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from kvtier.cache import TieredKVCache
from kvtier.errors import KVTierError, PoolExhaustedError, TransferError
from .digest import PageDigests
from .model import CheckResult, DemoModel
from .workload import Request


@dataclass(frozen=True)
class RequestResult:
    """What serving one request did and how long it took (seconds)."""

    index: int
    round: int
    tokens: int
    l1_tokens: int           # reused from device pages already in L1
    l2_tokens: int           # loaded from the host pool
    l3_tokens: int           # read from the L3 store (through L2)
    computed_tokens: int     # prefilled by the model
    ttft_s: float            # arrival -> logits of the first output token
    match_s: float
    load_s: float            # fetch + waiting for the loaded layers
    prefill_s: float
    commit_s: float          # after the first token: commit + release (not in TTFT)
    check: CheckResult | None = None
    l2_hit_tokens: int = 0   # hit in L2 at the match (loaded or, by the cost model, not)
    l3_hit_tokens: int = 0   # hit in L3 at the match
    skipped_tokens: int = 0  # hit in L2/L3 but recomputed: loading them was slower
    restored_checked: int = 0    # restored pages whose digest matched
    restored_bad: int = 0        # restored pages matching no digest of their key
    #: under load: L3 pages read into L2 by the prefetch started at the request's arrival
    #: and loaded from there (counted in ``l3_tokens``, not ``l2_tokens``)
    l3_prefetched_tokens: int = 0
    #: under load: waited at dispatch for the arrival's L3 read (0: it had landed)
    l3_wait_s: float = 0.0
    #: the fetch failed after the prefill started on it (a streamed L3 read missed): the
    #: prefill ran again on the L1 hit alone, and its tokens count as computed
    load_failed: bool = False
    #: under load: served on the match and load `DemoEngine.preload` started while the
    #: request ahead prefilled (no match or load in front of its own prefill)
    preloaded: bool = False

    @property
    def hit_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


@dataclass
class Preloaded:
    """A queued request whose hits `DemoEngine.preload` is loading into L1 (or has loaded):
    its match and fetch, and what the arrival's L3 read or staging put within reach."""

    match: Any
    handle: Any
    skipped: int             # hit pages the cost-aware split left to recompute
    prefetched: set[bytes]   # keys the arrival's L3 read landed in L2
    staged: bool             # an in-place L3 run the store staged while the request waited


class DemoEngine:
    """Serves requests through a `TieredKVCache` over a device pool of ``l1_pages`` pages.

    The engine owns the pool's free list: ``allocate`` hands out free pages and, when there
    are not enough, asks the cache to evict unpinned L1 pages, which come back through the
    ``free_device_pages`` callback.
    """

    def __init__(self, model: DemoModel, cache_config: Mapping[str, Any], *, l1_pages: int,
                 lower_tiers: bool = True, prefill_mode: str = "fast",
                 digests: dict[bytes, set[int]] | None = None):
        self.model = model
        self.prefill_mode = prefill_mode
        #: False: reuse L1 hits only, never load from L2/L3 (the L1-only baseline)
        self.lower_tiers = lower_tiers
        self.pool = model.new_pool(l1_pages)
        self._free: list[int] = list(range(l1_pages - 1, -1, -1))
        self._free_lock = threading.Lock()
        self.cache = TieredKVCache.from_config(
            dict(cache_config), device_pool=self.pool,
            allocate_device_pages=self._take, free_device_pages=self._give)
        #: testing aid: flip one value of the first page restored from L2/L3 after it lands,
        #: to show that the check catches a wrong restore.
        self.corrupt_restore = False
        self.corrupted = 0
        #: how long `allocate` waits for pinned L1 pages to become evictable
        self.alloc_timeout_s = 10.0
        #: under load: called when L1 is short of evictable pages; it releases what queued
        #: requests pinned at arrival (their prefetch stops) and says whether it freed any
        self.make_room: Callable[[], bool] | None = None
        self.digests = PageDigests(self.pool, known=digests)
        #: why a queued request was not preloaded (or its fetch refused: it is matched at
        #: dispatch), and how often
        self.preload_skips: collections.Counter[str] = collections.Counter()

    # ----- the device page allocator ------------------------------------------------------
    def _take(self, n: int) -> list[int] | None:
        with self._free_lock:     # (under load a preload runs on the arrivals' thread)
            if n > len(self._free):
                return None
            pages = self._free[len(self._free) - n:]
            del self._free[len(self._free) - n:]
            return pages

    def _give(self, pages: list[int]) -> None:
        with self._free_lock:
            self._free.extend(pages)

    def allocate(self, n: int) -> list[int]:
        """``n`` free device pages, evicting L1 pages if needed."""
        if n <= 0:
            return []
        pages = self._take(n)
        deadline = time.perf_counter() + self.alloc_timeout_s
        delay = 1e-4
        while pages is None:
            # L1 pages being backed up stay pinned until their copy lands: wait for them
            # rather than fail (the wait is part of the request's TTFT).
            self.cache.evict(n - len(self._free))
            pages = self._take(n)
            if pages is not None or time.perf_counter() > deadline:
                break
            if self.make_room is not None and self.make_room():
                continue
            time.sleep(delay)
            delay = min(2 * delay, 5e-3)
        if pages is None:
            raise PoolExhaustedError(
                f"the device pool ({self.pool.num_pages} pages) cannot hold a request needing "
                f"{n} more pages: {len(self._free)} free, the rest pinned; raise --l1-pages",
                requested=n, free=len(self._free))
        return pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    # ----- serving --------------------------------------------------------------------------
    def arrive(self, request: Request, *, expected_wait_s: float = 0.0) -> Any:
        """A request joins the queue: match it and start its L3 -> L2 read now, so that the
        read runs while the request waits (``expected_wait_s``: how long it is expected to
        wait; what lands within it is read even where an idle engine would recompute it).
        Returns the match to hand to `serve` (its pages stay pinned until then), or None when
        there is nothing to read (the match is released: `serve` matches again at
        dispatch)."""
        if not self.lower_tiers:
            return None
        tokens_np = np.asarray(request.tokens)
        m = self.cache.match(tokens_np[:int(tokens_np.shape[0]) - 1])
        if m.l3_count:
            self.cache.prefetch(m, expected_wait_s=expected_wait_s)
        if m.read is None and m.stage is None:
            self.cache.release(m)
            return None
        return m

    def preload(self, queued: Any, request: Request | None = None, *,
                after: list[bytes] | None = None) -> Any:
        """Load a queued request's hits into L1 while the engine serves the request ahead of
        it: the L2 hit, and the L3 run once the read `arrive` started has landed in L2 (or
        the store has staged it where loads read in place). ``queued``: what `arrive`
        returned (None: the request is matched now, from ``request``). Returns a `Preloaded`
        to hand to `serve` in its place -- the request is then served on this match, with
        no second match and no load in front of its prefill -- or ``queued`` unchanged where
        a load now would have to wait (a read in flight, or L1 without free or evictable
        pages for it). Where the copies are asynchronous (an accelerator), call it once the
        request ahead's prefill is launched: its loads go first and these run under it.
        ``after``: the keys of the request ahead; where its commit will extend this one's hit
        (they share the page after the hit), nothing is preloaded: dispatch matches afresh."""
        if not self.lower_tiers or isinstance(queued, Preloaded):
            return queued
        m = queued
        if m is None:
            if request is None:
                return None
            tokens_np = np.asarray(request.tokens)
            m = self.cache.match(tokens_np[:int(tokens_np.shape[0]) - 1])
        hit = m.total_pages
        why = ""
        n3 = 0
        prefetched: set[bytes] = set()
        task = m.read
        staged = m.stage is not None and m.stage.done()
        if after is not None and hit < min(len(m.keys), len(after)) and m.keys[hit] == after[hit]:
            why = "the request ahead extends its hit"   # (keys are chained: one equal key,
            #                                             equal prefixes)
        elif queued is None and m.l3_count and task is None and m.stage is None:
            # an L3 run written since the arrival's match: its read starts now, and dispatch
            # waits for what has not landed (as for a read started at arrival)
            self.cache.prefetch(m)
            if m.read is not None or m.stage is not None:
                self.preload_skips["its L3 read started at the preload"] += 1
                return m
        elif m.l3_count and task is not None:
            with task.cv:
                if task.complete:
                    n3 = task.n_landed
                    prefetched = set(task.keys[:task.n_landed])
                else:
                    why = "its L3 read in flight"
        elif m.l3_count and m.stage is not None:
            n3 = m.l3_count
            if not staged:
                why = "its L3 staging in flight"
        # (an L3 hit with neither: the queue-aware split chose to recompute it)
        want = m.l2_count + n3
        pages = None
        if not why:
            pages = self._take(want)
            if pages is None:
                self.cache.evict(want - len(self._free))
                pages = self._take(want)
                if pages is None:
                    why = "no free or evictable L1 page"
        if pages is None:
            self.preload_skips[why] += 1
            if queued is None:
                self.cache.release(m)
            return queued
        try:
            fh, skipped = self._fetch(m, pages)
        except BaseException as e:
            # the request is matched afresh at dispatch; the pages were never loaded
            self.cache.release(m)
            self._give(pages)
            if isinstance(e, KVTierError):
                self.preload_skips["the cache refused its fetch"] += 1
                return None
            raise
        return Preloaded(m, fh, skipped, prefetched, staged)

    def _fetch(self, m: Any, pages: list[int]) -> tuple[Any, int]:
        """`TieredKVCache.fetch` of ``m`` into ``pages``, and how many hit pages the
        cost-aware split left to recompute."""
        reg = self.cache.metrics_registry
        before = reg.get("cost_skipped_pages_l2") + reg.get("cost_skipped_pages_l3")
        fh = self.cache.fetch(m, pages)
        return fh, reg.get("cost_skipped_pages_l2") + reg.get("cost_skipped_pages_l3") - before

    def drop(self, queued: Any) -> None:
        """A queued request leaves (or L1 needs its pins back): release what `arrive` or
        `preload` holds for it (a load in flight is waited for; its pages come back)."""
        if isinstance(queued, Preloaded):
            self._give(self.cache.release(queued.match))
        elif queued is not None:
            self._give(self.cache.release(queued))

    def serve(self, request: Request,
              check: Callable[[int, int], bool] | bool = False, *,
              queued: Any = None,
              ahead: Callable[[list[bytes]], None] | None = None) -> RequestResult:
        """Prefill one request on whatever prefix the tiers hold. ``check`` (or
        ``check(l1_pages_hit, pages_loaded)``, asked once the hits are known) compares the
        result with a full recompute; the comparison is not part of the timings.
        ``queued``: the match `arrive` returned. Its L3 read is waited for (the part that has
        not landed is the request's L3 wait), then the request is matched afresh -- pages
        committed while it waited count -- and the pages the read put in L2 load from there.
        A `Preloaded` (from `preload`) is served on its match and load as they are.
        ``ahead``: called with the request's keys once its prefill is launched (before
        waiting for it) -- where to `preload` the next request."""
        model, cache, ps = self.model, self.cache, self.model.spec.page_size
        tokens_np = np.asarray(request.tokens)
        n = int(tokens_np.shape[0])
        n_full = n // ps
        tokens = model.as_tokens(tokens_np)
        _sync(model.device)
        t0 = time.perf_counter()
        l3_wait = 0.0
        if isinstance(queued, Preloaded):
            m, fh, skipped = queued.match, queued.handle, queued.skipped
            prefetched, staged = queued.prefetched, queued.staged
            t1 = time.perf_counter()
        else:
            prefetched = set()
            task = queued.read if queued is not None else None
            # an in-place L3 staged while the request waited: its pages count as prefetched
            staged = queued is not None and queued.stage is not None and queued.stage.done()
            if task is not None:
                with task.cv:
                    if not task.complete:
                        task.cv.wait_for(lambda: task.complete, timeout=600)
                        l3_wait = time.perf_counter() - t0
                    prefetched = set(task.keys[:task.n_landed])
            # At most n - 1 tokens may come from the cache: the last one must be computed to
            # produce the logits of the first output token.
            m = cache.match(tokens_np[:n - 1])
            if queued is not None:
                # the staging of an in-place L3 goes on for the new match (its fetch waits)
                m.stage, queued.stage = queued.stage, None
                cache.release(queued)      # the new match holds what landed
            if self.lower_tiers and m.l3_count and not cache.reads_in_fetch:
                cache.prefetch(m)                 # L3 -> L2 starts as early as the match
                # (where the fetch reads its L3 pages in the plan that loads them -- each
                # batch loaded as it lands, or streamed layer by layer -- it starts them)
            t1 = time.perf_counter()
            want = m.l2_count + m.l3_count if self.lower_tiers else 0
            fh, skipped = self._fetch(m, self.allocate(want))
        loaded = fh.pages_loaded
        prefix = list(m.l1_pages) + list(fh.device_pages[:loaded])
        # Pages given to fetch but not loaded (the cost model skipped them, or an L3 miss cut
        # the hit short) stay ours: they take new KV, and `release` hands back whatever the
        # cache did not take.
        spare = list(fh.unused_pages)
        n_new = n_full - len(prefix)
        new_pages = spare[:n_new]
        if len(new_pages) < n_new:
            new_pages += self.allocate(n_new - len(new_pages))
        waited = False
        wait_s = 0.0

        def wait_layer(i: int) -> None:
            nonlocal waited, wait_s
            tw = time.perf_counter()
            fh.wait_layer(i)
            if i == 0 and self.corrupt_restore:
                self._corrupt(fh.device_pages[0])     # landed, not yet read by the model
            if i == model.size.layers - 1:
                fh.wait()
                waited = True
            wait_s += time.perf_counter() - tw

        t2 = time.perf_counter()
        failed = False
        try:
            logits = model.prefill(tokens, self.pool, prefix, new_pages,
                                   wait_layer=wait_layer if loaded else None,
                                   mode=self.prefill_mode)
            if ahead is not None:
                ahead(m.keys)
            _sync(model.device)
            if not waited:
                fh.wait()
        except TransferError:
            # the load failed after the prefill started on it (a streamed L3 read missed):
            # none of its pages are the cache's; compute them as well, on the L1 hit alone
            failed = True
            new_pages = list(fh.device_pages[:loaded]) + new_pages
            prefix, loaded = list(m.l1_pages), 0
            logits = model.prefill(tokens, self.pool, prefix, new_pages, wait_layer=None,
                                   mode=self.prefill_mode)
            _sync(model.device)
        t3 = time.perf_counter()
        computed = n - len(prefix) * ps
        if not failed and (not loaded or model.device.type == "cpu"):
            # on an accelerator the prefill's layers wait for their loads on the stream, not
            # here: such a prefill times the loads as compute (as vLLM's connector, only the
            # forwards that wait for no load are timed); on the CPU the waits are subtracted
            cache.observe_recompute(computed, max(t3 - t2 - wait_s, 1e-9), context=n)
        restored = list(fh.device_pages[:loaded])
        bad = self.digests.mismatches(m.keys[m.l1_count:m.l1_count + loaded], restored)
        result_check = None
        if check if isinstance(check, bool) else check(m.l1_count, loaded):
            if self.prefill_mode == "paged":
                result_check = model.check_restored(tokens, logits, self.pool,
                                                    prefix + new_pages)
            else:
                result_check = model.check_logits(tokens, logits, len(prefix) * ps)
        t4 = time.perf_counter()
        pages = prefix + new_pages
        res = cache.commit(tokens_np, pages, match=m)
        self._give(cache.release(m))
        t5 = time.perf_counter()
        if self.lower_tiers and res.taken:
            where = {d: j for j, d in enumerate(pages)}
            taken = [d for d in res.taken if d in where]
            self.digests.record([m.keys[where[d]] if where[d] < len(m.keys)
                                 else self._key(tokens_np, where[d]) for d in taken], taken)
        l2 = min(loaded, m.l2_count)
        pre = sum(1 for k in m.keys[m.l1_count:m.l1_count + l2] if k in prefetched)
        # (a preloaded match is the arrival's: the pages its read landed are its L3 run)
        pre_l3 = loaded - l2 if staged or (prefetched and isinstance(queued, Preloaded)) else 0
        return RequestResult(
            index=request.index, round=request.round, tokens=n,
            l1_tokens=m.l1_count * ps, l2_tokens=(l2 - pre) * ps,
            l3_tokens=(loaded - l2 + pre) * ps,
            computed_tokens=computed, ttft_s=t3 - t0, match_s=t1 - t0 - l3_wait,
            load_s=t2 - t1 + wait_s + l3_wait, prefill_s=t3 - t2 - wait_s, commit_s=t5 - t4,
            check=result_check,
            l2_hit_tokens=m.l2_count * ps if self.lower_tiers else 0,
            l3_hit_tokens=m.l3_count * ps if self.lower_tiers else 0,
            skipped_tokens=skipped * ps,
            restored_checked=loaded - len(bad), restored_bad=len(bad),
            l3_prefetched_tokens=(pre + pre_l3) * ps, l3_wait_s=l3_wait, load_failed=failed,
            preloaded=isinstance(queued, Preloaded))

    def _key(self, tokens_np: np.ndarray, j: int) -> bytes:
        """The key of full page ``j`` of ``tokens`` (the match covers n - 1 tokens, so the
        last full page may lie beyond its keys)."""
        return self.cache.keys(tokens_np[:(j + 1) * self.model.spec.page_size])[j]

    def _corrupt(self, page: int) -> None:
        # one flipped bit of layer 0's first value (a K value; MLA: a latent value)
        self.pool.chunks[0][0][page, 0] ^= 0x01
        self.corrupted += 1

    def warm_up(self, vocab_size: int) -> None:
        """One prefill on scratch pages (first-call costs: kernels, allocator), untimed."""
        ps = self.model.spec.page_size
        pages = self.allocate(2)
        try:
            toks = self.model.as_tokens(torch.arange(2 * ps + 1) % vocab_size)
            self.model.prefill(toks, self.pool, [], pages, mode=self.prefill_mode)
        finally:
            self._give(pages)

    def close(self) -> None:
        self.cache.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
