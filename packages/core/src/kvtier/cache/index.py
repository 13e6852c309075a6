"""The page index: a prefix tree of chained page keys with each page's residency per tier.

A `Node` exists while its page is in L1 (a device page) or L2 (a host page); ``in_l3`` says
the page was written to L3 (the store may have dropped it since). Pins keep a page from being
evicted while a request or a copy uses it. `PageIndex` holds the tree and one LRU order per
tier; it moves no data and holds no tensors, so the same index serves the in-process
controller (`TieredKVCache`, L1 + L2) and the scheduler-side `CachePlanner` (L2 only, L1 being
the engine's own block pool).

Invariants (`PageIndex.check`): a node's parent is in the index (the planner's index may
also hold roots deeper than page 0: runs whose prefix lives only in the engine's own L1); a
page in L1 has its parent in L1; every device and host page is held by one node; the LRU
orders list exactly the resident pages; child counts match. Not locked: the owner locks.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol, Sequence

from ..errors import PageIndexError, PoolExhaustedError
from ..policies import LRUOrder

__all__ = ["Node", "PageIndex", "HostPages", "PageIdPool"]


class HostPages(Protocol):
    """What the index needs of the host page free list (`HostKVPool` or `PageIdPool`)."""

    num_pages: int

    @property
    def free_count(self) -> int: ...

    def alloc(self, n: int) -> list[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...

    def is_allocated(self, page: int) -> bool: ...


class PageIdPool:
    """A free list of host page ids, without memory: the scheduler side's view of L2.

    Same allocation order as `HostKVPool` (lowest free page first), thread-safe.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise PageIndexError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = bytearray(num_pages)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise PoolExhaustedError(f"asked for {n} host pages, {len(self._free)} free",
                                         requested=n, free=len(self._free))
            out = [self._free.pop() for _ in range(n)]
            for p in out:
                self._allocated[p] = 1
            return out

    def free(self, pages: Sequence[int]) -> None:
        with self._lock:
            for p in pages:
                if not 0 <= p < self.num_pages or not self._allocated[p]:
                    raise PageIndexError(f"host page {p} is not allocated", index=p,
                                         limit=self.num_pages)
            for p in pages:
                self._allocated[p] = 0
                self._free.append(p)

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self.num_pages and bool(self._allocated[page])


class Node:
    """One page key in L1 and/or L2."""

    __slots__ = ("key", "parent", "kids", "l1_children", "device_page", "host_page",
                 "l1_pins", "l2_pins", "hits", "in_l3", "backup_pending", "wb_pending")

    def __init__(self, key: bytes, parent: "Node | None"):
        self.key = key
        self.parent = parent
        self.kids: set[Node] = set()   # child nodes in the index (any tier)
        self.l1_children = 0         # child nodes in L1
        self.device_page: int | None = None
        self.host_page: int | None = None
        self.l1_pins = 0             # requests / copies using the device page
        self.l2_pins = 0             # requests / copies using the host page
        self.hits = 0
        self.in_l3 = False           # written to L3 (the store may have dropped it since)
        self.backup_pending = False  # an L1 -> L2 copy is in flight
        self.wb_pending = False      # an L2 -> L3 write-back before eviction is in flight

    @property
    def children(self) -> int:
        return len(self.kids)

    def __repr__(self) -> str:
        return (f"Node({self.key[:4].hex()}, dev={self.device_page}, host={self.host_page}, "
                f"pins={self.l1_pins}/{self.l2_pins}, children={self.children})")


