"""Logging helpers shared by backends."""

from __future__ import annotations

import logging
import threading
from typing import Hashable

_warned: set[tuple[str, Hashable]] = set()
_lock = threading.Lock()


def warn_once(log: logging.Logger, what: Hashable, message: str, *args: object) -> None:
    """Log ``message`` at WARNING the first time ``what`` happens for ``log`` in this process
    (a demotion or a failing path is reported once, not on every call, and never hidden)."""
    with _lock:
        if (log.name, what) in _warned:
            return
        _warned.add((log.name, what))
    log.warning(message, *args)
