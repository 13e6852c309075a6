"""Two-tier eviction over a `PageIndex`: least recently used leaves first, per tier.

L2: a clean leaf is freed at once; a dirty one (``write_back`` with a working L3, the page not
in L3 yet) is pinned and marked ``wb_pending`` until its L3 write is done, and a parent waits
for its children's write-backs. L1: leaves not pinned and not being copied; a page needs an L2
copy first (demotion) when the policy says so or when children of it stay in the index.

These functions change the index only (lock held by the caller); they return what the caller
must do with the data: host pages to free, pages to write to L3, device pages to copy down.
The controller and the planner both use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import Node, PageIndex

__all__ = ["L2Eviction", "select_l2", "after_l3_write", "select_l1", "release_l1"]


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
