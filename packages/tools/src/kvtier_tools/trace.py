"""Mooncake-format request traces (one JSON object per line): the one reader behind
``kvtier simulate`` and ``kvtier demo --workload trace``.

Each line has ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``: one id per ``source_block`` (512) tokens of the prompt, equal ids meaning equal
content. Blank lines are skipped. Anything else that is not such a record -- bad JSON, a value
that is not an object, non-UTF-8 bytes, a field of the wrong type (``"hash_ids": "01"`` is
not a list), an int past 64 bits, nesting past 32 levels -- is a `TraceFormatError` naming the
file, the line and the field; a missing or unreadable path (a directory), or anything but a
regular file (a FIFO is refused, never waited on), is a `TraceError`. Both are
`kvtier.errors.InputError`, so the ``kvtier`` command prints one line and exits 2.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass

from kvtier.config import MAX_DEPTH, check_depth, open_regular_file
from kvtier.errors import ConfigError, InputError, show_value

#: Tokens per ``hash_ids`` entry in Mooncake traces.
SOURCE_BLOCK_TOKENS = 512
#: Every int in a record (lengths, hash ids) is below this: what a 64-bit integer holds.
INT_LIMIT = 2**63


class TraceError(InputError):
    """A trace cannot be read (missing, a directory, unreadable) or holds no request."""


class TraceFormatError(TraceError):
    """A trace line is not a valid Mooncake record; ``line`` is its 1-based number."""


class EmptyTraceWarning(UserWarning):
    """A trace (or the part of it asked for) holds no request."""


@dataclass(frozen=True)
class TraceRecord:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _range(v: object, minimum: int) -> str:
    too_big = isinstance(v, int) and v >= INT_LIMIT
    return "below 2**63" if too_big else f">= {minimum}"


def _int_field(obj: dict, name: str, minimum: int, where: str, source: str, line: int) -> int:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}", source=source, line=line,
                               field=name)
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v < INT_LIMIT:
        raise TraceFormatError(f"{where}: {name} must be an int {_range(v, minimum)}, got "
                               f"{show_value(v)}", source=source, line=line, field=name)
    return v


def parse_line(text: str, *, line: int, source: str = "<trace>",
               source_block: int = SOURCE_BLOCK_TOKENS) -> TraceRecord:
    """Validate one line; raises `TraceFormatError` naming the line and the field."""
    where = f"{source}:{line}"
    try:
        obj = json.loads(text)
        check_depth(obj, where)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})",
                               source=source, line=line) from None
    except (RecursionError, ConfigError):
        raise TraceFormatError(f"{where}: nests more than {MAX_DEPTH} levels of objects or "
                               "arrays", source=source, line=line) from None
    except ValueError as exc:           # an int past sys.get_int_max_str_digits()
        raise TraceFormatError(f"{where}: a value cannot be read: {exc}", source=source,
                               line=line) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}",
                               source=source, line=line)
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) \
            or (isinstance(ts, int) and not 0 <= ts < INT_LIMIT) \
            or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a number >= 0, got "
                               f"{show_value(ts)}", source=source, line=line,
                               field="timestamp")
    n_in = _int_field(obj, "input_length", 1, where, source, line)
    n_out = _int_field(obj, "output_length", 0, where, source, line)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(f"{where}: hash_ids must be a non-empty list, got {ids!r:.60}",
                               source=source, line=line, field="hash_ids")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < INT_LIMIT:
            raise TraceFormatError(f"{where}: hash_ids[{i}] must be an int {_range(h, 0)}, "
                                   f"got {show_value(h)}", source=source, line=line,
                                   field="hash_ids")
    want = -(-n_in // source_block)
    if len(ids) != want:
        raise TraceFormatError(f"{where}: input_length {n_in} needs {want} hash_ids of "
                               f"{source_block} tokens, got {len(ids)}", source=source,
                               line=line, field="hash_ids")
    return TraceRecord(line, float(ts), n_in, n_out, tuple(ids))


def read_trace(path: str | os.PathLike, *, max_requests: int | None = None, skip: int = 0,
               source_block: int = SOURCE_BLOCK_TOKENS,
               allow_empty: bool = False) -> list[TraceRecord]:
    """Parse a trace file: the ``max_requests`` records after the first ``skip`` (which are
    validated too). No record is a `TraceError`, or with ``allow_empty`` an
    `EmptyTraceWarning` and an empty list."""
    source = os.fspath(path)
    try:
        fh = open_regular_file(source)
    except OSError as exc:
        raise TraceError(f"cannot read trace {source}: {exc.strerror or exc}",
                         source=source) from None
    records: list[TraceRecord] = []
    seen = 0
    with fh:
        for line_no, raw in enumerate(fh, 1):
            if max_requests is not None and len(records) >= max_requests:
                break
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{source}:{line_no}: not UTF-8 text: {exc.reason} "
                                       f"(byte {exc.start})", source=source,
                                       line=line_no) from None
            if not text.strip():
                continue
            rec = parse_line(text, line=line_no, source=source, source_block=source_block)
            seen += 1
            if seen > skip:
                records.append(rec)
    if not records:
        what = f"trace {source} holds no request" + (f" after the first {skip}" if skip else "")
        if not allow_empty:
            raise TraceError(what, source=source)
        warnings.warn(what, EmptyTraceWarning, stacklevel=2)
    return records
