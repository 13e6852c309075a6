"""Staging: a chain's slower members read into its first member's arena by helper processes.

A `chain` whose first member keeps its pages in a shared-memory arena (``shm``) can be loaded
in place: straight from the arena's slots into device pages. Pages that only a slower member
holds (``file``) must first be copied into the arena. Done by the engine's own threads, those
reads share the engine's interpreter lock with the Python code that launches its prefill and
slow it (records/file-store-threads.md: a launch-bound loop ran 1.4-4.1x slower beside
reads on 8 threads, 0.96x beside the same reads from 8 processes). So the chain hands them to
``stage_processes`` helper processes (``python -m kvtier.l3_stores.staging``): each opens the
same member stores (same configs, so the same arena and directory), and for every key it is
given that the arena lacks, reads the page from the first slower member that has it into a
private host page and writes it into the arena. The engine only sends keys and gets counts.
A helper writes a ``file`` member through one lane (``write_lanes`` 1, unless the config
names it): its writes come one batch at a time, and every other process's existence check
reads each writer's log, so eight helpers with a lane per I/O thread made 64 logs to look at.

`Stager.stage` splits a batch of keys over the helpers and returns a `StageTicket` at once;
`StageTicket.wait` waits for the parts, with a timeout. Nothing here can hand out wrong data:
a helper writes through the arena's own crash-safe protocol, and the engine's in-place load
pins only slots the arena holds (a page not staged in time is recomputed).

Failures are counted, never waited on without bound: a helper that exits, or that a frame
cannot reach, resolves its outstanding parts as not staged (``stage_failed_pages``) and is
started again at the next batch, at most once per ``RESTART_S``; a part not back within the
chain's ``stage_timeout_s`` stops being waited for (the cache counts
``l3_stage_late_fetches``). A ticket whose
request left (``cancel``) drops the parts a helper has not begun. Outstanding pages are
bounded (``stage_max_queued_pages``): a batch beyond it stages only what fits and counts the
rest (``stage_refused_pages``).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Sequence

log = logging.getLogger("kvtier.staging")

__all__ = ["Stager", "StageTicket"]

_HEAD = struct.Struct("!I")
#: Seconds between two starts of one helper slot after it exited.
RESTART_S = 5.0
#: Longest wait, when the chain is built, for its helpers to be ready.
START_S = 60.0
#: Longest wait at close for a helper to copy out what was written into the arena and exit.
CLOSE_S = 30.0
#: Fewest keys in one helper's part of a batch (smaller batches are not split further).
MIN_PART = 4


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_HEAD.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _recv(fd: int) -> Any:
    """One frame, or None at end of file."""
    head = _read_exact(fd, _HEAD.size)
    if head is None:
        return None
    data = _read_exact(fd, _HEAD.unpack(head)[0])
    return None if data is None else pickle.loads(data)


class StageTicket:
    """The staging of one batch of keys: ``staged`` counts the keys the arena held once their
    part came back; ``done()`` once every part is back (or failed)."""

    def __init__(self, num_keys: int, timeout_s: float = 2.0, op: str = "stage",
                 staged: int = 0):
        self.num_keys = num_keys
        self.op = op
        #: The longest a load should wait for this ticket (the chain's ``stage_timeout_s``).
        self.timeout_s = timeout_s
        self.staged = staged
        self.failed = 0
        #: Keys not sent: the helpers' queue was full, none was alive, or it was closing.
        self.refused = 0
        self.t0 = time.perf_counter()
        self.cancelled = False
        self._open = 0
        self._cv = threading.Condition()
        self._parts: list[tuple["_Helper", int]] = []
        #: Called with a part's keys when the part comes back with pages staged (the chain
        #: holds them in the arena until the ticket is cancelled).
        self.on_part: Any = None
        #: Called once, at `cancel`: let go of what is held for this ticket.
        self.on_cancel: Any = None
        #: The slot groups the chain holds for this ticket (its own bookkeeping).
        self.held: list[list[int]] = []
        self.let_go = False

    def _add(self, helper: "_Helper", part: int) -> None:
        with self._cv:
            self._open += 1
            self._parts.append((helper, part))

    def _settle(self, staged: int, failed: int) -> None:
        with self._cv:
            self.staged += staged
            self.failed += failed
            self._open -= 1
            self._cv.notify_all()

    def done(self) -> bool:
        with self._cv:
            return self._open <= 0

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every part; True if all are back."""
        deadline = time.perf_counter() + max(0.0, timeout)
        with self._cv:
            while self._open > 0:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def cancel(self) -> None:
        """The request left, or loaded what it wanted: parts no helper has begun are
        dropped and what the store holds for it is let go (idempotent)."""
        with self._cv:
            if self.cancelled:
                return
            self.cancelled = True
            parts = list(self._parts)
            release, self.on_cancel = self.on_cancel, None
        for helper, part in parts:
            helper.cancel(part)
        if release is not None:
            release()


