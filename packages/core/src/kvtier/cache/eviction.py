"""Two-tier eviction over a `PageIndex`: least recently used leaves first, per tier.

L2: a clean leaf is freed at once; a dirty one (``write_back`` with a working L3, the page not
in L3 yet) is pinned and marked ``wb_pending`` until its L3 write is done, and a parent waits
for its children's write-backs. L1: leaves not pinned and not being copied; a page needs an L2
copy first (demotion) when the policy says so or when children of it stay in the index.

`select_l2`, `after_l3_write`, `select_l1` and `release_l1` change the index only (lock held
by the caller) and return what the caller must do with the data (host pages to free, pages to
write to L3, device pages to copy down); the controller and the planner both use them. The
functions after them are the controller's: they allocate, copy and give pages back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from . import transfers
from .index import HostPages, Node, PageIndex

if TYPE_CHECKING:
    from .controller import TieredKVCache

__all__ = ["L2Eviction", "select_l2", "after_l3_write", "select_l1", "release_l1",
           "alloc_evicting", "alloc_host", "evict_l1", "evict_l2", "allocate_device"]


@dataclass
class L2Eviction:
    freed: list[int] = field(default_factory=list)   # host pages out of the index now
    later: list[Node] = field(default_factory=list)  # pinned: write (where ``write``), then free
    write: list[bool] = field(default_factory=list)
    lost: int = 0                                    # dirty pages dropped: L3 failed


def _parent_key(nd: Node) -> bytes | None:
    return nd.parent.key if nd.parent is not None else None


def select_l2(index: PageIndex, n: int, *, l3_writeback: bool, l3_broken: bool
              ) -> L2Eviction:
    """Take up to ``n`` host pages out of the index: clean leaves now, dirty ones after their
    L3 write (``l3_writeback``). ``l3_broken``: write-back wanted but L3 is off (counted)."""
    out = L2Eviction()

    def dirty(nd: Node) -> bool:
        return l3_writeback and not nd.in_l3 and nd.device_page is None

    victims = index.l2_lru.select(
        n, evictable=lambda nd: nd.l2_pins == 0 and not nd.wb_pending,
        blockers=lambda nd: 0 if nd.device_page is not None else nd.children,
        parent=_parent_key, leaves=lambda nd: nd.device_page is None)
    waiting: dict[bytes, int] = {}    # parent key -> children queued in `later`
    for nd in victims:                # children come before their parents
        if nd.l2_pins or nd.wb_pending:
            continue
        children = 0 if nd.device_page is not None else nd.children
        if children > waiting.get(nd.key, 0):
            continue                  # re-check: the selection is optimistic
        if dirty(nd) or children:
            nd.wb_pending = True
            nd.l2_pins += 1
            out.later.append(nd)
            out.write.append(dirty(nd))
            if nd.parent is not None and nd.device_page is None:
                waiting[nd.parent.key] = waiting.get(nd.parent.key, 0) + 1
        else:
            if l3_broken and not nd.in_l3 and nd.device_page is None:
                out.lost += 1
            out.freed.append(index.l2_remove(nd))
    return out


def after_l3_write(index: PageIndex, nodes: list[Node], ok: list[bool | None], *,
                   evict_after: bool) -> list[int]:
    """Book an L3 write of pinned L2 pages: unpin, mark written ones ``in_l3`` and (with
    ``evict_after``) take the evicted ones out, children first. ``ok[i]`` None: not
    written. Returns the host pages to free."""
    freed: list[int] = []
    for nd, good in zip(nodes, ok):
        nd.l2_pins -= 1
        if good:
            nd.in_l3 = True
        if evict_after:
            nd.wb_pending = False
            if nd.host_page is not None and nd.l2_pins == 0 \
                    and (nd.device_page is not None or not nd.children):
                freed.append(index.l2_remove(nd))
    return freed


def select_l1(index: PageIndex, n: int, *, demote_on_evict: bool
              ) -> tuple[list[Node], list[Node]]:
    """Up to ``n`` L1 victims (children before parents) and those of them that need an L2
    copy before they leave: the policy demotes on eviction, or children stay in the index
    (children leaving in this same batch do not count)."""
    victims = index.l1_lru.select(
        n, evictable=lambda nd: nd.l1_pins == 0 and not nd.backup_pending,
        blockers=lambda nd: nd.l1_children, parent=_parent_key, leaves=lambda nd: True)
    demote: list[Node] = []
    leaving: dict[bytes, int] = {}
    for nd in victims:
        if nd.host_page is not None:
            continue                  # keeps its L2 copy: stays in the index
        if demote_on_evict or nd.children > leaving.get(nd.key, 0):
            demote.append(nd)
        elif nd.parent is not None:
            leaving[nd.parent.key] = leaving.get(nd.parent.key, 0) + 1
    return victims, demote


def release_l1(index: PageIndex, victims: list[Node], *, demote_on_evict: bool,
               keep: set[bytes] | frozenset = frozenset()
               ) -> tuple[list[int], list[int], int]:
    """Take the victims still evictable out of L1 (keys in ``keep`` stay). A victim without an
    L2 copy takes its L2-only descendants along, unless one is in use (never leave them
    without their prefix). Returns (device pages freed, host pages freed, dirty pages
    dropped without a copy)."""
    dev: list[int] = []
    host: list[int] = []
    dropped = 0
    for nd in victims:
        if nd.device_page is None or nd.l1_pins or nd.backup_pending or nd.l1_children \
                or nd.key in keep:
            continue
        if nd.host_page is None:
            if nd.children:
                sub = _l2_subtree(nd)
                if sub is None:
                    continue
                host += [index.l2_remove(d) for d in reversed(sub)]   # children first
            if demote_on_evict:
                dropped += 1
        dev.append(index.l1_remove(nd))
    return dev, host, dropped


def _l2_subtree(top: Node) -> list[Node] | None:
    """Descendants of the L1 leaf ``top`` (all L2-only), parents first; None if one is in
    use."""
    order: list[Node] = []
    stack = list(top.kids)
    while stack:
        nd = stack.pop()
        if nd.l2_pins or nd.wb_pending or nd.device_page is not None:
            return None
        order.append(nd)
        stack.extend(nd.kids)
    return order


def alloc_evicting(host: HostPages, n: int, evict: Callable[[int], object]) -> list[int]:
    """Up to ``n`` pages of ``host``, ``evict(k)`` first when ``k`` of them are not free (the
    controller's and the planner's L2 eviction)."""
    if n <= 0:
        return []
    free = host.free_count
    if free < n:
        evict(n - free)
        free = host.free_count
    return host.alloc(min(n, free))


# --------------------------------------------------------------------------------------------
# The controller's eviction (L1 pages given back to the engine, demotions copied to L2)
# --------------------------------------------------------------------------------------------
def alloc_host(c: "TieredKVCache", n: int) -> list[int]:
    """Up to ``n`` host pages, evicting unpinned L2 leaves as needed (lock held)."""
    return alloc_evicting(c.host_pool, n, lambda k: evict_l2(c, k))


def writes_back(c: "TieredKVCache") -> bool:
    """Does L2 eviction write dirty pages to L3 first (room then comes once they are
    written)? Decided by policy and health only, never by timing, so replays repeat."""
    return c.write_policy.l3_on_l2_evict and c._l3_usable()


def wait_writebacks(c: "TieredKVCache") -> None:
    """Wait (lock not held) for queued write-backs, within the store calls' deadline."""
    if c._l3 is not None:
        c._l3.wait_idle(c.config.l3_call_timeout_s + 1.0, writes_only=True)


