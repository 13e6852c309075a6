"""`example-sqlite`: KV pages as rows of one SQLite file (key, spec fingerprint, bytes).

What every L3 store does, in order: validate the batch before touching anything
(``_check_batch``: keys, host pages, attached pool); read into / write from the host pool's
page views (``page_segments`` works for both host layouts); treat every failure of its own
medium as a miss and a counted error, never an exception, and never hand back bytes it
cannot vouch for (a row of the wrong size is a counted corruption and a miss).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.errors import ConfigError
from kvtier.interfaces import Availability, L3Store

from . import KVTIER_INTERFACE_VERSION


class SqliteStore(L3Store):
    name = "example-sqlite"
    interface_version = KVTIER_INTERFACE_VERSION

    @dataclass(frozen=True)
    class Config:
        #: The database file (created, with its directory, if missing).
        path: str = ""
        #: Seconds a statement waits for another process's lock before it counts as an error.
        timeout_s: float = 5.0

    @classmethod
    def probe(cls) -> Availability:
        # Exercise the runtime, not just find it: open an in-memory database and run a query.
        try:
            import sqlite3
            con = sqlite3.connect(":memory:")
            con.execute("select 1").fetchone()
            con.close()
        except (ImportError, OSError, RuntimeError) as exc:
            return Availability.unavailable(f"sqlite3 does not work: {exc}",
                                            "use a Python built with SQLite")
        return Availability.available(f"SQLite {sqlite3.sqlite_version}")

    @classmethod
    def example_config(cls, workdir: str) -> dict[str, Any]:
        return {"path": os.path.join(workdir, "kv.sqlite")}

    def __init__(self, config: Any = None, *, spec):
        super().__init__(config, spec=spec)          # builds self.config (typed, checked)
        if not self.config.path:
            raise ConfigError(f"{self.name}.path must name the database file",
                              key=f"{self.name}.path")
        import sqlite3
        os.makedirs(os.path.dirname(os.path.abspath(self.config.path)), exist_ok=True)
        self._errors = (sqlite3.Error,)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.config.path, timeout=self.config.timeout_s,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("create table if not exists pages (key blob, fingerprint text, "
                         "data blob, primary key (key, fingerprint))")
        self._fp = spec.fingerprint                  # pages of another geometry never match

    # ----- the five operations ------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        n = 0
        for k in keys:
            if self._row(k, "1") is None:
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        # refuses an unattached store and bad input; distinct_pages: a host page named twice
        # would hold one key while both report a hit
        pages = self._check_batch(keys, host_pages, distinct_pages=True)
        import torch
        out = []
        for k, p in zip(keys, pages):
            row = self._row(k, "data")
            if row is None:
                out.append(False)
                continue
            data = row[0]
            if not isinstance(data, bytes) or len(data) != self.spec.page_bytes:
                self._count(corrupted=1)             # never copy bytes we cannot vouch for
                out.append(False)
                continue
            self._copy_into_page(p, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            out.append(True)
        hits = sum(out)
        self._count(gets=len(keys), get_hits=hits, bytes_read=hits * self.spec.page_bytes)
        return out

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[bool]:
        pages = self._check_batch(keys, host_pages)
        assert self.host_pool is not None
        import torch
        out = []
        for k, p in zip(keys, pages):
            data = torch.cat(self.host_pool.page_segments(p)).numpy().tobytes()
            out.append(self._execute("insert or replace into pages values (?, ?, ?)",
                                     (k, self._fp, data)) is not None)
        ok = sum(out)
        self._count(sets=len(keys), set_ok=ok, bytes_written=ok * self.spec.page_bytes)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_batch(keys)
        n = 0
        for k in keys:
            cur = self._execute("delete from pages where key = ? and fingerprint = ?",
                                (k, self._fp))
            n += cur.rowcount if cur is not None else 0
        return n

    def clear(self) -> None:
        self._execute("delete from pages where fingerprint = ?", (self._fp,))

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ----- helpers: every SQLite failure is a counted error and a miss ------------------------
    def _execute(self, sql: str, params: tuple) -> Any:
        with self._lock:
            if self._db is None:
                return None
            try:
                return self._db.execute(sql, params)
            except self._errors:
                self._count(errors=1)
                return None

    def _row(self, key: bytes, what: str) -> Any:
        with self._lock:
            if self._db is None:
                return None
            try:
                return self._db.execute(f"select {what} from pages where key = ? and "
                                        "fingerprint = ?", (key, self._fp)).fetchone()
            except self._errors:
                self._count(errors=1)
                return None
