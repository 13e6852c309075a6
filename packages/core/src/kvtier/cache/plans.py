"""The plain data the two halves of the cache exchange: `Lookup`, `Plan` and `PlanResult`.

The index/policy half (`CachePlanner`, no tensors, no I/O) decides what moves; the data path
(`CacheExecutor`, which owns the host pool, the transfer engine and the L3 store) moves it.
Between them go only these frozen dataclasses of ints, bytes and bools, so they pickle and can
cross a process boundary (vLLM's scheduler -> worker metadata, and back).

A `Plan` lists five kinds of operation, each an ordered tuple of pairs:

* ``l3_reads``  ``(key, host_page)``: read the object ``key`` from L3 into ``host_page``;
* ``loads``     ``(host_page, device_page)``: copy a host page into a device page (L2 -> L1);
* ``backups``   ``(device_page, host_page)``: copy a device page into a host page (L1 -> L2);
* ``l3_writes`` ``(host_page, key)``: write ``host_page`` to L3 as the object ``key``;
* ``l3_loads``  ``(key, device_page)``: load the object ``key`` straight from the store's
  memory into ``device_page`` (a store whose objects sit in host memory, loaded in place:
  `kvtier.cache.inplace`); the leading run the store holds loads, the rest fail.

A request's pages are loaded in the order ``loads`` then ``l3_loads`` (`Plan.load_pages`,
`PlanResult.load_results`): a planner puts the L2 hit first and the L3 hit after it.

Order inside one plan: backups and L3 reads start at once; a load from a host page that an
L3 read of the same plan fills starts after that read and fails with it; an L3 write of a host
page that a backup of the same plan fills starts after that backup and fails with it. Other
loads and writes start at once. A `PlanResult` has one bool per operation, in plan order.

Those two are the only chains, and the only ways one host page may appear twice in a plan: a
host page that an L3 read or a backup fills is filled by that one operation only, is not the
source of an L3 write if a read fills it, nor the source of a load if a backup fills it (each
would race the fill, and the store would keep one key's bytes under another). Within a list
no page repeats, and no device page is both loaded and backed up. A data path refuses a plan
that breaks these rules before any of it starts.

A plan id is used once: a data path runs a plan of a given id at most once, and refuses it
again even after its result came back (a replayed load would copy whatever the host page holds
by then). Ids are any ints, of either sign; a planner's ids grow in magnitude over time
(`CachePlanner` counts up under its instance's high bits), which lets a data path forget old
ids without accepting them again. A ``two_part`` save (`CacheExecutor.submit`) is one plan
reported in two results of its id: everything but its L3 writes, then its writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["Lookup", "Offer", "Plan", "PlanResult", "hit_counts"]


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
class Offer:
    """What a planner offers for a request (`CachePlanner.offer`): of the pages ``lookup``
    found, the leading ``l2_pages`` from host memory and ``l3_pages`` more from L3 are worth
    loading; the ``skipped`` ones are left to the engine to compute (the cost split).
    ``probe``: an L3 -> L2 read that keeps the L3 rate measured while the split skips L3
    pages (run it with the request's plans; it waits for nothing)."""

    lookup: Lookup
    l2_pages: int
    l3_pages: int
    probe: "Plan | None" = None

    @property
    def pages(self) -> int:
        return self.l2_pages + self.l3_pages

    @property
    def skipped_l2(self) -> int:
        return self.lookup.l2_pages - self.l2_pages

    @property
    def skipped_l3(self) -> int:
        return self.lookup.l3_pages - self.l3_pages


@dataclass(frozen=True)
class Plan:
    """Work for the data path (see the module doc). ``plan_id`` is unique per planner."""

    plan_id: int
    l3_reads: tuple[tuple[bytes, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    backups: tuple[tuple[int, int], ...] = ()
    l3_writes: tuple[tuple[int, bytes], ...] = ()
    l3_loads: tuple[tuple[bytes, int], ...] = ()
    #: The store may first have to stage ``l3_loads`` into the memory it loads in place from
    #: (`L3Store.stage`): where the arena holds fewer of them than asked, the data path has
    #: the rest staged and loads once that is done (bounded by the store), off the caller's
    #: thread. (The controller stages at prefetch and waits itself: off there.)
    stage: bool = False

    @property
    def empty(self) -> bool:
        return not (self.l3_reads or self.loads or self.backups or self.l3_writes
                    or self.l3_loads)

    def check_shape(self) -> None:
        """Raise a one-line `InvalidArgumentError` unless the plan is well formed: an int id,
        and each operation list a tuple (or list) of pairs whose keys are bytes. Page numbers,
        their ranges and aliasing are the data path's to check: it knows its pools."""
        pid = self.plan_id
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise InvalidArgumentError(f"plan id {pid!r} is not an int", argument="plan_id",
                                       value=pid)
        for name, key_at in (("l3_reads", 0), ("loads", None), ("backups", None),
                             ("l3_writes", 1), ("l3_loads", 0)):
            ops = getattr(self, name)
            if not isinstance(ops, (tuple, list)):
                raise InvalidArgumentError(f"plan {pid}: {name} is a {type(ops).__name__}, "
                                           f"not a tuple of pairs", argument=name)
            for op in ops:
                if not isinstance(op, (tuple, list)) or len(op) != 2:
                    raise InvalidArgumentError(f"plan {pid}: {name} entry {op!r} is not a "
                                               f"pair", argument=name, value=op)
                if key_at is not None and not isinstance(op[key_at], bytes):
                    raise InvalidArgumentError(f"plan {pid}: {name} key {op[key_at]!r} is not "
                                               f"bytes", argument=name, value=op[key_at])

    @property
    def device_pages(self) -> tuple[int, ...]:
        """Device pages the plan reads or writes (the engine must keep them until the plan
        completes)."""
        return self.load_pages + tuple(d for d, _ in self.backups)

    @property
    def load_pages(self) -> tuple[int, ...]:
        """The device pages the plan loads, in the request's order (``loads``, then
        ``l3_loads``)."""
        return tuple(d for _, d in self.loads) + tuple(d for _, d in self.l3_loads)

    def failed(self) -> "PlanResult":
        """The result of this plan when nothing of it ran (a worker gone, a plan dropped): no
        L3 read was tried, so none says anything of its object."""
        return PlanResult(self.plan_id, (False,) * len(self.l3_reads),
                          (False,) * len(self.loads), (False,) * len(self.backups),
                          (False,) * len(self.l3_writes), l3_loads=(False,) * len(self.l3_loads),
                          l3_reads_tried=0 if self.l3_reads else None)


@dataclass(frozen=True)
class PlanResult:
    """What the data path did with a plan: one bool per operation, in plan order.

    ``held_host_pages``: host pages a store call past its deadline may still read or write;
    they must stay out of use until a later result for the same plan lists them in
    ``released_host_pages`` (that result has no operations).

    ``writes_pending``: the plan's L3 writes still run; this result books every other
    operation (its ``l3_writes`` is empty), so that backed-up pages serve hits at once, and a
    later result for the same plan has only the ``l3_writes`` (every other list empty).

    ``l3_reads_tried``: how many leading L3 reads the data path asked the store for (None: all
    of them). A failed read among those says its object cannot be read (a planner stops
    offering it); one never asked for (the plan never ran, L3 was off, a call before it passed
    its deadline) says nothing of its object.
    """

    plan_id: int
    l3_reads: tuple[bool, ...] = ()
    loads: tuple[bool, ...] = ()
    backups: tuple[bool, ...] = ()
    l3_writes: tuple[bool, ...] = ()
    held_host_pages: tuple[int, ...] = ()
    released_host_pages: tuple[int, ...] = ()
    writes_pending: bool = False
    l3_loads: tuple[bool, ...] = ()
    l3_reads_tried: int | None = None

    @property
    def ok(self) -> bool:
        return all(self.l3_reads) and all(self.loads) and all(self.backups) \
            and all(self.l3_writes) and all(self.l3_loads)

    @property
    def tried_reads(self) -> int:
        """`l3_reads_tried`, None read as every read."""
        n = len(self.l3_reads)
        return n if self.l3_reads_tried is None else min(n, self.l3_reads_tried)

    @property
    def load_results(self) -> tuple[bool, ...]:
        """One bool per page of `Plan.load_pages`, in the same order."""
        return self.loads + self.l3_loads

    @property
    def loaded_prefix(self) -> int:
        """How many leading loads succeeded (the pages an engine may use as a prefix)."""
        res = self.load_results
        return next((i for i, ok in enumerate(res) if not ok), len(res))


def hit_counts(l2_pages: int, l3_pages: int, page_size: int) -> dict[str, int]:
    """The hit metrics of pages loaded into L1 (``l2/l3_hit_pages`` and ``_tokens``): what
    every controller counts once a load has landed, the one definition of a hit."""
    return {"l2_hit_pages": l2_pages, "l3_hit_pages": l3_pages,
            "l2_hit_tokens": l2_pages * page_size, "l3_hit_tokens": l3_pages * page_size}