class _Helper:
    """One helper process and the parts sent to it."""

    def __init__(self, stager: "Stager", index: int):
        self.stager = stager
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.alive = False
        self.started_at = -RESTART_S
        self.outstanding: dict[int, tuple[StageTicket, list[bytes]]] = {}
        self.lock = threading.Lock()
        self.ready = threading.Event()

    def start(self) -> None:
        s = self.stager
        self.started_at = time.monotonic()
        self.ready.clear()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kvtier.l3_stores.staging"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    close_fds=True)
            assert proc.stdin is not None and proc.stdout is not None
            _send(proc.stdin.fileno(), {"spec": s.spec, "members": s.members,
                                        "pages": s.batch_pages,
                                        "level": log.getEffectiveLevel()})
        except (OSError, pickle.PicklingError) as exc:
            s._bump("stage_helper_start_failed", 1)
            log.warning("kvtier staging: helper %d did not start: %s", self.index, exc)
            return
        self.proc, self.alive = proc, True
        threading.Thread(target=self._replies, args=(proc,), daemon=True,
                         name=f"kvtier-stage-{self.index}").start()

    def load(self, op: str | None = None) -> int:
        with self.lock:
            return sum(len(k) for t, k in self.outstanding.values() if op is None or t.op == op)

    def send(self, ticket: StageTicket, part: int, keys: list[bytes], op: str = "stage"
             ) -> bool:
        with self.lock:
            if not self.alive or self.proc is None:
                return False
            self.outstanding[part] = (ticket, keys)
            try:
                _send(self.proc.stdin.fileno(), (op, part, keys))        # type: ignore[union-attr]
            except (OSError, ValueError) as exc:
                self.outstanding.pop(part, None)
                log.warning("kvtier staging: helper %d is unreachable: %s", self.index, exc)
                self._lost_locked()
                return False
        ticket._add(self, part)
        return True

    def cancel(self, part: int) -> None:
        with self.lock:
            if self.alive and part in self.outstanding and self.proc is not None:
                try:
                    _send(self.proc.stdin.fileno(), ("cancel", part))    # type: ignore[union-attr]
                except (OSError, ValueError):
                    pass                # its reply thread sees the exit

    def _replies(self, proc: subprocess.Popen) -> None:
        fd = proc.stdout.fileno()                                        # type: ignore[union-attr]
        while True:
            try:
                msg = _recv(fd)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
                log.warning("kvtier staging: helper %d sent a bad reply: %s", self.index, exc)
                msg = None
            if msg is None:
                break
            kind = msg[0]
            if kind == "done":
                _, part, staged, read, cancelled = msg
                with self.lock:
                    ticket, keys = self.outstanding.pop(part, (None, []))
                if ticket is None:
                    continue
                n = len(keys)
                if ticket.op == "demote":
                    self.stager._bump_many({"demote_pages": n, "demoted_pages": staged,
                                            "demote_missed_pages": n - read})
                else:
                    self.stager._bump_many({"stage_pages": n, "staged_pages": staged,
                                            "stage_read_pages": read,
                                            "stage_cancelled_pages": cancelled})
                if ticket.on_part is not None and staged and not ticket.cancelled:
                    try:
                        ticket.on_part(keys)        # held before the waiter is woken
                    except Exception as exc:        # a hold is an optimisation: never fatal
                        log.warning("kvtier staging: holding staged pages failed: %s", exc)
                ticket._settle(staged, n - staged - cancelled)
            elif kind == "ready":
                self.ready.set()
                self.stager._bump("stage_helpers_ready", 1)
        with self.lock:
            if self.proc is proc:
                self._lost_locked()

    def _lost_locked(self) -> None:
        """The process is gone or unreachable: its parts are settled as not staged."""
        proc, self.proc, self.alive = self.proc, None, False
        parts, self.outstanding = self.outstanding, {}
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            if not self.stager.closing:
                self.stager._bump("stage_helper_exits", 1)
                log.warning("kvtier staging: helper %d (pid %d) exited; its %d part(s) are "
                            "not staged", self.index, proc.pid, len(parts))
            threading.Thread(target=_reap, args=(proc,), daemon=True).start()
        for ticket, keys in parts.values():
            self.stager._bump("stage_failed_pages", len(keys))
            ticket._settle(0, len(keys))

    def stop(self) -> None:
        with self.lock:
            proc = self.proc
            if proc is not None and self.alive:
                try:
                    _send(proc.stdin.fileno(), ("stop",))                # type: ignore[union-attr]
                except (OSError, ValueError):
                    pass
        if proc is not None:
            try:                        # it copies out the pages written so far, then exits
                proc.wait(timeout=CLOSE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        with self.lock:
            if self.proc is proc:
                self._lost_locked()


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Stager:
    """``processes`` helpers that copy pages of ``members[1:]`` into ``members[0]``'s arena.

    ``members`` are (store name, config) pairs as the chain built them; ``spec`` the KVSpec.
    """

    def __init__(self, spec: Any, members: list[tuple[str, dict[str, Any]]], *,
                 processes: int, batch_pages: int, max_queued_pages: int,
                 timeout_s: float = 2.0, stats: Any, max_demote_pages: int | None = None):
        self.spec = spec
        self.members = members
        self.batch_pages = batch_pages
        self.max_queued_pages = max_queued_pages
        #: Pages written into the arena and not yet copied out: past it the caller writes
        #: them (a page the arena evicts before its helper copies it is lost to the slower
        #: members, so the window stays a small part of the arena).
        self.max_demote_pages = max_queued_pages if max_demote_pages is None else \
            max(1, min(max_queued_pages, max_demote_pages))
        self.timeout_s = timeout_s
        self._stats = stats            # the chain's _bump(counter, n)
        self.closing = False
        self._lock = threading.Lock()
        self._next = 0
        self.helpers = [_Helper(self, i) for i in range(processes)]
        for h in self.helpers:
            h.start()
        # a helper takes seconds to start (it imports torch): wait for them here, once, so
        # that the first requests are staged rather than recomputed after stage_timeout_s
        deadline = time.monotonic() + START_S
        for h in self.helpers:
            while h.alive and not h.ready.wait(0.05):
                if time.monotonic() > deadline:
                    log.warning("kvtier staging: helper %d not ready after %.0f s; requests "
                                "are staged once it is", h.index, START_S)
                    break

    def _bump(self, counter: str, n: int) -> None:
        if n:
            self._stats(counter, n)

    def _bump_many(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self._bump(k, v)

    def queued_pages(self, op: str | None = None) -> int:
        return sum(h.load(op) for h in self.helpers)

    def stage(self, keys: Sequence[bytes], held: int = 0, setup: Any = None) -> StageTicket:
        """Send ``keys`` to the helpers to copy into the arena; returns at once. ``held``:
        keys before these that the arena holds already (counted staged, not sent);
        ``setup(ticket)`` is called before any part is sent (to set its hooks)."""
        return self._send("stage", keys, held, setup)

    def demote(self, keys: Sequence[bytes]) -> StageTicket:
        """Send ``keys`` (just written into the arena) to the helpers to copy into the slower
        members; returns at once. ``staged`` counts the keys written (into any of them); a key
        the arena lost before its helper read it is counted ``demote_missed_pages``; keys
        past the queue bound are not sent (the ticket's ``refused``: the caller writes them)."""
        return self._send("demote", keys)

    def _send(self, op: str, keys: Sequence[bytes], held: int = 0, setup: Any = None
              ) -> StageTicket:
        keys = list(keys)
        with self._lock:
            if self.closing:
                t = StageTicket(held + len(keys), self.timeout_s, op, staged=held)
                t.refused = len(keys)
                return t
            now = time.monotonic()
            for h in self.helpers:
                if not h.alive and now - h.started_at >= RESTART_S:
                    h.start()
            # copies out go to the first quarter of the helpers only: each helper that writes
            # the file is a writer of its own there (its own preallocated segments)
            pool = self.helpers if op == "stage" else \
                self.helpers[:max(1, len(self.helpers) // 4)]
            live = [h for h in pool if h.alive]
            room = max(0, self.max_queued_pages - self.queued_pages())
            if op == "demote":
                room = min(room, max(0, self.max_demote_pages - self.queued_pages(op)))
            take = keys[:room] if live else []
            self._bump(f"{op}_refused_pages", len(keys) - len(take))
            ticket = StageTicket(held + len(keys), self.timeout_s, op, staged=held)
            ticket.refused = len(keys) - len(take)
            if setup is not None:
                setup(ticket)
            if not take:
                return ticket
            n_parts = max(1, min(len(live), len(take) // MIN_PART))
            base, extra = divmod(len(take), n_parts)
            live.sort(key=lambda h: h.load())
            at = 0
            for i in range(n_parts):
                size = base + (1 if i < extra else 0)
                part_keys = take[at:at + size]
                at += size
                self._next += 1
                if not live[i].send(ticket, self._next, part_keys, op):
                    self._bump(f"{op}_failed_pages", len(part_keys))
                    with ticket._cv:        # other parts settle on reply threads
                        ticket.failed += len(part_keys)
            return ticket

    def alive(self) -> int:
        return sum(1 for h in self.helpers if h.alive)

    def close(self) -> None:
        with self._lock:
            self.closing = True
        for h in self.helpers:
            h.stop()


# ------------------------------------------------------------------------------------------
# The helper process
# ------------------------------------------------------------------------------------------
def _serve(fd_in: int, fd_out: int) -> int:
    from ..host_pool import HostKVPool
    from ..layout import PAGE_FIRST
    from ..registry import create_host_allocator, create_l3_store

    init = _recv(fd_in)
    if not isinstance(init, dict):
        return 2
    logging.basicConfig(level=init.get("level", logging.WARNING),
                        format="%(asctime)s kvtier-stage[%(process)d] %(levelname)s %(message)s")
    spec, members, pages = init["spec"], init["members"], int(init["pages"])
    stores = []
    pool = None
    try:
        for name, cfg in members:
            if isinstance(cfg, dict) and cfg.get("remove_when_unused"):
                # the engine removes the arena, never a helper: a helper that closes first
                # (its engine gone) would remove it under another still opening it
                cfg = {**cfg, "remove_when_unused": False}
            if name == "file" and isinstance(cfg, dict) and "write_lanes" not in cfg:
                cfg = {**cfg, "write_lanes": 1}      # one writer's log per helper
            stores.append(create_l3_store(name, cfg, spec=spec))
        pool = HostKVPool(spec, pages, allocator=create_host_allocator("mmap", {}),
                          layout=PAGE_FIRST)
        for st in stores:
            st.attach(pool)
        try:
            _send(fd_out, ("ready", os.getpid()))
            gone = False
        except OSError:                     # the engine is gone already: copy out, then go
            gone = True
        return _loop(fd_in, fd_out, stores, pages, gone)
    finally:
        for st in reversed(stores):
            try:
                st.close()
            except Exception as exc:     # pragma: no cover (a store broken at exit)
                log.warning("closing %s: %s", st.name, exc)
        if pool is not None:
            pool.close()


def _loop(fd_in: int, fd_out: int, stores: list[Any], pages: int, gone: bool = False) -> int:
    arena, slower = stores[0], stores[1:]
    queue: deque[tuple[str, int, list[bytes]]] = deque()
    dropped: set[int] = set()
    stopping = False
    while True:
        # take every frame already sent (cancels reach parts not yet begun)
        while not stopping:
            ready, _, _ = select.select([fd_in], [], [], 0 if queue else None)
            if not ready:
                break
            msg = _recv(fd_in)
            if msg is None or msg[0] == "stop":
                # closed, or the engine is gone: the pages it wrote into the arena are still
                # there and sound, so they are copied out first (stages are dropped)
                stopping = True
                gone = msg is None
                queue = deque(q for q in queue if q[0] == "demote")
                break
            if msg[0] in ("stage", "demote"):
                queue.append((msg[0], msg[1], msg[2]))
            elif msg[0] == "cancel":
                dropped.add(msg[1])
            if not queue:
                continue
        if not queue:
            return 0
        op, part, keys = queue.popleft()
        if part in dropped:
            dropped.discard(part)
            reply = ("done", part, 0, 0, len(keys))
        else:
            staged = read = 0
            step = _stage_chunk if op == "stage" else _demote_chunk
            for at in range(0, len(keys), pages):
                s, r = step(arena, slower, keys[at:at + pages])
                staged, read = staged + s, read + r
            reply = ("done", part, staged, read, 0)
        if not gone:
            try:
                _send(fd_out, reply)
            except OSError:                 # the engine is gone: copy out the rest anyway
                gone = True


def _stage_chunk(arena: Any, slower: list[Any], keys: list[bytes]) -> tuple[int, int]:
    """Bring ``keys`` into the arena: (keys it holds now, pages read from slower members)."""
    there = arena.touch(keys)      # held ones become recent: the copies must not evict them
    todo = [k for k, ok in zip(keys, there) if not ok]
    staged = len(keys) - len(todo)
    read = 0
    for m in slower:
        if not todo:
            break
        try:
            got = m.batch_get(todo, list(range(len(todo))))
        except Exception as exc:
            log.warning("reading %d pages from %s failed: %s", len(todo), m.name, exc)
            continue
        found = [i for i, ok in enumerate(got) if ok is True]
        read += len(found)
        if found:
            try:
                put = arena.batch_set([todo[i] for i in found], found)
            except Exception as exc:
                log.warning("writing %d pages into %s failed: %s", len(found), arena.name, exc)
                put = [False] * len(found)
            staged += sum(1 for ok in put if ok is True)
        todo = [k for k, ok in zip(todo, got) if ok is not True]
    return staged, read


def _demote_chunk(arena: Any, slower: list[Any], keys: list[bytes]) -> tuple[int, int]:
    """Copy ``keys`` from the arena into every slower member: (keys written into one of
    them at least, keys the arena still held)."""
    try:
        got = arena.batch_get(keys, list(range(len(keys))))
    except Exception as exc:
        log.warning("reading %d pages from %s failed: %s", len(keys), arena.name, exc)
        return 0, 0
    found = [i for i, ok in enumerate(got) if ok is True]
    if not found:
        return 0, 0
    fk = [keys[i] for i in found]
    written = [False] * len(found)
    for m in slower:
        try:
            put = m.batch_set(fk, found)
        except Exception as exc:
            log.warning("writing %d pages into %s failed: %s", len(fk), m.name, exc)
            continue
        written = [w or ok is True for w, ok in zip(written, put)]
    return sum(written), len(found)


def main() -> int:
    # the protocol owns the process's stdout; anything printed goes to stderr
    fd_out = os.dup(1)
    os.dup2(2, 1)
    return _serve(0, fd_out)


if __name__ == "__main__":          # pragma: no cover (run as a helper process)
    sys.exit(main())
