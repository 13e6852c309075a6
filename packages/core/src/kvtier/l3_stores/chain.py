"""`chain`: several L3 stores as one, fastest first (e.g. the shared DRAM arena, then files).

Configured as any store, through ``CacheConfig(l3_store="chain", l3_config=...)``::

    {"stores": [{"store": "shm", "config": {"capacity_bytes": 8 << 30}},
                {"store": "file", "config": {"root": "/var/cache/kvtier"}}]}

* ``batch_set`` writes through to every member; a page is stored (True) where any member
  stored it. A member that failed to store a page has that key deleted there, so an older
  copy it may hold can never be read in place of the new one.
* ``batch_exists`` is the longest leading run of keys each present in some member.
* ``batch_get`` reads each page from the first member that has it; pages found further down
  are written into every faster member (``promote``), so the next read is a fast one.
* ``delete`` and ``clear`` reach every member; ``stats()`` has the chain's own counters and
  each member's under ``members``.

The chain's ``namespace`` (the cache passes its own, as to any store with that setting) goes
to every member whose config has that setting and does not set it. Members are built, probed
and closed by the chain; an unavailable member is a `BackendUnavailableError` when the chain
is built, as it would be alone.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError, StoreError
from ..interfaces import INTERFACE_VERSION, L3_STORES, Availability, L3Store

_ENTRY_KEYS = {"store", "config"}


def _member_configs(stores: Any, namespace: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, config) of every member, checked: a list of ``{"store": name, "config": {}}``."""
    from ..registry import get_backend_class
    if not isinstance(stores, (list, tuple)) or not stores:
        raise ConfigError("chain.stores must be a non-empty list of {store, config} tables, "
                          f"fastest first; got {stores!r}", key="chain.stores", value=stores)
    out = []
    for i, entry in enumerate(stores):
        where = f"chain.stores[{i}]"
        if not isinstance(entry, dict) or "store" not in entry:
            raise ConfigError(f"{where} must be a table with 'store' (a store name) and "
                              f"optionally 'config'; got {entry!r}", key=where, value=entry)
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (a member has "
                              "'store' and 'config')", key=f"{where}.{sorted(unknown)[0]}")
        name, config = entry["store"], entry.get("config", {})
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.store must be a store name, got {name!r}",
                              key=f"{where}.store", value=name)
        if not isinstance(config, dict):
            raise ConfigError(f"{where}.config must be a table, got {config!r}",
                              key=f"{where}.config", value=config)
        cls = get_backend_class(L3_STORES, name)
        if namespace and dataclasses.is_dataclass(cls.Config) and "namespace" not in config \
                and "namespace" in {f.name for f in dataclasses.fields(cls.Config)}:
            config = {**config, "namespace": namespace}
        out.append((name, config))
    return out


