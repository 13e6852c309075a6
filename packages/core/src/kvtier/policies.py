"""The controller's policies: when to write a page down a tier, how long to wait for L3,
and which pages to evict.

* Write: ``write_through`` backs every committed page up to L2 and then (in the background)
  to L3; ``write_through_selective`` does the same once a page has been hit
  ``selective_threshold`` times; ``write_back`` writes a page to L2 only when it is evicted
  from L1, and to L3 only when it is evicted from L2.
* Prefetch from L3: ``wait_complete`` (the default) waits for every page; the wait is
  bounded because each store call is (a call past ``l3_call_timeout_s`` is a counted failure
  that ends it). ``timeout`` waits up to ``base + per_1k * tokens / 1024`` seconds, capped.
  ``best_effort`` never waits: a fetch takes only the pages that have landed in L2 by then,
  which is nothing unless ``prefetch()`` was called well before (when the request was
  queued); the pages matched but not loaded count as ``prefetch_cut_pages``, not as hits.
  Below ``min_tokens`` L3 is not consulted.
* Eviction: LRU per tier, leaves first (see `LRUOrder`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterator

from .errors import ConfigError


# --------------------------------------------------------------------------------------------
# Write policies
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WritePolicy:
    """When a page moves down a tier. Subclasses set the flags; the controller reads them."""

    name: ClassVar[str] = ""
    #: Back L1 pages up to L2 when a page is evicted from L1 (write-back of dirty pages).
    demote_on_l1_evict: ClassVar[bool] = False
    #: Write a page to L3 as soon as it lands in L2 from L1 (write-through).
    l3_on_backup: ClassVar[bool] = False
    #: Write a page to L3 when it is evicted from L2 and L3 does not hold it yet (write-back).
    l3_on_l2_evict: ClassVar[bool] = False
    #: Whether to back a saved page up depends on how often it was saved (``backup_on_commit``
    #: of its count); otherwise a planner that cannot see L1 backs every saved page up.
    counts_saves: ClassVar[bool] = False

    def backup_on_commit(self, hits: int) -> bool:
        """Back a freshly committed (or re-committed) page up to L2 now?"""
        return False

    def backup_on_hit(self, hits: int) -> bool:
        """Back an L1 page up to L2 now that it has been hit ``hits`` times?"""
        return False


@dataclass(frozen=True)
class WriteThrough(WritePolicy):
    name: ClassVar[str] = "write_through"
    l3_on_backup: ClassVar[bool] = True

    def backup_on_commit(self, hits: int) -> bool:
        return True


@dataclass(frozen=True)
class WriteThroughSelective(WritePolicy):
    name: ClassVar[str] = "write_through_selective"
    l3_on_backup: ClassVar[bool] = True
    counts_saves: ClassVar[bool] = True
    threshold: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) \
                or self.threshold < 1:
            raise ConfigError(f"selective_threshold must be an int >= 1, got "
                              f"{self.threshold!r}", key="selective_threshold",
                              value=self.threshold)

    def backup_on_commit(self, hits: int) -> bool:
        return hits >= self.threshold

    def backup_on_hit(self, hits: int) -> bool:
        return hits >= self.threshold


@dataclass(frozen=True)
class WriteBack(WritePolicy):
    name: ClassVar[str] = "write_back"
    demote_on_l1_evict: ClassVar[bool] = True
    l3_on_l2_evict: ClassVar[bool] = True


WRITE_POLICIES: dict[str, type[WritePolicy]] = {
    p.name: p for p in (WriteThrough, WriteThroughSelective, WriteBack)}


def make_write_policy(name: str, *, selective_threshold: int = 2) -> WritePolicy:
    cls = WRITE_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown write_policy {name!r}; expected one of "
                          f"{sorted(WRITE_POLICIES)}", key="write_policy", value=name)
    if cls is WriteThroughSelective:
        return cls(threshold=selective_threshold)
    return cls()


# --------------------------------------------------------------------------------------------
# Prefetch policies
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefetchPolicy:
    """How long a fetch waits for pages still coming from L3, and when L3 is consulted."""

    name: ClassVar[str] = ""
    #: A fetch waits for every page still coming from L3 (no budget).
    waits_for_all: ClassVar[bool] = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            raise ConfigError(f"prefetch_min_tokens must be an int >= 0, got "
                              f"{self.min_tokens!r}", key="prefetch_min_tokens",
                              value=self.min_tokens)

    def consult_l3(self, num_tokens: int) -> bool:
        """Ask L3 about a run of ``num_tokens`` tokens not found in L1/L2?"""
        return num_tokens > 0 and num_tokens >= self.min_tokens

    def wait_budget_s(self, num_tokens: int) -> float:
        """Seconds a fetch may wait (from the prefetch's start) for ``num_tokens`` from L3."""
        raise NotImplementedError


@dataclass(frozen=True)
class BestEffort(PrefetchPolicy):
    name: ClassVar[str] = "best_effort"

    def wait_budget_s(self, num_tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class WaitComplete(PrefetchPolicy):
    name: ClassVar[str] = "wait_complete"
    waits_for_all: ClassVar[bool] = True

    def wait_budget_s(self, num_tokens: int) -> float:
        return math.inf


@dataclass(frozen=True)
class Timeout(PrefetchPolicy):
    name: ClassVar[str] = "timeout"
    base_s: float = 0.05
    per_1k_tokens_s: float = 0.01
    cap_s: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, v in (("prefetch_timeout_base_s", self.base_s),
                       ("prefetch_timeout_per_1k_tokens_s", self.per_1k_tokens_s),
                       ("prefetch_timeout_cap_s", self.cap_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 \
                    or math.isinf(v):
                raise ConfigError(f"{key} must be a finite number >= 0, got {v!r}", key=key,
                                  value=v)

    def wait_budget_s(self, num_tokens: int) -> float:
        return min(self.base_s + self.per_1k_tokens_s * num_tokens / 1024.0, self.cap_s)


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    p.name: p for p in (BestEffort, WaitComplete, Timeout)}


def make_prefetch_policy(name: str, *, min_tokens: int = 0, base_s: float = 0.05,
                         per_1k_tokens_s: float = 0.01, cap_s: float = 1.0) -> PrefetchPolicy:
    cls = PREFETCH_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown prefetch_policy {name!r}; expected one of "
                          f"{sorted(PREFETCH_POLICIES)}", key="prefetch_policy", value=name)
    if cls is Timeout:
        return Timeout(min_tokens=min_tokens, base_s=base_s, per_1k_tokens_s=per_1k_tokens_s,
                       cap_s=cap_s)
    return cls(min_tokens=min_tokens)


# --------------------------------------------------------------------------------------------
# Eviction
# --------------------------------------------------------------------------------------------
class LRUOrder:
    """Access order of one tier's pages, oldest first, with leaf-aware victim selection.

    Callers touch a chain of pages leaf first, so a prefix is always newer than its
    extensions and the oldest entries are the leaves: a scan from the oldest end finds victims
    in amortised O(1) per page, skipping only pages in use. Not locked; the owner locks.
    """

    def __init__(self) -> None:
        self._od: OrderedDict[Hashable, Any] = OrderedDict()

    def touch(self, key: Hashable, item: Any) -> None:
        """Mark ``key`` most recently used (adding it if new)."""
        try:
            self._od.move_to_end(key)
        except KeyError:
            self._od[key] = item

    def discard(self, key: Hashable) -> None:
        self._od.pop(key, None)

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._od

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._od)

    def items(self):
        return self._od.items()

    def select(self, n: int, *, evictable: Callable[[Any], bool],
               blockers: Callable[[Any], int], parent: Callable[[Any], Hashable | None],
               leaves: Callable[[Any], bool], max_passes: int = 3) -> list[Any]:
        """Up to ``n`` victims, least recently used first, leaves only.

        ``evictable(item)``: not in use; ``blockers(item)``: how many children keep it from
        being a leaf; ``leaves(item)``: whether evicting it removes one child from its
        ``parent(item)`` (so the parent may become a leaf within this same selection).
        """
        chosen: list[Any] = []
        if n <= 0:
            return chosen
        picked: set[Hashable] = set()
        freed: dict[Hashable, int] = {}
        for _ in range(max_passes):
            progress = False
            for key, item in self._od.items():
                if key in picked or not evictable(item):
                    continue
                if blockers(item) - freed.get(key, 0) > 0:
                    continue
                chosen.append(item)
                picked.add(key)
                progress = True
                if leaves(item):
                    p = parent(item)
                    if p is not None:
                        freed[p] = freed.get(p, 0) + 1
                if len(chosen) >= n:
                    return chosen
            if not progress or not freed:
                break
        return chosen
