"""The `file` store's ``objects`` format: one file per page -- its index of the directory,
LRU eviction and the I/O of one object.

Layout of the ``objects`` format:
``<root>/<KVSpec fingerprint>[.ns-<namespace>]/<xx>/<hex of key>.kvp`` (``xx`` = 256-way
fan-out from a CRC of the key; keys longer than 96 bytes are named by their SHA-256 instead).
File names are hex digits only, so no key can name a path outside the directory.
``manifest.json`` in the store directory records its identity (object format version, KVSpec
fingerprint and geometry, key namespace).

Writes are atomic: a temporary file in the object's directory (``fsync`` if configured), then
``rename`` over the final name, so a reader sees the old object, the new one or none -- never a
torn one, even if the writer is killed. Failed writes (a full disk, a quota) remove the
temporary file and are a miss plus a counted error. Temporary files of dead writers are cleaned
when a store opens the directory (a name whose pid no process can have is a dead writer's:
``kvtier.l3_stores._files``). A damaged manifest (not JSON, not an object, nested deeper than
the parser goes) is rewritten.

Capacity is enforced by evicting the least recently used objects; "use" is the file's mtime,
refreshed on every read hit, so several processes sharing one directory share one LRU order.
Each process keeps an in-memory index (built by scanning the directory at open, and again in
the background every ``rescan_interval_s`` while writing) and re-checks a victim's mtime before
deleting it. A page whose read fails after it started (corrupted object) holds unspecified
bytes; a plain miss leaves the page untouched.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Sequence

from . import _files
from ._files import _NOFOLLOW, _OPEN_FLAGS
from .core import _warn_once, log
from .directory import _StoreDirectory
from .format import (_OBJECT_RE, _TMP_RE, DIRECT_ALIGN, TMP_SUFFIX, TRAILER_BYTES, _Bad,
                     _checksum, key_filename, pack_trailer, parse_trailer, running_checksums)
from .ranged import Marks, check_group, read_group

_PAD_ZEROS = bytes(DIRECT_ALIGN - TRAILER_BYTES)
_TOUCH_NS = 1_000_000_000


class _ObjectFormat(_StoreDirectory):
    """The ``objects`` format's index, eviction and object I/O (a part of ``FileStore``)."""

    # ----- paths and the index ---------------------------------------------------------------
    def _rel(self, key: bytes) -> str:
        sub, name = key_filename(key)
        return f"{sub}/{name}"

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, self._rel(key))

    def _scan(self) -> None:
        """Rebuild the index from the directory (LRU order = mtime); clean dead tmp files.

        Objects this process noted while the scan ran are kept with their newer times."""
        started = time.time_ns()
        found: dict[str, tuple[int, int]] = {}
        now = time.time()
        for base in self._subdirs():
            sfd = self._sub_fd(base)
            if sfd < 0:
                continue
            try:
                for e in self._entries(sfd):
                    try:
                        st = os.stat(e.name, dir_fd=sfd, follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if _OBJECT_RE.match(e.name):
                        if st.st_size in self._sizes:
                            found[f"{base}/{e.name}"] = (st.st_mtime_ns, st.st_size)
                    elif _TMP_RE.match(e.name) and not self.read_only and \
                            self._tmp_is_stale(e.name, st, now):
                        if self._unlink_own(sfd, e.name, missing_ok=False):
                            self._bump("tmp_cleaned")
            finally:
                os.close(sfd)
        with self._lock:
            for rel, (mt, size) in self._index.items():
                if mt >= started and mt > found.get(rel, (-1, 0))[0]:
                    found[rel] = (mt, size)
            self._index = OrderedDict(sorted(found.items(), key=lambda kv: kv[1][0]))
            self._bytes = sum(size for _, size in self._index.values())
            self._last_scan = time.monotonic()


    def _maybe_rescan(self) -> None:
        """With a capacity, rescan in the background every ``rescan_interval_s``: other
        processes' objects count against the shared capacity too."""
        if self.config.capacity_bytes is None:
            return
        with self._lock:
            if self._scanning or \
                    time.monotonic() - self._last_scan < self.config.rescan_interval_s:
                return
            self._scanning = True
            self._users += 1                  # released by the scan thread
        threading.Thread(target=self._background_scan, name="kvtier-file-scan",
                         daemon=True).start()

    def _background_scan(self) -> None:
        try:
            if not self._closed:
                self._scan()
                self._make_room(0, keep=set())
        except Exception as exc:    # surfaced in stats and the log, never lost
            self._count(errors=1)
            self._bump("scan_errors")
            log.warning("file: rescanning %s failed: %s", self.dir, exc)
        finally:
            with self._lock:
                self._scanning = False
            self._leave()

    def _tmp_is_stale(self, name: str, st: os.stat_result, now: float) -> bool:
        if now - st.st_mtime > self.config.stale_tmp_s:
            return True
        parts = name.split(".")        # .<object>.<host>-<pid>.<rand>.tmp
        if len(parts) >= 4:
            host, _, pid = parts[-3].partition("-")
            if host == self._host and pid.isdigit():
                return not _files.pid_alive(pid)
        return False

    def _make_room(self, need: int, keep: set[str]) -> None:
        """Evict least recently used objects until ``need`` more bytes fit in capacity."""
        cap = self.config.capacity_bytes
        if cap is None or self.read_only:
            return
        with self._lock:
            kept = sum(self._index[k][1] for k in keep if k in self._index)  # overwritten
            budget = 2 * len(self._index) + 1              # every victim seen at most twice
        evicted = 0
        for _ in range(budget):
            with self._lock:
                if self._bytes - kept + need <= cap:
                    break
                victim = next((k for k in self._index if k not in keep), None)
                if victim is None:
                    break
                recorded, vsize = self._index.pop(victim)
                self._bytes -= vsize
            sub, name = victim.split("/")
            sfd = self._sub_fd(sub)
            if sfd < 0:
                continue
            try:
                try:
                    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                except OSError:
                    continue                          # another process removed it
                if not stat.S_ISREG(st.st_mode):
                    continue                          # replaced by a foreign entry: not ours
                if st.st_mtime_ns > recorded:         # read by another process since: keep it
                    self._note(victim, st.st_mtime_ns, st.st_size)
                    continue
                try:
                    os.unlink(name, dir_fd=sfd)
                    evicted += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self._count(errors=1)
                    log.debug("file: evicting %s failed: %s", victim, exc)
            finally:
                os.close(sfd)
        if evicted:
            self._count(evictions=evicted)

    def _note(self, rel: str, mtime_ns: int, size: int) -> None:
        """Record an object as the most recently used."""
        with self._lock:
            old = self._index.pop(rel, None)
            if old is not None:
                self._bytes -= old[1]
            self._index[rel] = (mtime_ns, size)
            self._bytes += size

    def _order(self, keys: Sequence[bytes], ok: list[bool]) -> None:
        """Within a batch, earlier keys count as more recently used than later ones: a chain
        of page keys is only useful up to its first missing page, so its tail goes first."""
        with self._lock:
            for key, good in zip(reversed(keys), reversed(ok)):
                rel = self._rel(key)
                if good and rel in self._index:
                    self._index.move_to_end(rel)

    def _forget(self, rel: str) -> None:
        with self._lock:
            old = self._index.pop(rel, None)
            if old is not None:
                self._bytes -= old[1]

    # ----- one object -------------------------------------------------------------------------
    def _trailer_block(self) -> memoryview:
        """A per-thread page-aligned scratch block (O_DIRECT needs aligned buffers)."""
        blk = getattr(self._local, "block", None)
        if blk is None:
            blk = self._local.block = mmap.mmap(-1, DIRECT_ALIGN)
        return memoryview(blk)

    def _object_dir(self, key: bytes) -> tuple[int, str, str]:
        """(its fan-out directory's descriptor, file name, relative path) of a key's object;
        the descriptor is -1 (the object forgotten) when the directory cannot be opened."""
        sub, name = key_filename(key)
        rel = f"{sub}/{name}"
        sfd = self._sub_fd(sub)
        if sfd < 0:
            self._forget(rel)
        return sfd, name, rel

    def _get_one(self, item: tuple[bytes, int]) -> bool:
        key, page = item
        sfd, name, rel = self._object_dir(key)
        if sfd < 0:
            return False
        try:
            return self._read_object(sfd, name, rel, key, page)
        finally:
            os.close(sfd)

    def _open_object(self, sfd: int, name: str, rel: str, direct: bool) -> int:
        """The object's descriptor, or -1: missing, or not a regular file (counted)."""
        path = os.path.join(self.dir, rel)
        try:
            return os.open(name, os.O_RDONLY | _OPEN_FLAGS | (os.O_DIRECT if direct else 0),
                           dir_fd=sfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            try:
                lst = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            except OSError:
                lst = None
            if exc.errno == errno.ELOOP or (lst is not None and not stat.S_ISREG(lst.st_mode)):
                # a link, socket or device planted at the object's path: never followed
                self._count(errors=1, corrupted=1)
                self._bump("not_regular")
                _warn_once("bad:not_regular", f"file: {path} is not a regular file; never "
                           "followed, a miss (further ones are only counted in stats)")
            else:
                self._io_error("read", path, exc)
        self._forget(rel)
        return -1

    def _stat_object(self, fd: int) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Bad("not_regular", f"not a regular file (mode {st.st_mode:o})")
        if st.st_size not in self._sizes:
            raise _Bad("truncated" if st.st_size < self.object_bytes else "corrupted",
                       f"{st.st_size} bytes, objects have {self.object_bytes}")
        return st

    def _untrusted(self, bad: _Bad, sfd: int, name: str, rel: str,
                   st: os.stat_result | None) -> None:
        self._count(errors=1, corrupted=1)
        self._bump(bad.kind)
        _warn_once(f"bad:{bad.kind}", f"file: untrusted object {os.path.join(self.dir, rel)} "
                   f"({bad}); treated as a miss (further ones are only counted in stats)")
        if bad.kind != "not_regular" and not bad.keep:     # not ours to remove: kept
            self._remove_bad(sfd, name, st)
        self._forget(rel)

    def _used(self, fd: int, rel: str, st: os.stat_result) -> None:
        """A read hit: refresh the object's mtime (the shared LRU order) and note it."""
        if self.config.touch_on_read and not self.read_only and \
                time.time_ns() - st.st_mtime_ns > _TOUCH_NS:
            try:
                os.utime(fd)
            except OSError:
                pass
        self._note(rel, time.time_ns(), st.st_size)

    def _read_object(self, sfd: int, name: str, rel: str, key: bytes, page: int) -> bool:
        path = os.path.join(self.dir, rel)
        direct = self._direct and self._direct_pool
        st = None
        fd = self._open_object(sfd, name, rel, direct)
        if fd < 0:
            return False
        try:
            st = self._stat_object(fd)
            # Payload and trailer in one preadv: the payload lands in the page (no copy), the
            # trailer in a scratch block; nothing counts as read until both check out.
            plen = self.spec.page_bytes
            views = self._views(page)
            blk = self._trailer_block()
            if direct:      # one call: a retry at an unaligned offset would be refused
                n = os.preadv(fd, views + [blk], 0)
            else:
                n = _files._pread_all(fd, views + [blk[:TRAILER_BYTES]], 0)
            if n != (min(st.st_size, plen + DIRECT_ALIGN) if direct else self.object_bytes):
                raise _Bad("truncated", f"read {n} of {st.st_size} bytes")
            t = parse_trailer(bytes(blk[:TRAILER_BYTES]), self.spec.fingerprint, key, plen,
                              self._identities, v3_groups=self._v3_groups)
            if _checksum(t.kind_id, views) != t.payload_sum:
                raise _Bad("corrupted", "payload checksum mismatch")
            self._used(fd, rel, st)
            return True
        except _Bad as bad:
            self._untrusted(bad, sfd, name, rel, st)
            return False
        except OSError as exc:
            self._io_error("read", path, exc)
            return False
        finally:
            os.close(fd)

    def _get_group_one(self, item: tuple[bytes, int], span: tuple[int, int], a: int, b: int,
                       last: bool) -> Marks | None:
        """Ranged read of layer groups ``span[0]`` through ``span[1]`` (payload bytes
        ``[a, b)``) of one object (``kvtier.l3_stores.file.ranged``): its marks, or None for
        a miss. A hit of the last group refreshes the object's LRU position as a whole-page
        hit does."""
        key, page = item
        sfd, name, rel = self._object_dir(key)
        if sfd < 0:
            return None
        try:
            direct = self._direct and self._direct_pool
            fd = self._open_object(sfd, name, rel, direct)
            if fd < 0:
                return None
            st = None
            try:
                st = self._stat_object(fd)
                plen = self.spec.page_bytes

                def parse(raw: bytes):
                    return parse_trailer(raw, self.spec.fingerprint, key, plen,
                                         self._identities, v3_groups=self._v3_groups)
                dst, raw = read_group(fd, 0, plen, self._views(page), a, b, direct)
                marks = check_group(fd, 0, plen, parse(raw), span, dst, a, b, direct, parse,
                                    len(self._groups))
                if last:
                    self._used(fd, rel, st)
                return marks
            except _Bad as bad:
                self._untrusted(bad, sfd, name, rel, st)
                return None
            except OSError as exc:
                self._io_error("read", os.path.join(self.dir, rel), exc)
                return None
            finally:
                os.close(fd)
        finally:
            os.close(sfd)

    def _set_one(self, item: tuple[bytes, int]) -> bool:
        key, page = item
        sub, name = key_filename(key)
        sfd = self._sub_fd(sub, create=True)
        if sfd < 0:
            return False
        try:
            return self._write_object(sfd, sub, name, key, page)
        finally:
            os.close(sfd)

    def _write_object(self, sfd: int, sub: str, name: str, key: bytes, page: int) -> bool:
        rel = f"{sub}/{name}"
        final = os.path.join(self.dir, rel)
        tmp = f".{name}.{self._host}-{os.getpid()}.{threading.get_ident():x}{TMP_SUFFIX}"
        direct = self._direct and self._direct_pool
        views = self._views(page)
        plen = self.spec.page_bytes
        sums = running_checksums(self._kind_id, views, self._group_ends)
        trailer = pack_trailer(self.spec.fingerprint, key, plen, self._kind_id, sums[-1],
                               self._identity, sums)
        # a new name (O_EXCL) cannot be a FIFO or a link: no O_NONBLOCK needed
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW
        fd = -1
        mode = self.config.file_mode
        try:
            oflags = flags | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(tmp, oflags, mode, dir_fd=sfd)
            except FileExistsError:       # left by an earlier thread of this process's id
                os.unlink(tmp, dir_fd=sfd)
                fd = os.open(tmp, oflags, mode, dir_fd=sfd)
            if self._fix_mode:
                os.fchmod(fd, mode)
            size = self.object_bytes
            if direct:
                blk = self._trailer_block()
                blk[:TRAILER_BYTES] = trailer
                blk[TRAILER_BYTES:] = _PAD_ZEROS
                try:
                    _files._pwrite_all(fd, views + [blk])
                    size = self.padded_bytes
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # O_DIRECT refused (e.g. a file size limit cut the write unaligned):
                    # write this object through the page cache, which reports the real error.
                    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
                    fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_DIRECT)
                    self._bump("direct_fallbacks")
                    _files._pwrite_all(fd, views + [memoryview(trailer)])
                    os.ftruncate(fd, self.object_bytes)
            else:
                _files._pwrite_all(fd, views + [memoryview(trailer)])
            if self._sync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
            if self._sync:
                os.fsync(sfd)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=sfd)
            except OSError:
                pass
            self._io_error("write", final, exc)
            return False
        self._note(rel, time.time_ns(), size)
        return True

    def _remove_bad(self, sfd: int, name: str, st: os.stat_result | None) -> None:
        """Remove an untrusted object unless another process replaced it meanwhile (or it is
        not a regular file: not the store's to delete)."""
        if not self.config.remove_corrupted or self.read_only:
            return
        try:
            now = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if stat.S_ISREG(now.st_mode) and \
                    (st is None or (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)):
                os.unlink(name, dir_fd=sfd)
        except OSError:
            pass