class PageIndex:
    """The prefix tree, the L1 page map and one LRU order per tier (see the module doc)."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.l1_by_page: dict[int, Node] = {}
        self.l1_lru = LRUOrder()
        self.l2_lru = LRUOrder()
        self.backups_inflight = 0     # L1 pages pinned by an L1 -> L2 copy

    # ----- lookups ----------------------------------------------------------------------------
    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    def l1_owner(self, page: int) -> Node | None:
        return self.l1_by_page.get(page)

    @property
    def l1_count(self) -> int:
        return len(self.l1_by_page)

    @property
    def l2_count(self) -> int:
        return len(self.l2_lru)

    def l1_run(self, keys: Sequence[bytes], start: int = 0) -> list[Node]:
        """Nodes of the leading run of ``keys[start:]`` held in L1."""
        out: list[Node] = []
        for k in keys[start:]:
            nd = self.nodes.get(k)
            if nd is None or nd.device_page is None:
                break
            out.append(nd)
        return out

    def l2_run(self, keys: Sequence[bytes], start: int = 0) -> list[Node]:
        """Nodes of the leading run of ``keys[start:]`` held in L2."""
        out: list[Node] = []
        for k in keys[start:]:
            nd = self.nodes.get(k)
            if nd is None or nd.host_page is None:
                break
            out.append(nd)
        return out

    # ----- changes ----------------------------------------------------------------------------
    def node(self, key: bytes, parent: Node | None) -> Node:
        """The node of ``key``, created under ``parent`` if new."""
        nd = self.nodes.get(key)
        if nd is None:
            nd = Node(key, parent)
            self.nodes[key] = nd
            if parent is not None:
                parent.kids.add(nd)
        return nd

    def l1_add(self, node: Node, page: int, touch: bool = True) -> None:
        node.device_page = page
        self.l1_by_page[page] = node
        if node.parent is not None:
            node.parent.l1_children += 1
        if touch:
            self.l1_lru.touch(node.key, node)

    def l1_remove(self, node: Node) -> int:
        page = node.device_page
        assert page is not None
        node.device_page = None
        del self.l1_by_page[page]
        if node.parent is not None:
            node.parent.l1_children -= 1
        self.l1_lru.discard(node.key)
        self.maybe_drop(node)
        return page

    def l2_add(self, node: Node, page: int) -> None:
        """Register an L2 copy; the caller touches the chain (`touch_l2_up`)."""
        node.host_page = page
        self.l2_lru.touch(node.key, node)

    def l2_remove(self, node: Node) -> int:
        page = node.host_page
        assert page is not None
        node.host_page = None
        self.l2_lru.discard(node.key)
        self.maybe_drop(node)
        return page

    def touch_chain(self, chain: Sequence[Node], *, l1: bool = True) -> None:
        """Touch a chain leaf first in L1 (if ``l1``) and, where it has a host page, in L2."""
        l1_touch, l2_touch = self.l1_lru.touch, self.l2_lru.touch
        for nd in reversed(chain):
            if l1 and nd.device_page is not None:
                l1_touch(nd.key, nd)
            if nd.host_page is not None:
                l2_touch(nd.key, nd)

    def touch_l2_up(self, nodes: Iterable[Node]) -> None:
        """Touch ``nodes`` (chain order) and their ancestors in L2, deepest first, so that a
        prefix stays newer than its extensions (the LRU scan then meets leaves first)."""
        touch = self.l2_lru.touch
        seen: set[bytes] = set()
        for nd in reversed(list(nodes)):
            cur: Node | None = nd
            while cur is not None and cur.key not in seen:
                seen.add(cur.key)
                if cur.host_page is not None:
                    touch(cur.key, cur)
                cur = cur.parent

    def maybe_drop(self, node: Node) -> None:
        if node.device_page is None and node.host_page is None:
            assert node.children == 0, f"{node} would orphan its children"
            del self.nodes[node.key]
            if node.parent is not None:
                node.parent.kids.discard(node)

    # ----- views (tests, metrics) -------------------------------------------------------------
    def l2_pages(self) -> dict[bytes, int]:
        """Key -> host page of every L2 page."""
        return {k: nd.host_page for k, nd in self.l2_lru.items()}

    def check(self, host: HostPages | None = None) -> None:
        """Assert the structural invariants (module doc); AssertionError names the node."""
        seen_host: set[int] = set()
        for key, nd in self.nodes.items():
            assert nd.key == key
            assert nd.device_page is not None or nd.host_page is not None, nd
            p = nd.parent
            if p is not None:
                assert self.nodes.get(p.key) is p, f"{nd}: parent gone"
                if nd.device_page is not None:
                    assert p.device_page is not None, f"{nd}: L1 page, parent not in L1"
            if nd.device_page is not None:
                assert self.l1_by_page.get(nd.device_page) is nd
                assert nd.key in self.l1_lru
            if nd.host_page is not None:
                assert nd.host_page not in seen_host
                seen_host.add(nd.host_page)
                if host is not None:
                    assert host.is_allocated(nd.host_page)
                assert nd.key in self.l2_lru
            assert nd.l1_pins >= 0 and nd.l2_pins >= 0, nd
        children: dict[bytes, int] = {}
        l1_children: dict[bytes, int] = {}
        for nd in self.nodes.values():
            if nd.parent is not None:
                children[nd.parent.key] = children.get(nd.parent.key, 0) + 1
                if nd.device_page is not None:
                    l1_children[nd.parent.key] = l1_children.get(nd.parent.key, 0) + 1
        for key, nd in self.nodes.items():
            assert nd.children == children.get(key, 0), nd
            assert all(self.nodes.get(k.key) is k and k.parent is nd for k in nd.kids), nd
            assert nd.l1_children == l1_children.get(key, 0), nd
        assert len(self.l1_by_page) == len(self.l1_lru)
        assert self.backups_inflight == sum(nd.backup_pending for nd in self.nodes.values())
        assert len(seen_host) == len(self.l2_lru)
