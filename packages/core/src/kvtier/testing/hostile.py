"""Helpers for tests of hostile inputs: a FIFO where a file should be, a call that must not
block on it, ``kvtier`` in a process of its own with a time limit, a one-line error.

Every helper fails the test (``pytest.fail``) instead of hanging: a blocked call runs in a
thread, a command in a subprocess, each bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

__all__ = ["LIMIT_S", "fifo", "bounded", "run_kvtier", "one_line"]

#: How long a call or a command may take before the test fails (seconds; commands get 3x).
LIMIT_S = 10.0

_MAIN = "import sys; from kvtier.cli import main; sys.exit(main())"


def fifo(tmp_path: Path, name: str = "fifo") -> Path:
    """A FIFO at ``tmp_path / name`` (skips where the platform has none)."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    p = tmp_path / name
    os.mkfifo(p)
    return p


def bounded(fn: Callable[[], Any], fifo: Path, limit_s: float = LIMIT_S
            ) -> BaseException | None:
    """The exception ``fn()`` raises (None if none), run in a thread for at most
    ``limit_s``; if it is still blocked on ``fifo`` then, a writer opens the FIFO to set it
    free and the test fails."""
    out: dict[str, BaseException | None] = {"error": None}

    def target() -> None:
        try:
            fn()
        except BaseException as exc:        # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(limit_s)
        pytest.fail(f"still blocked on the FIFO {fifo} after {limit_s} s")
    return out["error"]


def run_kvtier(*argv: str, env: dict[str, str] | None = None, limit_s: float = 3 * LIMIT_S
               ) -> subprocess.CompletedProcess[str]:
    """``kvtier ARGV`` in a new process (without the caller's $KVTIER_CONFIG), killed and
    the test failed past ``limit_s``."""
    full = {k: v for k, v in os.environ.items() if k != "KVTIER_CONFIG"}
    full.update(env or {})
    try:
        return subprocess.run([sys.executable, "-c", _MAIN, *argv], env=full,
                              capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {' '.join(argv)} did not finish in {limit_s} s")
        raise                      # (pytest.fail raises; for type checkers without pytest)


def one_line(err: str) -> str:
    """The one line of ``err`` (asserting it is one line and no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    return lines[0]
