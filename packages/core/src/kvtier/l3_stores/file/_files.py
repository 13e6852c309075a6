"""Safe file helpers of the `file` store: opening entries without following links or blocking,
whole-buffer vectored I/O, the umask, what a directory lives on, and who wrote a file.

Who wrote a file of the `file` store, and whether that writer may still be writing:
Both formats name what a process is writing (temporary objects, segments, index logs) after
its host and pid, so that a store opening the directory can tell a dead writer's leftovers
(garbage, removed) from a live writer's files (never touched). Every such check goes through
``pid_alive`` here: a name is data anyone can plant, so a pid no process can have (0, or beyond
what the kernel hands out) must not reach ``os.kill`` -- ``os.kill(2**31, 0)`` raises
``OverflowError`` and ``os.kill(0, 0)`` signals our own process group -- but count as a writer
that cannot exist: dead, its files garbage.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import os
import socket

from .format import DIRECT_ALIGN

_IOV_MAX = 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Opening any entry: never follow a link, never wait (a FIFO opens at once, fstat tells).
_OPEN_FLAGS = os.O_CLOEXEC | _NOFOLLOW | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS

#: The largest pid any kernel hands out (pid_t is a signed 32-bit integer; Linux's
#: ``pid_max`` is at most 2**22).
PID_LIMIT = 2**31 - 1


def host_id() -> str:
    """This host, as it appears in the names of the files its processes write."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def pid_alive(pid: int | str) -> bool:
    """Whether process ``pid`` of this host may be alive. A pid that no process can have is
    dead; where the answer is unknown (another error) the process may be alive, so that its
    files are kept."""
    if isinstance(pid, str):
        if not pid.isdigit():
            return False
        pid = int(pid)
    if not 0 < pid <= PID_LIMIT:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True       # another user's process (or the kernel would not say): alive
    return True


def writer_alive(host: str, pid: int | str, my_host: str) -> bool | None:
    """True/False for a writer of this host (``pid_alive``); None for another host's writer,
    whose liveness cannot be known from here."""
    if host != my_host:
        return None
    return pid_alive(pid)


#: statfs f_type of filesystems whose files live in memory: tmpfs, ramfs.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
_libc: ctypes.CDLL | None = None


def medium(fd: int) -> str:
    """What the directory (descriptor) ``fd`` lives on: "memory" (tmpfs, ramfs: sync calls
    do nothing, and writes to one file are serialised by its inode lock), "disk", or
    "unknown" (statfs could not say)."""
    global _libc
    if fd < 0 or not hasattr(os, "sched_getaffinity"):      # not Linux
        return "unknown"
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)      # struct statfs: f_type comes first
        if _libc.fstatfs(fd, buf) != 0:
            return "unknown"
    except (OSError, AttributeError):
        return "unknown"
    f_type = int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], "little") & 0xFFFFFFFF
    return "memory" if f_type in _MEMORY_FS else "disk"


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int = 0) -> None:
    """pwritev every byte of ``bufs`` (retrying short writes).

    A short write on an O_DIRECT descriptor (a resource limit was hit part way) would leave
    the rest unaligned, so the descriptor drops O_DIRECT first: the retry then either
    finishes or fails with the real reason (ENOSPC, EFBIG), not EINVAL."""
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        bufs = _skip(bufs, n)
        if bufs and offset % DIRECT_ALIGN:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & getattr(os, "O_DIRECT", 0):
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def _pread_all(fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """preadv into ``bufs`` until full or end of file; returns bytes read (an O_DIRECT read
    that reached an end of file not on a block boundary ends there)."""
    total = 0
    while bufs:
        try:
            n = os.preadv(fd, bufs[:_IOV_MAX], offset)
        except OSError as exc:
            if total and exc.errno == errno.EINVAL:
                return total     # O_DIRECT, stopped at an unaligned end of file
            raise
        if n <= 0:
            return total
        total += n
        offset += n
        bufs = _skip(bufs, n)
    return total


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` less their first ``n`` bytes (what a short pwritev/preadv already moved)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    return [bufs[0][n:]] + bufs[1:] if n else bufs


def _current_umask() -> int:
    """This process's umask, read without changing it (os.umask would race other threads);
    where it cannot be read, assume the strictest so modes are always set explicitly."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777