class ChainStore(L3Store):
    """L3 stores in order, fastest first: write-through, read from the first that has a
    page, promote what was found lower down."""

    name = "chain"
    interface_version = INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: The members, fastest first: ``[{"store": "shm", "config": {...}}, ...]``.
        stores: list[Any] = field(default_factory=list)
        #: Write pages read from a slower member into every faster one.
        promote: bool = True
        #: Key namespace, handed to members that have the setting and do not set it.
        namespace: str = ""
        #: Helper processes that copy pages only slower members hold into the first
        #: member's shared-memory arena when the cache asks (``stage``: at a request's
        #: prefetch, while it waits for its turn), so the engine loads them in place
        #: without reading them on its own interpreter (`kvtier.l3_stores.staging`). 0: off;
        #: a chain loads in place only with staging on and an ``shm`` first member. A
        #: helper writes a ``file`` member through one lane (``write_lanes`` 1) unless the
        #: member's config names ``write_lanes``.
        stage_processes: int = 0
        #: Pages a helper copies per step (its private host pages).
        stage_batch_pages: int = 32
        #: Most pages sent to the helpers and not yet back; a batch past it stages what fits.
        stage_max_queued_pages: int = 4096
        #: Longest wait of a load for its staged pages; the rest are recomputed.
        stage_timeout_s: float = 2.0
        #: Most of the arena's slots (a fraction) held for staged pages until their request
        #: loads them or leaves: without it, the pages staged for requests further back in
        #: the queue, and new writes, evict the ones staged for the next request. 0: none.
        stage_hold_fraction: float = 0.25
        #: A hold older than this is let go (a request that never came back for its pages).
        stage_hold_s: float = 30.0
        #: With staging on, ``batch_set`` writes the first member and the helpers copy what
        #: it took from there into the slower members. What they cannot take (more than a
        #: quarter of the arena's slots waiting to be copied out, or the queue bound), and
        #: what the first member refused, is written by the caller as without staging.
        stage_writes: bool = True

    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)
        from ..registry import create_l3_store
        c = self.config
        for key, least in (("stage_processes", 0), ("stage_batch_pages", 1),
                           ("stage_max_queued_pages", 1)):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"chain.{key} must be an int >= {least}, got {v!r}",
                                  key=f"chain.{key}", value=v)
        inf = float("inf")
        for key, ok, what in (
                ("stage_timeout_s", lambda v: 0 <= v < inf, "a finite number >= 0"),
                ("stage_hold_fraction", lambda v: 0 <= v <= 0.75, "a number in [0, 0.75]"),
                ("stage_hold_s", lambda v: 0 < v < inf, "a finite number > 0")):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ConfigError(f"chain.{key} must be {what}, got {v!r}", key=f"chain.{key}",
                                  value=v)
        self.member_names: list[str] = []
        self.members: list[L3Store] = []
        self._closed = False
        self._hold_lock = threading.Lock()
        self._held = 0                  # slots held for staged pages, over every ticket
        self._max_held = 0
        self._holding: dict[int, Any] = {}
        self._stager: Any = None
        self.in_place_why_not = ""
        try:
            configs = _member_configs(c.stores, c.namespace)
            for name, cfg in configs:
                self.members.append(create_l3_store(name, cfg, spec=spec))
                self.member_names.append(name)
            if c.stage_processes:
                self._start_staging(configs)
        except BaseException:
            self.close()
            raise

    def _start_staging(self, configs: list[tuple[str, dict[str, Any]]]) -> None:
        if len(self.members) < 2:
            raise ConfigError("chain.stage_processes needs a slower member to stage from "
                              "(two stores or more)", key="chain.stage_processes",
                              value=self.config.stage_processes)
        if type(self.members[0]).in_place_reads is L3Store.in_place_reads or \
                not callable(getattr(self.members[0], "touch", None)):
            raise ConfigError(f"chain.stage_processes: the first member "
                              f"({self.member_names[0]!r}) keeps no shared-memory arena to "
                              "stage into (use 'shm')", key="chain.stage_processes",
                              value=self.config.stage_processes)
        from .staging import Stager
        c = self.config
        slots = self._arena_slots()
        self._stager = Stager(self.spec, configs, processes=c.stage_processes,
                              batch_pages=c.stage_batch_pages,
                              max_queued_pages=c.stage_max_queued_pages,
                              timeout_s=float(c.stage_timeout_s), stats=self._bump,
                              max_demote_pages=max(1, slots // 4) if slots else None)
        self._max_held = int(slots * c.stage_hold_fraction)

    @classmethod
    def probe(cls) -> Availability:
        return Availability.available("composite; its members are probed when it is built")

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        import os

        from ..registry import get_backend_class
        stores = []
        for name in ("shm", "file"):
            sub = os.path.join(workdir, f"chain-{name}")
            stores.append({"store": name,
                           "config": get_backend_class(L3_STORES, name).example_config(sub)})
        return {"stores": stores}

    def attach(self, host_pool) -> None:
        super().attach(host_pool)
        for name, m in zip(self.member_names, self.members):
            if host_pool.layout not in type(m).capabilities().host_layouts:
                raise ConfigError(f"chain: member {name!r} does not take {host_pool.layout} "
                                  "host pools", key="chain.stores", value=name)
            m.attach(host_pool)

    # ----- public API -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("chain: store is closed", backend=self.name)

    def _bump(self, counter: str, n: int) -> None:
        with self._stats_lock:
            extra = self._stats.extra
            extra[counter] = extra.get(counter, 0) + n

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._check_batch(keys)
        pos = 0
        while pos < len(keys):
            for m in self.members:
                n = m.batch_exists(keys[pos:])
                if n:
                    pos += n
                    break
            else:
                break
        return pos

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        self._check_open()
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        for level, m in enumerate(self.members):
            if not todo:
                break
            got = m.batch_get([keys[i] for i in todo], [pages[i] for i in todo])
            found = [i for i, ok in zip(todo, got) if ok is True]
            for i in found:
                out[i] = True
            if found and level and self.config.promote:
                fk, fp = [keys[i] for i in found], [pages[i] for i in found]
                for faster in self.members[:level]:
                    self._bump("promoted", sum(1 for ok in faster.batch_set(fk, fp) if ok))
            todo = [i for i, ok in zip(todo, got) if ok is not True]
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes)
        return out

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        self._check_open()
        pages = self._check_batch(keys, host_pages)
        out = [False] * len(keys)
        members, todo = self.members, list(range(len(keys)))
        if self._stager is not None and self.config.stage_writes and len(keys):
            took = self._write(members[0], keys, pages, todo, out)
            ticket = self._stager.demote([keys[i] for i in took])
            # the slower members: the helpers copy what the arena took; the rest is ours
            behind = set(took[:len(took) - ticket.refused])
            members, todo = members[1:], [i for i in todo if i not in behind]
        for m in members:
            self._write(m, keys, pages, todo, out)
        stored = sum(out)
        self._count(sets=len(keys), set_ok=stored, bytes_written=stored * self.spec.page_bytes,
                    errors=len(keys) - stored)
        return out

    def _write(self, m: L3Store, keys: Sequence[bytes], pages: list[int], todo: list[int],
               out: list[bool]) -> list[int]:
        """``m.batch_set`` of the keys at ``todo``; marks ``out``; a key ``m`` did not store
        is deleted there (never leave an older copy to be read instead). Returns the
        positions stored."""
        if not todo:
            return []
        got = m.batch_set([keys[i] for i in todo], [pages[i] for i in todo])
        stored, failed = [], []
        for i, ok in zip(todo, got):
            if ok is True:
                out[i] = True
                stored.append(i)
            else:
                failed.append(keys[i])
        if failed:
            self._bump("write_through_failed", len(failed))
            m.delete(failed)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._check_batch(keys)
        return sum(1 for k in keys if sum(m.delete([k]) for m in self.members) > 0)

    def clear(self) -> None:
        self._check_open()
        for m in self.members:
            m.clear()

    def _arena_slots(self) -> int:
        try:
            return int(self.members[0].stats().get("slots", 0))
        except Exception:           # a store without the figure: the queue bound alone
            return 0

    def in_place_reads(self):
        """The first member's arena, where helper processes stage the slower members' pages
        into it (``stage_processes``); None otherwise: a page only a slower member holds
        could not be loaded in place."""
        if self._stager is None:
            self.in_place_why_not = "a chain loads in place only with staging on " \
                "(chain.stage_processes) and an 'shm' first member"
            return None
        reads = self.members[0].in_place_reads()
        if reads is None:
            self.in_place_why_not = getattr(self.members[0], "in_place_why_not", "")
        return reads

    def stage(self, keys: Sequence[bytes]):
        """Copy into the first member's arena, in the helper processes, those of ``keys``
        it lacks and a slower member holds; a `StageTicket` at once (None: staging off)."""
        self._check_open()
        self._check_batch(keys)
        if self._stager is None:
            return None
        # the arena's leading run is not sent (no round trip), and every page of the run
        # it holds becomes recent: the pages the helpers bring in must not evict them
        there = self.members[0].touch(keys)            # type: ignore[attr-defined]
        held = there.index(False) if False in there else len(there)
        self._expire_holds()
        if not self._max_held:
            return self._stager.stage(keys[held:], held=held)

        def setup(t: Any) -> None:      # before any part is sent: its reply may come at once
            t.on_cancel = lambda: self._let_go(t)
            t.on_part = lambda part: self._hold(t, part)
            if held:
                self._hold(t, list(keys[:held]))
        return self._stager.stage(keys[held:], held=held, setup=setup)

    # ----- holds: staged pages kept in the arena until their request loads them ----------
    def _hold(self, ticket: Any, keys: list[bytes]) -> None:
        """Pin ``keys`` (those the arena holds) for ``ticket``, within the chain's bound."""
        arena = self.members[0]
        with self._hold_lock:
            if ticket.let_go or self._closed:
                return
            room = self._max_held - self._held
            take = keys[:max(0, room)]
            slots = arena.hold(take) if take else []         # type: ignore[attr-defined]
            if slots:
                ticket.held.append(slots)
                self._held += len(slots)
                self._holding[id(ticket)] = ticket
        self._bump("stage_held_pages", len(slots))
        self._bump("stage_hold_refused_pages", len(keys) - len(take))

    def _let_go(self, ticket: Any) -> int:
        """Let go of what is held for ``ticket`` (once); the slots let go."""
        with self._hold_lock:
            if ticket.let_go:
                return 0
            ticket.let_go = True
            groups, ticket.held = ticket.held, []
            self._holding.pop(id(ticket), None)
            n = sum(len(g) for g in groups)
            self._held -= n
        for g in groups:
            self.members[0].let_go(g)                         # type: ignore[attr-defined]
        return n

    def _expire_holds(self) -> None:
        """Let go of the holds of tickets older than ``stage_hold_s``."""
        now, limit = time.perf_counter(), self.config.stage_hold_s
        with self._hold_lock:
            old = [t for t in self._holding.values() if now - t.t0 > limit]
        for t in old:                  # counted by this call only: a cancel may come first
            self._bump("stage_hold_expired_pages", self._let_go(t))

    def held_pages(self) -> int:
        """Slots of the arena held now for staged pages."""
        with self._hold_lock:
            return self._held

    def object_nbytes(self) -> int:
        return max((m.object_nbytes() for m in self.members), default=self.spec.page_bytes)

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d.setdefault("promoted", 0)
        d.setdefault("write_through_failed", 0)
        if self._stager is not None:
            for k in ("staged_pages", "stage_pages", "stage_read_pages", "stage_failed_pages",
                      "stage_refused_pages", "stage_cancelled_pages", "stage_helper_exits",
                      "demote_pages", "demoted_pages", "demote_missed_pages",
                      "demote_failed_pages", "demote_refused_pages", "stage_held_pages",
                      "stage_hold_refused_pages", "stage_hold_expired_pages"):
                d.setdefault(k, 0)
            d["stage_holding_pages"] = self.held_pages()
            d["stage_helpers_alive"] = self._stager.alive()
            d["stage_queued_pages"] = self._stager.queued_pages()
        d.update(members=[{"store": n, **m.stats()}
                          for n, m in zip(self.member_names, self.members)])
        return d

    def close(self) -> None:
        self._closed = True
        errors = []
        stager, self._stager = getattr(self, "_stager", None), None
        if stager is not None:
            with self._hold_lock:
                tickets = list(self._holding.values())
            for t in tickets:
                self._let_go(t)
            stager.close()
        members, self.members = list(getattr(self, "members", [])), []
        for m in reversed(members):
            try:
                m.close()
            except Exception as exc:   # close every member, then say what failed
                errors.append(exc)
        if errors:
            raise StoreError(f"chain: closing a member failed: {errors[0]}",
                             backend=self.name) from errors[0]
