"""Replay of Mooncake-format request traces (one JSON object per line).

Each line has ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``: one id per ``source_block`` (512) tokens of the prompt, equal ids meaning equal
content, so two requests share a prefix exactly as far as their leading ids agree. Replay turns
every id into a fixed run of token ids (a function of the id and the seed only). To fit a small
machine, ``block_tokens`` shrinks every block (a 512-token block becomes ``block_tokens``
tokens, the partial last block shrinks in proportion) and ``max_requests`` keeps the first
requests; the sharing structure is unchanged.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
import numpy as np

from .workload import Request, Workload, WorkloadError, round_of

#: Tokens per ``hash_ids`` entry in Mooncake traces.
SOURCE_BLOCK_TOKENS = 512


class TraceFormatError(WorkloadError):
    """A trace line is not a valid Mooncake record; ``line`` is its 1-based number."""


@dataclass(frozen=True)
class TraceRecord:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(obj: dict, name: str, minimum: int, where: str, source: str, line: int) -> int:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}", source=source, line=line,
                               field=name)
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceFormatError(f"{where}: {name} must be an int >= {minimum}, got {v!r}",
                               source=source, line=line, field=name)
    return v


def parse_line(text: str, *, line: int, source: str = "<trace>",
               source_block: int = SOURCE_BLOCK_TOKENS) -> TraceRecord:
    """Validate one line; raises `TraceFormatError` naming the line and the field."""
    where = f"{source}:{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})",
                               source=source, line=line) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}",
                               source=source, line=line)
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a number >= 0, got {ts!r}",
                               source=source, line=line, field="timestamp")
    n_in = _int_field(obj, "input_length", 1, where, source, line)
    n_out = _int_field(obj, "output_length", 0, where, source, line)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(f"{where}: hash_ids must be a non-empty list, got {ids!r:.60}",
                               source=source, line=line, field="hash_ids")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceFormatError(f"{where}: hash_ids[{i}] must be an int >= 0, got {h!r}",
                                   source=source, line=line, field="hash_ids")
    want = -(-n_in // source_block)
    if len(ids) != want:
        raise TraceFormatError(f"{where}: input_length {n_in} needs {want} hash_ids of "
                               f"{source_block} tokens, got {len(ids)}", source=source,
                               line=line, field="hash_ids")
    return TraceRecord(line, float(ts), n_in, n_out, tuple(ids))


def read_trace(path: str | os.PathLike, *, max_requests: int | None = None, skip: int = 0,
               source_block: int = SOURCE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Parse a trace file (blank lines are skipped): the ``max_requests`` records after the
    first ``skip`` (which are validated too)."""
    source = os.fspath(path)
    try:
        fh = open(source, "rb")
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {source}: {exc.strerror or exc}",
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
                raise TraceFormatError(f"{source}:{line_no}: not UTF-8 text: {exc.reason}",
                                       source=source, line=line_no) from None
            if not text.strip():
                continue
            rec = parse_line(text, line=line_no, source=source, source_block=source_block)
            seen += 1
            if seen > skip:
                records.append(rec)
    if not records:
        raise WorkloadError(f"trace {source} holds no request", source=source)
    return records


class BlockTokens:
    """Deterministic token ids of a block id: the same id always gives the same tokens."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int = 0):
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = int(seed)
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, block_id: int) -> np.ndarray:
        arr = self._cache.get(block_id)
        if arr is None:
            rng = np.random.default_rng([self.seed, 0x7472, block_id])   # "tr"
            arr = rng.integers(0, self.vocab_size, self.block_tokens, dtype=np.int64)
            self._cache[block_id] = arr
        return arr


def scaled_length(input_length: int, block_tokens: int,
                  source_block: int = SOURCE_BLOCK_TOKENS) -> int:
    """Prompt length after shrinking each ``source_block``-token block to ``block_tokens``;
    the partial last block keeps its fraction (rounded up, at least one token)."""
    full, rem = divmod(input_length, source_block)
    tail = -(-rem * block_tokens // source_block) if rem else 0
    return full * block_tokens + tail


def trace_workload(path: str | os.PathLike, *, block_tokens: int = 16,
                   max_requests: int | None = 400, start: int = 0, rounds: int = 8,
                   vocab_size: int = 4096, seed: int = 0) -> Workload:
    """A `Workload` replaying requests ``start`` .. ``start + max_requests`` of a Mooncake
    trace, scaled by ``block_tokens`` / 512.

    Requests keep the trace order; ``rounds`` groups of equal size (by order) are what the
    per-round plot shows.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
            or not 1 <= block_tokens <= SOURCE_BLOCK_TOKENS:
        raise WorkloadError(f"block_tokens must be an int in [1, {SOURCE_BLOCK_TOKENS}], got "
                            f"{block_tokens!r}", field="block_tokens")
    if max_requests is not None and (isinstance(max_requests, bool)
                                     or not isinstance(max_requests, int) or max_requests < 1):
        raise WorkloadError(f"max_requests must be an int >= 1 or None, got {max_requests!r}",
                            field="max_requests")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise WorkloadError(f"rounds must be an int >= 1, got {rounds!r}", field="rounds")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise WorkloadError(f"start must be an int >= 0, got {start!r}", field="start")
    records = read_trace(path, max_requests=max_requests, skip=start)
    blocks = BlockTokens(block_tokens, vocab_size, seed)
    requests = []
    n = len(records)
    rounds = min(rounds, n)
    for i, rec in enumerate(records):
        length = scaled_length(rec.input_length, block_tokens)
        tokens = np.concatenate([blocks(h) for h in rec.hash_ids])[:length]
        tokens.setflags(write=False)
        requests.append(Request(i, -1, round_of(i, n, rounds), tokens, rec.output_length,
                                rec.timestamp))
    desc = (f"Mooncake trace {os.path.basename(os.fspath(path))}: requests {start}.."
            f"{start + n - 1}, "
            f"{SOURCE_BLOCK_TOKENS}-token blocks scaled to {block_tokens} tokens")
    return Workload("trace", tuple(requests), rounds, desc)
