"""The `file` store's directories: the root and the store directory (modes checked), the
manifest, read-only detection, the O_DIRECT probes, and the fan-out directories and their
listings.

Nothing outside the root is ever read, written or deleted: below the root every entry is
opened relative to a directory descriptor with ``O_NOFOLLOW`` (directories also
``O_DIRECTORY``), so a symlinked store directory is refused (``StoreError.reason``) and a
symlinked fan-out directory is a foreign entry whose keys miss. Opens never wait
(``O_NONBLOCK``): a FIFO, socket, device or directory at an object's path is a counted
corruption and a miss. ``clear()``, eviction and ``delete()`` unlink only regular files named
like the store's objects or temporary files, and count what else they find. Directories are
created 0700 and objects 0600 (``file_mode``) whatever the umask; a root or store directory
other users can write to (group/world-writable without the sticky bit), or a store directory
of another user, is refused unless ``allow_shared_root`` is set.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import reprlib
import stat

from ...errors import ConfigError, StoreError
from ._files import _DIR_FLAGS, _NOFOLLOW, _OPEN_FLAGS
from .core import _FileStoreCore, _warn_once, log
from .format import (_FANOUT_RE, _MANIFEST_MAX, DIRECT_ALIGN, MANIFEST, OLDER_VERSIONS, SUFFIX,
                     TMP_SUFFIX, TRAILER_BYTES)

#: A directory the store cannot write (a read-only mount, no permission): read-only.
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class _StoreDirectory(_FileStoreCore):
    """The store directory and everything opened below it (a part of ``FileStore``)."""

    # ----- the root, the store directory, the manifest --------------------------------------
    def _refuse(self, message: str, reason: str) -> StoreError:
        err = StoreError(f"file: {message}", backend=self.name)
        err.reason = reason          # type: ignore[attr-defined]
        return err

    def _check_dir(self, fd: int, path: str, created: bool, what: str) -> None:
        """A directory of the store must be ours and writable by no one else (unless the user
        opted in); one this store created gets its modes set explicitly."""
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):                      # pragma: no cover (O_DIRECTORY)
            raise self._refuse(f"{path} is not a directory", "not_a_directory")
        if created:
            os.fchmod(fd, self._dir_mode)
            return
        if self.config.allow_shared_root:
            return
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & 0o022 and not (what == "root" and sticky):
            who = "everyone" if st.st_mode & 0o002 else "its group"
            raise ConfigError(f"file: {what} {path} is writable by {who} (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): another user could plant or "
                              "swap objects; use a private directory, or set "
                              "file.allow_shared_root=True to share it deliberately",
                              key="file.allow_shared_root", value=path)
        if what != "root" and st.st_uid != os.geteuid():
            raise ConfigError(f"file: {what} {path} belongs to uid {st.st_uid}, not to this "
                              "process; set file.allow_shared_root=True to share it",
                              key="file.allow_shared_root", value=path)

    def _open_root(self) -> int:
        """Open (creating with explicit modes) the root; the user named it, so links on the
        way to it are followed -- nothing below it ever is."""
        missing = []
        path = self.root
        while not os.path.isdir(path):
            if os.path.lexists(path) and not os.path.islink(path):
                raise StoreError(f"file: cannot create store root {self.root}: {path} is not "
                                 "a directory", backend=self.name)
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for path in reversed(missing):
            try:
                os.mkdir(path, self._dir_mode)
            except FileExistsError:
                continue
            except OSError as exc:
                raise StoreError(f"file: cannot create store root {self.root}: {exc}",
                                 backend=self.name) from exc
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW)
            try:
                os.fchmod(fd, self._dir_mode)
            finally:
                os.close(fd)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"file: cannot open store root {self.root}: {exc}",
                             backend=self.name) from exc
        try:
            self._check_dir(fd, self.root, self.root in missing, "root")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_store_dir(self, name: str) -> int:
        rfd = self._open_root()
        try:
            created = False
            refused: OSError | None = None
            try:
                os.mkdir(name, self._dir_mode, dir_fd=rfd)
                created = True
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in _READ_ONLY_ERRNOS:
                    raise StoreError(f"file: cannot create store directory {self.dir}: "
                                     f"{exc}", backend=self.name) from exc
                refused = exc          # a read-only root: an existing directory still serves
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=rfd)
            except FileNotFoundError as exc:
                raise StoreError(f"file: cannot create store directory {self.dir}: "
                                 f"{refused or exc}", backend=self.name) from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symlink" if os.path.islink(self.dir) else "not a directory"
                    raise self._refuse(
                        f"store directory {self.dir} is {kind}; refusing to follow it (a "
                        "store never reads, writes or deletes outside its root)",
                        "symlinked_directory" if kind == "a symlink" else "not_a_directory"
                    ) from exc
                raise StoreError(f"file: cannot open store directory {self.dir}: {exc}",
                                 backend=self.name) from exc
            try:
                self._check_dir(fd, self.dir, created, "store directory")
            except BaseException:
                os.close(fd)
                raise
            return fd
        finally:
            os.close(rfd)

    def _read_manifest(self) -> dict | None:
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | _OPEN_FLAGS, dir_fd=self._dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return {"unreadable": str(exc)}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MANIFEST_MAX:
                return {"unreadable": "not a small regular file"}
            raw = os.pread(fd, _MANIFEST_MAX, 0)
        finally:
            os.close(fd)
        try:
            rec = json.loads(raw)
            return rec if isinstance(rec, dict) else {"unreadable": "not a JSON object"}
        except ValueError:
            return {"unreadable": "not JSON"}
        except RecursionError:        # nested deeper than the parser goes: damaged too
            return {"unreadable": "nested too deeply"}

    def _write_manifest(self) -> None:
        rec = {"kvtier_file_store": True, "identity": self.identity,
               "identity_digest": self._identity.hex(), "spec": self.spec.to_dict(),
               "object": {"payload_bytes": self.spec.page_bytes,
                          "trailer_bytes": TRAILER_BYTES, "suffix": SUFFIX}}
        blob = (json.dumps(rec, indent=1, sort_keys=True) + "\n").encode()
        tmp = f".{MANIFEST}.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS,
                     self.config.file_mode, dir_fd=self._dfd)
        try:
            if self._fix_mode:
                os.fchmod(fd, self.config.file_mode)
            os.write(fd, blob)
            if self._sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, MANIFEST, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except OSError:
            os.unlink(tmp, dir_fd=self._dfd)
            raise

    def _check_manifest(self) -> str:
        """The directory's manifest names the identity of its objects; write ours if there is
        none (or it is unreadable). Another identity's manifest is kept and reported: its
        objects (and any of ours of another identity) are misses through their trailers."""
        rec = self._read_manifest()
        if rec is not None and "unreadable" not in rec:
            ident = rec.get("identity")
            if ident == self.identity:
                return "ok"
            if isinstance(ident, dict) and ident.get("format") in OLDER_VERSIONS \
                    and {**ident, "format": self.identity["format"]} == self.identity:
                # an older object format of this store: its objects stay readable; from
                # now on the directory holds objects of ours too, which the manifest says
                if self.read_only:
                    return f"format {ident['format']} (read-only)"
                try:
                    self._write_manifest()
                except OSError as exc:
                    log.warning("file: cannot write the manifest of %s: %s", self.dir, exc)
                    return f"format {ident['format']}; not rewritten: {exc.strerror}"
                return f"upgraded from format {ident['format']}"
            _warn_once("manifest", f"file: {self.dir} holds objects of another identity "
                       f"({reprlib.repr(rec.get('identity'))}, this store is "
                       f"{self.identity!r}); they "
                       "are misses")
            return "other identity"
        if self.read_only:
            return "missing (read-only)" if rec is None else "damaged (read-only)"
        try:
            self._write_manifest()
        except OSError as exc:
            log.warning("file: cannot write the manifest of %s: %s", self.dir, exc)
            return f"not written: {exc.strerror}"
        return "ok" if rec is None else "rewritten"

    def _probe_writable(self) -> str:
        """Why this store cannot write its directory ("" if it can): a read-only mount, or
        creating a file there refused (EROFS, EACCES, EPERM). Other failures (a full disk)
        are not read-only: writes then fail and are counted, and may succeed later."""
        try:
            if os.fstatvfs(self._dfd).f_flag & getattr(os, "ST_RDONLY", 0):
                return f"{self.dir} is on a read-only filesystem"
        except OSError:
            pass
        name = f".write-probe.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600,
                         dir_fd=self._dfd)
        except OSError as exc:
            if exc.errno in _READ_ONLY_ERRNOS:
                return f"cannot write {self.dir} ({exc.strerror}): read-only"
            return ""
        os.close(fd)
        try:
            os.unlink(name, dir_fd=self._dfd)
        except OSError:
            pass
        return ""


    def _probe_direct_read(self) -> tuple[bool, str]:
        """O_DIRECT for a read-only store: an aligned read of the manifest, if any."""
        if not hasattr(os, "O_DIRECT"):
            return False, "this platform has no O_DIRECT"
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | os.O_DIRECT | _OPEN_FLAGS, dir_fd=self._dfd)
        except OSError as exc:
            return False, f"no O_DIRECT read of {MANIFEST} to try ({exc.strerror})"
        blk = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            os.preadv(fd, [memoryview(blk)], 0)
        except OSError as exc:
            return False, f"O_DIRECT read refused: {exc.strerror}"
        finally:
            os.close(fd)
            blk.close()
        return True, "available"

    def _probe_direct(self) -> tuple[bool, str]:
        """Can this directory's filesystem do O_DIRECT I/O? (ok, reason)."""
        if not hasattr(os, "O_DIRECT"):
            return False, "this platform has no O_DIRECT"
        path = f".odirect-probe.{self._host}-{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        blk = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT,
                         0o600, dir_fd=self._dfd)
        except OSError as exc:
            return False, f"open with O_DIRECT refused: {exc.strerror}"
        try:
            blk[:16] = b"kvtier-o-direct!"
            if os.pwritev(fd, [memoryview(blk)], 0) != DIRECT_ALIGN:
                return False, "short O_DIRECT write"
            blk[:16] = bytes(16)
            if os.preadv(fd, [memoryview(blk)], 0) != DIRECT_ALIGN \
                    or blk[:16] != b"kvtier-o-direct!":
                return False, "O_DIRECT read back wrong data"
        except OSError as exc:
            return False, f"O_DIRECT I/O refused: {exc.strerror}"
        finally:
            os.close(fd)
            try:
                os.unlink(path, dir_fd=self._dfd)
            except OSError:
                pass
            blk.close()
        return True, "available"

    # ----- fan-out directories ---------------------------------------------------------------
    def _sub_fd(self, sub: str, create: bool = False, count: bool = True) -> int:
        """A descriptor of fan-out directory ``sub`` (opened below the store directory's
        descriptor, never through a link), or -1: missing, a foreign entry, or (``create``)
        a directory that cannot be made (counted unless not ``count``; the error is kept in
        ``_dir_error``)."""
        try:
            return os.open(sub, _DIR_FLAGS, dir_fd=self._dfd)
        except FileNotFoundError:
            if not create:
                return -1
        except OSError as exc:
            self._foreign_dir(sub, exc)
            return -1
        try:
            os.mkdir(sub, self._dir_mode, dir_fd=self._dfd)
            made = True
        except FileExistsError:
            made = False
        except OSError as exc:     # no inodes left, a read-only mount: a counted failed write
            self._dir_error = exc
            if count:
                self._io_error("write", os.path.join(self.dir, sub), exc)
            return -1
        try:
            fd = os.open(sub, _DIR_FLAGS, dir_fd=self._dfd)
        except OSError as exc:
            self._foreign_dir(sub, exc)
            return -1
        if made:
            os.fchmod(fd, self._dir_mode)
        return fd

    def _foreign_dir(self, sub: str, exc: OSError) -> None:
        self._count(errors=1)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            self._bump("foreign_entries")
            _warn_once(f"foreign-dir:{sub}", f"file: {os.path.join(self.dir, sub)} is not a "
                       "directory of this store (a link or another file); never followed, its "
                       "keys are misses")
        else:
            self._bump("io_errors")
            _warn_once(f"dir:{exc.errno}", f"file: opening {os.path.join(self.dir, sub)} "
                       f"failed: {exc}")

    def _unlink_own(self, sfd: int, name: str, missing_ok: bool = True) -> bool:
        """Unlink ``name`` in a fan-out directory only if it is a regular file (objects and
        temporary files are; a link, FIFO or directory of the same name is left alone)."""
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.unlink(name, dir_fd=sfd)
            return True
        except FileNotFoundError:
            return missing_ok
        except OSError:
            return False

    def _subdirs(self, all_entries: bool = False) -> list:
        """Fan-out directory names (with ``all_entries``: (name, is a real directory) of every
        two-hex-digit entry, so foreign ones can be counted)."""
        try:
            found = [(e.name, e.is_dir(follow_symlinks=False)) for e in self._listdir(self._dfd)
                     if _FANOUT_RE.match(e.name)]
        except OSError:
            return []
        return found if all_entries else [name for name, ok in found if ok]

    def _listdir(self, dfd: int) -> list[os.DirEntry]:
        """The entries of the open directory ``dfd`` (OSError as raised). Listings of the
        store's directories take turns: ``os.scandir`` of a descriptor reads through a
        duplicate that shares the descriptor's offset, so two threads listing one directory
        at once each get part of it (and would take the rest for gone)."""
        with self._list_lock, os.scandir(dfd) as it:
            return list(it)

    def _entries(self, sfd: int) -> list[os.DirEntry]:
        try:
            return self._listdir(sfd)
        except OSError:
            return []
