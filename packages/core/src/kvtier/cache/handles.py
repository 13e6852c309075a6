"""What a request holds: `Match` (its hits, pinned until release), `FetchHandle` (a load in
flight) and `CommitResult`. The controller changes them only through their methods, under its
lock; engines read their public attributes and call ``wait``/``wait_layer``/``done``. Also the
checks of what an engine passes in (matches, device pages) before anything changes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InvalidArgumentError, PageIndexError, TransferError
from ..interfaces import TransferHandle
from .index import Node

if TYPE_CHECKING:
    from ..device_pool import DeviceKVPool
    from .controller import TieredKVCache
    from .l3tasks import ReadTask

__all__ = ["CommitResult", "Match", "FetchHandle"]


@dataclass(frozen=True)
class CommitResult:
    """What a commit did: ``taken`` device pages now belong to the cache; ``not_taken`` ones
    (pages whose key was already cached on another device page) stay the engine's."""

    new_pages: int
    taken: tuple[int, ...]
    not_taken: tuple[int, ...]


class Match:
    """Result of `TieredKVCache.match`: the leading L1 hit, the L2 hit after it and the count
    of L3 pages after that. Holds pins on its hits until ``release``."""

    def __init__(self, owner: object, keys: list[bytes], num_tokens: int, page_size: int,
                 l1_nodes: list[Node], l2_nodes: list[Node], l3_count: int):
        self._owner = owner
        self.keys = keys
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.l1_pages: list[int] = [n.device_page for n in l1_nodes]  # type: ignore[misc]
        self.l2_pages: list[int] = [n.host_page for n in l2_nodes]    # type: ignore[misc]
        self.l3_count = l3_count
        self._l1_nodes = l1_nodes
        self._l2_nodes = l2_nodes
        self._pinned_l1: list[Node] = list(l1_nodes)    # L1 pins this match holds
        self._pinned_l2: list[Node] = list(l2_nodes)    # L2 pins this match holds
        self._held: set[int] = set(self.l1_pages)       # device pages pinned for it
        self._given: set[int] = set()      # engine pages passed in (not the cache's then)
        self._taken: set[int] = set()      # of those, the ones the cache took
        self._read: ReadTask | None = None
        #: Where the store stages its L3 run into the region loads read in place: the
        #: store's ticket (`L3Store.stage`), cancelled at release.
        self.stage: Any = None
        self._fetch: FetchHandle | None = None
        self._released = False

    # ----- what engines read --------------------------------------------------------------------
    @property
    def l1_count(self) -> int:
        return len(self.l1_pages)

    @property
    def l2_count(self) -> int:
        return len(self.l2_pages)

    @property
    def total_pages(self) -> int:
        """Pages hit in any tier (L1 + L2 + L3)."""
        return self.l1_count + self.l2_count + self.l3_count

    @property
    def pages_to_load(self) -> int:
        """Pages a fetch would bring into L1 (L2 + L3 hits)."""
        return self.l2_count + self.l3_count

    def num_tokens_hit(self, tier: str | None = None) -> int:
        """Tokens hit in ``tier`` ("l1", "l2", "l3") or in all of them (None)."""
        counts = {"l1": self.l1_count, "l2": self.l2_count, "l3": self.l3_count}
        if tier is None:
            return self.total_pages * self.page_size
        if tier not in counts:
            raise InvalidArgumentError(f"tier must be 'l1', 'l2', 'l3' or None, got {tier!r}",
                                       argument="tier", value=tier)
        return counts[tier] * self.page_size

    @property
    def released(self) -> bool:
        return self._released

    @property
    def l3_pages_landed(self) -> int:
        """Pages of the L3 run read into L2 so far for this match (0 before `prefetch`)."""
        return self._read.n_landed if self._read is not None else 0

    @property
    def fetch_handle(self) -> "FetchHandle | None":
        return self._fetch

    def belongs_to(self, owner: object) -> bool:
        return self._owner is owner

    def __repr__(self) -> str:
        return (f"Match(tokens={self.num_tokens}, pages={len(self.keys)}, l1={self.l1_count}, "
                f"l2={self.l2_count}, l3={self.l3_count})")

    # ----- bookkeeping (the cache's, under its lock) --------------------------------------------
    @property
    def read(self) -> "ReadTask | None":
        return self._read

    @property
    def l1_nodes(self) -> list[Node]:
        return self._l1_nodes

    def attach_read(self, task: "ReadTask") -> None:
        self._read = task

    def attach_fetch(self, fh: "FetchHandle") -> None:
        self._fetch = fh

    def give(self, pages: Any) -> None:
        """Engine pages passed in for this request (returned by release unless taken)."""
        self._given.update(pages)

    def gave(self, page: int) -> bool:
        return page in self._given

    def holds(self, page: int) -> bool:
        return page in self._held

    def hold_l1(self, node: Node, page: int) -> None:
        """Pin ``node``'s device page for this match."""
        node.l1_pins += 1
        self._pinned_l1.append(node)
        self._held.add(page)

    def take(self, page: int) -> None:
        """The cache took this engine page (it is not returned by release)."""
        self._taken.add(page)

    def hold_l2(self, node: Node) -> None:
        """Pin ``node``'s host page for this match."""
        node.l2_pins += 1
        self._pinned_l2.append(node)

    def hand_over_l2(self, n2: int, landed: list[Node], rest: list[Node]) -> list[Node]:
        """The first ``n2`` L2 hits and the ``landed`` L3 pages go to a fetch (their pins
        with it); the match keeps the rest. Returns the fetch's nodes."""
        nodes = self._l2_nodes[:n2] + landed
        self._pinned_l2 = self._l2_nodes[n2:] + rest
        return nodes

    def take_back_l2(self, nodes: list[Node]) -> None:
        """A fetch that did not start gives its pins back."""
        self._pinned_l2 += nodes

    def mark_released(self) -> tuple[list[Node], list[Node], list[int]] | None:
        """Released now: (L1 pins, L2 pins to drop, leftover engine pages); None if it was
        already."""
        if self._released:
            return None
        self._released = True
        if self._read is not None:
            self._read.cancelled = True
        if self.stage is not None:
            self.stage.cancel()
        l1, l2 = self._pinned_l1, self._pinned_l2
        self._pinned_l1, self._pinned_l2 = [], []
        return l1, l2, sorted(self._given - self._taken)


