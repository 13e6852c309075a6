"""The `file` store's safe file helpers now live in ``kvtier.l3_stores.file._files``; this
module keeps the old import path."""

from .file._files import PID_LIMIT, host_id, medium, pid_alive, writer_alive

__all__ = ["PID_LIMIT", "host_id", "medium", "pid_alive", "writer_alive"]
