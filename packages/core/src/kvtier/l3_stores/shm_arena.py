"""The arena behind the `shm` store: one shared file, its header, slot table and slots, and
the protocol by which processes that never talk to each other share it.

The file's layout and header are in `kvtier.l3_stores.shm_format`.

Design, and why:

* **A set-associative index** (as a CPU cache is), not a separate hash table: a key's digest
  picks a set of ``ways`` consecutive slots and the key lives in one of them. The slot table
  is the index, so no second structure can be left out of step with the slots by a crash;
  there are no tombstones and no rehash, and capacity is the slot count whoever writes. LRU
  is exact within a set (the least recently stamped slot goes) and approximate across sets.
* **Readers take no lock: the generation is a seqlock.** A writer makes a slot's generation
  odd before it changes the slot's key or bytes and even again once both are in place; a
  reader reads the generation, copies the payload, then reads generation and key again: any
  change, or an odd value, is a miss. A reader that dies leaves nothing behind, and a slot
  taken over while it is read is a detected miss, never mixed bytes.
* **Writers serialise only the choice of a slot**: an OFD byte-range lock per set
  (``F_OFD_SETLK`` on the arena file, held for microseconds), then a lock per slot held while
  the slot is odd. The kernel drops both when a process dies, so no lock outlives its
  holder, and a slot left odd by a killed writer is recognised (its slot lock is free) and
  reclaimed by the next writer needing a slot in its set. OFD locks rather than classic POSIX
  ones because they belong to an open file, not to a process: two stores of one arena in one
  process exclude each other and closing one does not drop the other's locks (threads of one
  store are kept apart by in-process locks; a forked child reopens the file).
* **Memory order.** On x86-64 the generation check alone is sound: loads are not reordered
  with loads, and the lock operations between a writer's odd generation and its copy (and
  memcpy's closing ``sfence``) keep streaming stores in order. Where the CPU may reorder
  (aarch64), the store's ``checksum="auto"`` writes a CRC-32 of key digest and payload that
  readers check, so a reordered read is a counted miss.
* **Creation.** Every opener takes an init lock; the first initialises the file (size,
  ``posix_fallocate`` so a full tmpfs is an error now rather than a SIGBUS later, then the
  header, last). A header of all zeros is a creator that died initialising: initialised
  again. Anything else that is not a valid header of this identity and geometry is refused.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import StoreError
from .shm_format import HEADER_BYTES, META_BYTES, Geometry, check_header, pack_header

#: ``struct flock`` of Linux (64-bit off_t): type, whence, start, len, pid, padding.
_FLOCK = struct.Struct("hhqqi4x")
F_OFD_SETLK: int = getattr(fcntl, "F_OFD_SETLK", -1)
#: Lock bytes live far beyond any arena's end (a lock needs no byte to exist).
_LOCK_BASE = 1 << 48
_INIT_LOCK = _LOCK_BASE
_USERS_LOCK = _LOCK_BASE + 1
_SET_LOCKS = _LOCK_BASE + 64
_STRIPES = 64
_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK

# results of Arena.get / Arena.claim
HIT, MISS, BUSY, TORN, FULL, TIMEOUT, OK = range(7)

_memmove = ctypes.memmove        # a foreign call: the GIL is released while it copies
_WORDS = struct.Struct("<4Q")


class Digest(NamedTuple):
    """A key as the arena knows it: its 32-byte digest as four words (the first never zero:
    empty slots have zeros there), and its set."""

    raw: bytes
    words: tuple[int, ...]
    set: int


def try_lock(fd: int, start: int, kind: int = fcntl.F_WRLCK) -> bool:
    """Take (or convert to ``kind``) the OFD lock of byte ``start``; False if another open
    file holds a conflicting one."""
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock(fd: int, start: int) -> None:
    fcntl.fcntl(fd, F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))


def unlock_all(fd: int) -> None:
    """Drop every lock this open file holds (the whole file: length 0 reaches its end)."""
    fcntl.fcntl(fd, F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0))


def lock_within(fd: int, start: int, timeout: float, kind: int = fcntl.F_WRLCK,
                longest_sleep: float = 1e-3) -> bool:
    """``try_lock`` until it succeeds or ``timeout`` seconds passed (never blocks in the
    kernel: a holder that stops but does not die costs a counted timeout, not a hang)."""
    if try_lock(fd, start, kind):
        return True
    deadline = time.monotonic() + timeout
    delay = 20e-6
    while time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, longest_sleep)
        if try_lock(fd, start, kind):
            return True
    return False


class ArenaRefused(StoreError):
    """An arena path that cannot be used; ``reason`` names why (symlink, not_regular, owner,
    mode, group, corrupted, truncated, foreign, geometry, no_space, busy, io)."""

    def __init__(self, message: str, *, reason: str, path: str):
        super().__init__(f"shm: {message}", backend="shm")
        self.reason = reason
        self.path = path


_arenas: "weakref.WeakSet[Arena]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for arena in list(_arenas):
        arena._reopen_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Arena:
    """One open arena: the mapping, the slot table as arrays, and the slot protocol.

    ``mode`` is the file's permission mode; ``gid`` (None: private) the group sharing it.
    Raises `ArenaRefused` for a path that cannot be used."""

    def __init__(self, path: str, geo: Geometry, *, fingerprint: str, namespace: str,
                 mode: int = 0o600, gid: int | None = None, populate: bool = True,
                 open_timeout_s: float = 60.0):
        if F_OFD_SETLK < 0:                                # pragma: no cover (not Linux)
            raise StoreError("shm: this platform has no OFD locks (F_OFD_SETLK)",
                             backend="shm")
        self.path, self.geo = path, geo
        self.fingerprint, self.namespace = fingerprint, namespace
        self.mode, self.gid = mode, gid
        self.populate = populate
        self.created = False
        self.fd = -1
        self._writing: set[int] = set()          # slots this open file is filling
        self._pins: dict[int, int] = {}          # slots read in place: count of readers
        self._pin_lock = threading.Lock()        # _writing vs _pins, in this process
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self.fd = self._open(open_timeout_s)
        try:
            self._map()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        _arenas.add(self)

    # ----- opening --------------------------------------------------------------------------
    def _refuse(self, message: str, reason: str) -> ArenaRefused:
        return ArenaRefused(f"{self.path}: {message}", reason=reason, path=self.path)

    def _open_once(self) -> tuple[int, bool]:
        try:
            return os.open(self.path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, self.mode), True
        except FileExistsError:
            pass
        except OSError as exc:
            raise self._refuse(f"cannot create the arena: {exc.strerror}", "io") from exc
        try:
            return os.open(self.path, _OPEN_FLAGS), False
        except FileNotFoundError:
            return -1, False                     # removed in between: try again
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refuse("is a symlink; never followed (use the real path as "
                                   "shm.root)", "symlink") from exc
            if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
                raise self._refuse("is not a regular file", "not_regular") from exc
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise self._refuse(f"cannot open it ({exc.strerror}): another user's arena? "
                                   "remove it or choose another shm.name", "owner") from exc
            raise self._refuse(f"cannot open the arena: {exc.strerror}", "io") from exc

    def _check_file(self, fd: int, created: bool) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise self._refuse(f"is not a regular file (mode {st.st_mode:o})", "not_regular")
        if created:
            try:
                os.fchmod(fd, self.mode)             # whatever the umask
                if self.gid is not None:
                    os.fchown(fd, -1, self.gid)
            except OSError as exc:
                raise self._refuse(f"cannot give the new arena mode {self.mode:o} / group "
                                   f"{self.gid}: {exc.strerror}", "group") from exc
            return os.fstat(fd)
        perm = stat.S_IMODE(st.st_mode)
        if self.gid is None:
            if st.st_uid != os.geteuid():
                raise self._refuse(f"belongs to uid {st.st_uid}, not to this process "
                                   f"(uid {os.geteuid()}); an arena is shared by one user, or "
                                   "by a group with shm.group", "owner")
            if perm & 0o077:
                raise self._refuse(f"has mode {perm:o}: other users could read or change its "
                                   "KV; a private arena is 600", "mode")
        else:
            if st.st_gid != self.gid:
                raise self._refuse(f"belongs to group {st.st_gid}, not {self.gid} "
                                   "(shm.group)", "group")
            if perm & 0o007:
                raise self._refuse(f"has mode {perm:o}: users outside the group could read or "
                                   "change its KV; a group arena is 660", "mode")
        return st

    def _open(self, timeout: float) -> int:
        for _ in range(8):
            fd, created = self._open_once()
            if fd < 0:
                continue
            try:
                st = self._check_file(fd, created)
                if not lock_within(fd, _INIT_LOCK, timeout, longest_sleep=0.01):
                    raise self._refuse(f"another process held its init lock for {timeout:g} s "
                                       "(shm.open_timeout_s)", "busy")
                try:
                    now = os.stat(self.path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)                     # removed or replaced meanwhile: again
                    continue
                self._initialise_or_check(fd)
                if not lock_within(fd, _USERS_LOCK, timeout, fcntl.F_RDLCK):
                    raise self._refuse("cannot register as a user", "busy")  # pragma: no cover
                unlock(fd, _INIT_LOCK)
                self.created = self.created or created
                return fd
            except BaseException:
                if created:
                    self._unlink_if(fd)          # ours and never used: leave nothing behind
                os.close(fd)
                raise
        raise self._refuse("the arena was replaced while opening, eight times over", "busy")

    def _unlink_if(self, fd: int) -> None:
        """Remove the path if it still names the file open as ``fd``."""
        try:
            st, now = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(self.path)
        except OSError:
            pass

    def _initialise_or_check(self, fd: int) -> None:
        """Under the init lock: initialise a new (empty, or zero-headed) file, else check its
        header against this store's identity and geometry."""
        geo = self.geo
        size = os.fstat(fd).st_size
        raw = os.pread(fd, HEADER_BYTES, 0) if size else b""
        if raw.count(0) == len(raw):
            if raw and size < HEADER_BYTES:
                size = 0
            self._initialise(fd, size)
            return
        why = check_header(raw, geo, self.fingerprint, self.namespace)
        if why:
            kind, _, detail = why.partition(": ")
            raise self._refuse(f"{detail}; refused (remove the file if no process uses it)",
                               kind)
        if size < geo.file_bytes:
            raise self._refuse(f"is {size} bytes, its header says {geo.file_bytes}: truncated; "
                               "refused (remove the file if no process uses it)", "truncated")

    def _initialise(self, fd: int, size: int) -> None:
        geo = self.geo
        try:
            if size != geo.file_bytes:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, geo.file_bytes)
            os.posix_fallocate(fd, 0, geo.file_bytes)
        except OSError as exc:
            try:
                os.ftruncate(fd, 0)                  # give the memory back; a zero header
            except OSError:
                pass
            raise self._refuse(f"cannot allocate {geo.file_bytes} bytes for the arena "
                               f"({exc.strerror}): shrink shm.capacity_bytes or free memory "
                               "in its filesystem", "no_space") from exc
        mm = mmap.mmap(fd, geo.file_bytes, mmap.MAP_SHARED)
        try:
            mm[geo.meta_off:geo.data_off] = bytes(geo.data_off - geo.meta_off)
            mm[:HEADER_BYTES] = pack_header(geo, self.fingerprint, self.namespace,
                                            os.geteuid()).ljust(HEADER_BYTES, b"\0")
        finally:
            mm.close()
        self.created = True

    def _map(self) -> None:
        geo = self.geo
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self.populate else 0)
        self.mm = mmap.mmap(self.fd, geo.file_bytes, flags)
        self._u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.data_base = int(self._u8.ctypes.data) + geo.data_off
        meta = self._u8[geo.meta_off:geo.meta_off + geo.slots * META_BYTES] \
            .view("<u8").reshape(geo.slots, META_BYTES // 8)
        # The slot table twice: a numpy view of the digests for whole-table scans (used,
        # clear), and a memoryview of 64-bit words for the per-page paths (an element is a
        # plain int there, many times cheaper than a numpy one). Slot i's words start at
        # 8 * i: generation, last-use stamp, key digest (4 words), CRC and flags, spare.
        self.dig = meta[:, 2:6]
        self.m = memoryview(self.mm)[geo.meta_off:geo.meta_off + geo.slots * META_BYTES] \
            .cast("Q")

    def _reopen_after_fork(self) -> None:
        """A forked child shares its parent's open file, hence its locks: open the file
        afresh (the same inode, through /proc) so the two never mistake each other's locks
        for their own."""
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._writing = set()
        self._pins = {}
        self._pin_lock = threading.Lock()
        old = self.fd
        if old < 0:
            return
        try:
            fd = os.open(f"/proc/self/fd/{old}", os.O_RDWR | os.O_CLOEXEC)
            try_lock(fd, _USERS_LOCK, fcntl.F_RDLCK)
        except OSError:
            fd = -1                               # every call on it now fails, counted
        self.fd = fd
        os.close(old)

    # ----- keys and sets ----------------------------------------------------------------------
    def digest(self, key: bytes) -> Digest:
        raw = hashlib.blake2b(key, digest_size=32).digest()
        w = _WORDS.unpack(raw)
        if w[0] == 0:                              # a zero first word marks an empty slot
            w = (1,) + w[1:]
        return Digest(raw, w, w[1] % self.geo.sets)

    def bounds(self, s: int) -> tuple[int, int]:
        slots, sets = self.geo.slots, self.geo.sets
        return s * slots // sets, (s + 1) * slots // sets

    def find(self, d: Digest) -> int:
        """The slot holding key ``d`` (in any state), or -1."""
        lo, hi = self.bounds(d.set)
        m, (w0, w1, w2, w3) = self.m, d.words
        for i in range(lo, hi):
            b = 8 * i
            if m[b + 2] == w0 and m[b + 3] == w1 and m[b + 4] == w2 and m[b + 5] == w3:
                return i
        return -1

    def _holds(self, i: int, d: Digest) -> bool:
        m, b, w = self.m, 8 * i, d.words
        return m[b + 2] == w[0] and m[b + 3] == w[1] and m[b + 4] == w[2] and m[b + 5] == w[3]

    def slot_addr(self, slot: int) -> int:
        return self.data_base + slot * self.geo.stride

    # ----- readers: no locks ----------------------------------------------------------------
    def get(self, d: Digest, dst: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
        """Copy key ``d``'s payload into ``dst`` ((address, length) pieces, in order):
        (HIT, slot, flags word) when the copy is of one complete generation of this key;
        MISS (absent), BUSY (being written) or TORN (changed while copied: ``dst`` holds
        unspecified bytes)."""
        i = self.find(d)
        if i < 0:
            return MISS, -1, 0
        m, b = self.m, 8 * i
        g1 = m[b]
        if g1 & 1:
            return BUSY, i, 0
        # the key is checked after the copy: a slot that changed hands between find() and
        # the generation read above holds another key now, or a newer generation
        src = self.slot_addr(i)
        for addr, n in dst:
            _memmove(addr, src, n)
            src += n
        word = m[b + 6]
        if m[b] != g1 or not self._holds(i, d):
            return TORN, i, 0
        return HIT, i, word

    def complete(self, d: Digest) -> int:
        """The slot holding key ``d``'s complete object, or -1."""
        i = self.find(d)
        if i < 0:
            return -1
        g = self.m[8 * i]
        return i if not g & 1 and self._holds(i, d) and self.m[8 * i] == g else -1

    def present(self, d: Digest) -> bool:
        return self.complete(d) >= 0

    def touch(self, slot: int, stamp: int) -> None:
        """Record a use (an LRU hint: a race here only misorders eviction)."""
        self.m[8 * slot + 1] = stamp

    # ----- writers ------------------------------------------------------------------------------
    def _lock_set(self, s: int, timeout: float) -> bool:
        stripe = self._stripes[s % _STRIPES]
        t0 = time.monotonic()
        if not stripe.acquire(timeout=timeout):
            return False
        try:
            if lock_within(self.fd, _SET_LOCKS + s, max(0.0, timeout - (time.monotonic() - t0))):
                return True
        except BaseException:
            stripe.release()
            raise
        stripe.release()
        return False

    def _unlock_set(self, s: int) -> None:
        try:
            unlock(self.fd, _SET_LOCKS + s)
        finally:
            self._stripes[s % _STRIPES].release()

    def _slot_lock(self, slot: int) -> int:
        return _SET_LOCKS + self.geo.sets + slot

    def _take(self, slot: int) -> bool:
        """Own ``slot`` for writing: no thread of this open file and no other open file is
        writing it or reading it in place (a lock free with the slot odd is a dead
        writer's)."""
        with self._pin_lock:
            if slot in self._writing or slot in self._pins:
                return False
            if not try_lock(self.fd, self._slot_lock(slot)):
                return False
            self._writing.add(slot)
            return True

    def _release(self, slot: int) -> None:
        # unlock before forgetting: another thread of this open file that sees the slot
        # free would otherwise "take" a lock this open file still holds, and lose it here
        with self._pin_lock:
            try:
                unlock(self.fd, self._slot_lock(slot))
            finally:
                self._writing.discard(slot)

    # ----- readers in place: a shared slot lock ---------------------------------------------
    def pin(self, d: Digest) -> int:
        """Hold key ``d``'s complete slot so that no writer of any process can change it
        until `unpin`: a shared OFD lock on the slot's lock byte (a writer needs it
        exclusively; the kernel drops it if this process dies). The slot, or -1 when the key
        is absent, being written, or its lock is held by a writer."""
        i = self.find(d)
        if i < 0:
            return -1
        with self._pin_lock:
            if i in self._writing:
                return -1
            n = self._pins.get(i, 0)
            if n == 0 and not try_lock(self.fd, self._slot_lock(i), fcntl.F_RDLCK):
                return -1
            self._pins[i] = n + 1
        # held now: the generation and key can no longer change; check they are this key's
        # complete object (a writer may have finished with another key before the lock)
        m, b = self.m, 8 * i
        if m[b] & 1 or not self._holds(i, d):
            self.unpin(i)
            return -1
        return i

    def unpin(self, slot: int) -> None:
        with self._pin_lock:
            n = self._pins.get(slot, 0)
            if n <= 1:
                self._pins.pop(slot, None)
                if n == 1 and self.fd >= 0:
                    unlock(self.fd, self._slot_lock(slot))
            else:
                self._pins[slot] = n - 1

    def pinned(self) -> int:
        """Slots this open file holds for in-place reads."""
        with self._pin_lock:
            return len(self._pins)

    def claim(self, d: Digest, stamp: int, timeout: float) -> tuple[int, int, int, str]:
        """Take a slot for key ``d`` and make it odd: (OK, slot, odd generation, what was
        there: "" (empty or this key), "evicted" (another key), "reclaimed" (a dead writer's
        slot)). BUSY: this key is being written elsewhere; FULL: every slot of its set is;
        TIMEOUT: the set lock was not had in time."""
        lo, hi = self.bounds(d.set)
        if not self._lock_set(d.set, timeout):
            return TIMEOUT, -1, 0, ""
        m = self.m
        try:
            same = self.find(d)
            if same >= 0:
                order = [same]                        # a key has one slot: its own
            else:
                empty, odd, used = [], [], []
                for i in range(lo, hi):
                    g = m[8 * i]
                    if g & 1:
                        odd.append(i)
                    elif m[8 * i + 2] == 0:
                        empty.append(i)
                    else:
                        used.append((m[8 * i + 1], i))
                used.sort()
                order = empty + odd + [i for _, i in used]
            for i in order:
                if not self._take(i):
                    if same >= 0:
                        return BUSY, i, 0, ""
                    continue
                b = 8 * i
                g = m[b]                              # as it is now that the slot is ours
                what = "reclaimed" if g & 1 else \
                    ("evicted" if m[b + 2] and not self._holds(i, d) else "")
                gen = g + 2 if g & 1 else g + 1
                m[b] = gen                            # odd: readers miss from here on
                m[b + 6] = 0
                m[b + 2], m[b + 3], m[b + 4], m[b + 5] = d.words
                m[b + 1] = stamp
                return OK, i, gen, what
            return FULL, -1, 0, ""
        finally:
            self._unlock_set(d.set)

    def fill(self, slot: int, src: Sequence[tuple[int, int]]) -> None:
        dst = self.slot_addr(slot)
        for addr, n in src:
            _memmove(dst, addr, n)
            dst += n

    def publish(self, slot: int, odd: int, word: int = 0) -> None:
        """The claimed slot's bytes are in place: make it readable and let it go."""
        m, b = self.m, 8 * slot
        m[b + 6] = word
        m[b] = odd + 1
        self._release(slot)

    def abandon(self, slot: int, odd: int) -> None:
        """A claimed slot whose write did not finish: empty it and let it go."""
        m, b = self.m, 8 * slot
        m[b + 2] = m[b + 3] = m[b + 4] = m[b + 5] = 0
        m[b + 6] = 0
        m[b] = odd + 1
        self._release(slot)

    def _empty(self, slot: int) -> bool:
        """Empty a slot (the caller holds its set's lock); True if it held a complete
        object. A slot being written by a live writer is left alone (False)."""
        if not self._take(slot):
            return False
        m, b = self.m, 8 * slot
        g = m[b]
        had = not g & 1 and bool(m[b + 2])
        odd = g + 2 if g & 1 else g + 1
        m[b] = odd
        self.abandon(slot, odd)
        return had

    def remove(self, d: Digest, timeout: float) -> bool | None:
        """Delete key ``d``; True if a complete object went, None on a lock timeout."""
        if not self._lock_set(d.set, timeout):
            return None
        try:
            i = self.find(d)
            return i >= 0 and self._empty(i)
        finally:
            self._unlock_set(d.set)

    def clear(self, timeout: float) -> tuple[int, int]:
        """Empty every slot not being written: (objects removed, sets skipped on a lock
        timeout)."""
        geo = self.geo
        lows = np.arange(geo.sets + 1, dtype=np.int64) * geo.slots // geo.sets
        held = np.flatnonzero(self.dig[:, 0])
        removed = skipped = 0
        for s in np.unique(np.searchsorted(lows, held, side="right") - 1).tolist():
            if not self._lock_set(s, timeout):
                skipped += 1
                continue
            try:
                lo, hi = self.bounds(s)
                for j in np.flatnonzero(self.dig[lo:hi, 0]).tolist():
                    removed += self._empty(lo + j)
            finally:
                self._unlock_set(s)
        return removed, skipped

    def used(self) -> int:
        """Slots holding a key (complete or being written), across every process."""
        return int(np.count_nonzero(self.dig[:, 0]))

    # ----- closing --------------------------------------------------------------------------------
    def close(self, remove_if_unused: bool = False) -> bool:
        """Unmap and close; with ``remove_if_unused``, also remove the file when no other
        process has it open. True if it was removed."""
        _arenas.discard(self)
        removed = False
        fd, self.fd = self.fd, -1
        m = getattr(self, "m", None)
        if m is not None:
            m.release()
        for name in ("dig", "_u8", "m"):
            setattr(self, name, None)
        mm = getattr(self, "mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:                    # pragma: no cover (a view escaped)
                pass
        if fd < 0:
            return False
        try:
            # the init lock first, as openers take it: one that opened the file but is not
            # yet a user waits, then finds the path gone and creates a new arena. Waited
            # for, so that two last users closing at once do not both give up.
            if remove_if_unused and lock_within(fd, _INIT_LOCK, 1.0) and \
                    try_lock(fd, _USERS_LOCK, fcntl.F_WRLCK):
                self._unlink_if(fd)
                removed = not os.path.lexists(self.path) or \
                    os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino
        except OSError:
            pass
        finally:
            # closing the fd drops its locks only if nothing else holds the open file: a view
            # of the mapping that escaped does, and would keep the init lock taken above (no
            # one could open or remove the arena) and the users lock (no one could remove it)
            try:
                unlock_all(fd)
            except OSError:
                pass
            os.close(fd)
        return removed