class FetchHandle:
    """Completion of a fetch. ``wait_layer(i)`` lets layer i's forward start as soon as
    layer i is in place; ``pages_loaded`` leading pages of the match's L2+L3 hit land in
    ``device_pages[:pages_loaded]``. The hits stay pinned until the load is done."""

    def __init__(self, on_finish: Callable[["FetchHandle", BaseException | None], None],
                 match: Match, handle: TransferHandle, nodes: list[Node],
                 device_pages: list[int], unused: list[int], num_layers: int, *,
                 from_l2: int = 0, in_place_pages: int = 0):
        self._on_finish = on_finish
        #: How many pages after ``nodes`` load straight from a store's arena.
        self.in_place_pages = in_place_pages
        self.match = match
        self._handle = handle
        self._nodes = nodes
        self.device_pages = device_pages        # pages being loaded, in order
        self.unused_pages = unused              # pages given but not loaded (the engine's)
        self.pages_loaded = len(device_pages)
        self.num_layers = num_layers
        self.from_l2 = min(from_l2, len(device_pages))   # leading pages loaded from L2
        self._finished = False
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self.not_taken: list[int] = []          # set once finished: loaded duplicates

    def wait_layer(self, layer: int) -> None:
        self._handle.wait_layer(layer)

    def wait(self) -> None:
        """Make the caller wait for every layer of the load (its stream on an accelerator,
        as ``wait_layer``); raises the load's `TransferError` if it is known to have failed
        by then (none of its pages are taken; ``error`` says so once it is booked)."""
        try:
            self._handle.wait()
        except TransferError as exc:
            self._on_finish(self, exc)
            raise
        if self._handle.done():
            self._on_finish(self, None)      # booked already when the load was a plan
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        if self._handle.done():
            self._on_finish(self, None)
            return True
        return False

    @property
    def tokens_loaded(self) -> int:
        return self.pages_loaded * self.match.page_size

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def error(self) -> BaseException | None:
        return self._error

    # ----- bookkeeping (the cache's, under its lock) --------------------------------------------
    @property
    def transfer(self) -> TransferHandle:
        return self._handle

    @property
    def nodes(self) -> list[Node]:
        return self._nodes

    @property
    def started_at(self) -> float:
        return self._t0

    def mark_finished(self, err: BaseException | None) -> bool:
        """Finished now (False if it already was). A failed load takes none of its pages."""
        if self._finished:
            return False
        self._finished = True
        if err is not None:
            self._error = err
            self.not_taken = list(self.device_pages)
        return True

    def reject(self, page: int) -> None:
        """A loaded page the cache did not take (a duplicate): the engine's again."""
        self.not_taken.append(page)


# --------------------------------------------------------------------------------------------
# What the engine passes in (checked before anything changes)
# --------------------------------------------------------------------------------------------
def is_meta(x: Any) -> bool:
    """A meta-device tensor: a shape without data."""
    dev = getattr(x, "device", None)
    return getattr(dev, "type", None) == "meta"


def check_match(cache: "TieredKVCache", match: Match) -> None:
    if not isinstance(match, Match) or not match.belongs_to(cache):
        raise InvalidArgumentError("expected a Match from this cache's match()",
                                   argument="match")
    if match.released:
        raise InvalidArgumentError("this match was released", argument="match")


def device_page_list(pool: "DeviceKVPool", pages: Any, what: str) -> list[int]:
    """Device page indices as a list of ints, range-checked (fast path for int lists)."""
    if isinstance(pages, (list, tuple)) and all(type(p) is int for p in pages):
        if pages and (min(pages) < 0 or max(pages) >= pool.num_pages):
            bad = min(pages) if min(pages) < 0 else max(pages)
            raise PageIndexError(f"{what}: device page {bad} out of range [0, "
                                 f"{pool.num_pages})", index=bad, limit=pool.num_pages)
        return list(pages)
    if is_meta(pages):
        raise PageIndexError(f"{what} is a meta-device tensor (no data); pass page indices")
    return pool.check_pages(pages, what).tolist()


def check_engine_pages(cache: "TieredKVCache", pages: Any, what: str) -> list[int]:
    """Engine pages for a fetch: in range, distinct, not the cache's (L1) and not being
    loaded by a fetch still in flight."""
    dev = device_page_list(cache.device_pool, pages, what)
    if len(set(dev)) != len(dev):
        raise PageIndexError(f"{what} contain duplicates")
    with cache._lock:
        owned = [d for d in dev if cache._index.l1_owner(d) is not None]
        busy = [d for d in dev if d in cache._loading]
    if owned:
        raise InvalidArgumentError(f"{what}: device page {owned[0]} belongs to the cache "
                                   "(an L1 page); pass free engine pages",
                                   argument="device_pages", value=owned[0])
    if busy:
        raise InvalidArgumentError(f"{what}: device page {busy[0]} is being loaded by a "
                                   "fetch still in flight", argument="device_pages",
                                   value=busy[0])
    return dev
