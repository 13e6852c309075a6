"""The plain data the two halves of the cache exchange: `Lookup`, `Plan` and `PlanResult`.

The index/policy half (`CachePlanner`, no tensors, no I/O) decides what moves; the data path
(`CacheExecutor`, which owns the host pool, the transfer engine and the L3 store) moves it.
Between them go only these frozen dataclasses of ints, bytes and bools, so they pickle and can
cross a process boundary (vLLM's scheduler -> worker metadata, and back).

A `Plan` lists four kinds of operation, each an ordered tuple of pairs:

* ``l3_reads``  ``(key, host_page)``: read the object ``key`` from L3 into ``host_page``;
* ``loads``     ``(host_page, device_page)``: copy a host page into a device page (L2 -> L1);
* ``backups``   ``(device_page, host_page)``: copy a device page into a host page (L1 -> L2);
* ``l3_writes`` ``(host_page, key)``: write ``host_page`` to L3 as the object ``key``.

Order inside one plan: backups and L3 reads start at once; a load from a host page that an
L3 read of the same plan fills starts after that read and fails with it; an L3 write of a host
page that a backup of the same plan fills starts after that backup and fails with it. Other
loads and writes start at once. A `PlanResult` has one bool per operation, in plan order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lookup", "Plan", "PlanResult"]


@dataclass(frozen=True)
class Lookup:
    """How many leading pages (from ``start``) the cache can load: ``l2_pages`` from host
    memory, then ``l3_pages`` more from L3."""

    start: int
    l2_pages: int
    l3_pages: int

    @property
    def pages(self) -> int:
        return self.l2_pages + self.l3_pages


@dataclass(frozen=True)
class Plan:
    """Work for the data path (see the module doc). ``plan_id`` is unique per planner."""

    plan_id: int
    l3_reads: tuple[tuple[bytes, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    backups: tuple[tuple[int, int], ...] = ()
    l3_writes: tuple[tuple[int, bytes], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.l3_reads or self.loads or self.backups or self.l3_writes)

    @property
    def device_pages(self) -> tuple[int, ...]:
        """Device pages the plan reads or writes (the engine must keep them until the plan
        completes)."""
        return tuple(d for _, d in self.loads) + tuple(d for d, _ in self.backups)

    def failed(self) -> "PlanResult":
        """The result of this plan when nothing of it ran (a worker gone, a plan dropped)."""
        return PlanResult(self.plan_id, (False,) * len(self.l3_reads),
                          (False,) * len(self.loads), (False,) * len(self.backups),
                          (False,) * len(self.l3_writes))


@dataclass(frozen=True)
class PlanResult:
    """What the data path did with a plan: one bool per operation, in plan order.

    ``held_host_pages``: host pages a store call past its deadline may still read or write;
    they must stay out of use until a later result for the same plan lists them in
    ``released_host_pages`` (that result has no operations).
    """

    plan_id: int
    l3_reads: tuple[bool, ...] = ()
    loads: tuple[bool, ...] = ()
    backups: tuple[bool, ...] = ()
    l3_writes: tuple[bool, ...] = ()
    held_host_pages: tuple[int, ...] = ()
    released_host_pages: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return all(self.l3_reads) and all(self.loads) and all(self.backups) \
            and all(self.l3_writes)

    @property
    def loaded_prefix(self) -> int:
        """How many leading loads succeeded (the pages an engine may use as a prefix)."""
        n = 0
        for ok in self.loads:
            if not ok:
                break
            n += 1
        return n
