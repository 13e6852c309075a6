"""The plain data the connector's two sides exchange through vLLM (picklable): the scheduler's
`KVTierMetadata` (load orders, saves, probes) for the workers, and the workers'
`KVTierWorkerMetadata` (plan results, measured rates, L3 health) and `KVTierConnectorStats` back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata, KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...cache import Plan, PlanResult
from ...cache.cost import merge_rates
from ...cache.l3io import worse_state

__all__ = ["LoadOrder", "KVTierMetadata", "KVTierWorkerMetadata", "KVTierConnectorStats",
           "KVTierGroupsMetadata", "KVTierGroupsWorkerMetadata"]


@dataclass
class LoadOrder:
    """A planner `Plan` of one request's loads; ``failed_blocks`` are blocks vLLM counts as
    loaded that the plan could not cover (they are reported as load errors)."""

    req_id: str
    plan: Plan
    failed_blocks: list[int]
    is_async: bool


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[Plan] = field(default_factory=list)
    #: L3 -> L2 reads that no request waits for (probes that keep the L3 rate measured).
    prefetches: list[Plan] = field(default_factory=list)
    #: A step to time for the recompute rate (0: not timed -- no prefill, or loads the
    #: forward waits for): its scheduled tokens and their query-key pairs of attention.
    step_tokens: int = 0
    step_pairs: float = 0.0


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Results of finished plans, for the planner (one per plan; ANDed across ranks), and the
    data path's measured rates when they changed (`CacheExecutor.rates`; across ranks the
    slowest)."""

    results: list[PlanResult] = field(default_factory=list)
    rates: dict[str, Any] | None = None
    #: The data path's L3 health (`CacheExecutor.l3_state`) when it changed; across ranks
    #: the worst.
    l3_state: str | None = None
    #: Whether the data path loads L3 pages in place (`CacheExecutor.in_place`), sent once;
    #: across ranks, only if every rank does.
    in_place: bool | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        assert isinstance(other, KVTierWorkerMetadata)
        # a rank may report one plan twice in a step (a save's backups, then its writes):
        # the n-th result of a plan merges with the other rank's n-th, in order
        def numbered(results: list[PlanResult]) -> list[tuple[tuple[int, int], PlanResult]]:
            seen: Counter[int] = Counter()
            out = []
            for r in results:
                out.append(((r.plan_id, seen[r.plan_id]), r))
                seen[r.plan_id] += 1
            return out
        mine = dict(numbered(self.results))
        out = []
        for key, r in numbered(other.results):
            m = mine.pop(key, None)
            if m is None:
                out.append(r)
                continue
            def both(x: tuple[bool, ...], y: tuple[bool, ...]) -> tuple[bool, ...]:
                return tuple(a and b for a, b in zip(x, y))

            def union(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
                return tuple(sorted(set(x) | set(y)))
            # a rank whose writes still run reports its save in two results (the backups
            # now, the writes later): the merge waits for the writes too
            pending = m.writes_pending or r.writes_pending
            out.append(PlanResult(
                r.plan_id, l3_reads=both(m.l3_reads, r.l3_reads), loads=both(m.loads, r.loads),
                backups=both(m.backups, r.backups),
                l3_writes=() if pending else both(m.l3_writes, r.l3_writes),
                held_host_pages=union(m.held_host_pages, r.held_host_pages),
                released_host_pages=union(m.released_host_pages, r.released_host_pages),
                writes_pending=pending, l3_loads=both(m.l3_loads, r.l3_loads),
                l3_reads_tried=None if m.l3_reads_tried is None and r.l3_reads_tried is None
                else min(m.tried_reads, r.tried_reads)))
        out.extend(mine.values())
        in_place = other.in_place if self.in_place is None else \
            self.in_place if other.in_place is None else self.in_place and other.in_place
        return KVTierWorkerMetadata(results=out, rates=merge_rates(self.rates, other.rates),
                                    l3_state=worse_state(self.l3_state, other.l3_state),
                                    in_place=in_place)


class KVTierConnectorStats(KVConnectorStats):
    """kvtier's counters for one interval (pages, bytes, failures per tier); sums."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        merged = Counter(self.data)
        merged.update(other.data or {})
        return KVTierConnectorStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class KVTierGroupsMetadata(KVConnectorMetadata):
    """A hybrid model's step: one `KVTierMetadata` per KV cache group, in vLLM's order."""

    groups: list[KVTierMetadata] = field(default_factory=list)


@dataclass
class KVTierGroupsWorkerMetadata(KVConnectorWorkerMetadata):
    """A hybrid model's worker report: one `KVTierWorkerMetadata` (or None) per group."""

    groups: list[KVTierWorkerMetadata | None] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierGroupsWorkerMetadata":
        assert isinstance(other, KVTierGroupsWorkerMetadata)
        assert len(other.groups) == len(self.groups)
        out: list[KVTierWorkerMetadata | None] = []
        for a, b in zip(self.groups, other.groups):
            out.append(b if a is None else a if b is None else a.aggregate(b))
        return KVTierGroupsWorkerMetadata(groups=out)
