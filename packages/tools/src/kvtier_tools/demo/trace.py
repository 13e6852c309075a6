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

import os

import numpy as np

from ..trace import (SOURCE_BLOCK_TOKENS, TraceError, TraceFormatError, TraceRecord, parse_line,
                     read_trace)
from .workload import Request, Workload, WorkloadError, round_of

#: The reader is `kvtier_tools.trace` (shared with ``kvtier simulate``); these names stay here too.
__all__ = ["SOURCE_BLOCK_TOKENS", "TraceError", "TraceFormatError", "TraceRecord", "parse_line",
           "read_trace", "BlockTokens", "scaled_length", "trace_workload"]

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