def evict_l2(c: "TieredKVCache", n: int) -> int:
    """Free up to ``n`` host pages: clean leaves now; dirty ones (write_back) after their
    L3 write. Returns how many were freed now (lock held)."""
    wb = c.write_policy.l3_on_l2_evict
    usable = c._l3_usable()
    ev = select_l2(c._index, n, l3_writeback=wb and usable,
                   l3_broken=wb and c.store is not None and not usable)
    if ev.freed:
        c.host_pool.free(ev.freed)
        c.metrics_registry.add_many({"l2_evictions": len(ev.freed),
                                     "l3_writes_dropped": ev.lost})
    if ev.later:
        c._enqueue_write(ev.later, evict_after=True, write=ev.write)
    return len(ev.freed)


def evict_l1(c: "TieredKVCache", n: int) -> int:
    """Free up to ``n`` L1 pages (lock not held). Pages being copied to L2 are pinned until
    the copy lands, and a demotion whose L2 room is still being written to L3 waits for it
    (write_back): it never drops a page that a wait would have kept."""
    freed, short = evict_l1_once(c, n, keep_short=writes_back(c))
    for _ in range(64):                  # each pass frees pages or keeps fewer back
        if freed >= n:
            break
        if c._index.backups_inflight:
            c._completer.wait_idle(None)
            more, short = evict_l1_once(c, n - freed, keep_short=writes_back(c))
        elif short:
            wait_writebacks(c)
            more, again = evict_l1_once(c, n - freed, keep_short=writes_back(c))
            if not more and again >= short:
                # no room came back: L2 is full of pages in use; drop what finds none
                more, again = evict_l1_once(c, n - freed)
            short = again
        else:
            break
        freed += more
        if not more and not short:
            break
    return freed


def evict_l1_once(c: "TieredKVCache", n: int, *, keep_short: bool = False
                  ) -> tuple[int, int]:
    """One eviction pass: (pages freed, victims kept in L1 because they found no L2 room
    and ``keep_short``: room being written back to L3 comes later)."""
    pol = c.write_policy
    idx = c._index
    kept: set[bytes] = set()
    with c._lock:
        victims, demote = select_l1(idx, n, demote_on_evict=pol.demote_on_l1_evict)
        # the victims' own L2 copies must not make the room for the others' demotions
        copies = [nd for nd in victims if nd.host_page is not None]
        for nd in copies:
            nd.l2_pins += 1
        try:
            pages = alloc_host(c, len(demote)) if demote else []
        finally:
            for nd in copies:
                nd.l2_pins -= 1
        if len(pages) < len(demote) and keep_short:
            kept = {nd.key for nd in demote[len(pages):]}
        demote = demote[:len(pages)]
        handle = transfers.submit_backup(c, demote, pages, l3=pol.l3_on_backup) \
            if demote else None
    if handle is not None:
        handle.synchronize()                # landed and booked
        ok = handle.result is not None and all(handle.result.backups)
        c.metrics_registry.add("l1_demotions", len(demote) if ok else 0)
    with c._lock:
        dev, host, dropped = release_l1(idx, victims, demote_on_evict=pol.demote_on_l1_evict,
                                        keep=kept)
        if host:
            c.host_pool.free(host)
            c.metrics_registry.add("l2_evictions", len(host))
    if dev:
        c.metrics_registry.add_many({"l1_evictions": len(dev), "l1_dirty_dropped": dropped})
        c._free_cb(dev)
    return len(dev), len(kept)


def allocate_device(c: "TieredKVCache", n: int) -> list[int]:
    """``n`` device pages from the engine's allocator, evicting L1 when it has none; fewer
    (halving) if even that does not free enough."""
    if n == 0:
        return []
    if c._alloc_cb is None:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError("fetch without device_pages needs the "
                                   "allocate_device_pages callback", argument="device_pages")
    want = n
    while want > 0:
        pages = c._alloc_cb(want)
        if pages is None:
            evict_l1(c, want)
            pages = c._alloc_cb(want)
        if pages is not None:
            return c._check_engine_pages(pages, "allocate_device_pages()")
        want //= 2
    return []
