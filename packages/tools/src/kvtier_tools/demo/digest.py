"""Digests of KV pages: the engine records one for every page the cache takes at commit and
checks every page restored from L2/L3 against them, bit for bit.

A page's digest is a weighted sum, in int64, of its bytes read as 16-bit words (every layer,
K and V or MLA's latent: every chunk of the page in the pool, `DeviceKVPool.chunks`; fixed
random weights below 2^16, a different odd multiplier per layer and chunk). Flipping any one
bit changes one word by +-2^k (k < 16), so the sum by a non-zero amount that cannot wrap
(the sums stay far below 2^63): a single flipped bit is always caught, and other corruptions
with probability ~1 - 2^-60. It runs on the pool's device, one layer at a time, after the
first token (not in the TTFT).

A key may have several digests: the same page recomputed by another forward pass may round
differently in its last bits, and both versions are correct. A restored page must match one
of its key's digests; a key never recorded (a page from another run's L3) counts as unknown.
Processes that share one L3 (a `shm` arena, a file store's directory) share their digests
through a file (`load_known` / `save_known`, the demo's ``--digests``): a page another process
computed and this one recomputed differently is then checked against both versions.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from kvtier.device_pool import DeviceKVPool

__all__ = ["PageDigests", "load_known", "save_known"]

#: Largest digests file read (a demo's pages number in the thousands).
MAX_FILE_BYTES = 256 << 20


class PageDigests:
    """Per page key, the digests of the page contents committed under it."""

    def __init__(self, pool: DeviceKVPool, seed: int = 0,
                 known: dict[bytes, set[int]] | None = None):
        self.pool = pool
        spec = pool.spec
        words = max(pool.chunk_nbytes) // 2
        g = torch.Generator().manual_seed(seed)
        self._w = torch.randint(1, 1 << 16, (words,), generator=g,
                                dtype=torch.int64).to(pool.device)
        n = len(pool.chunk_nbytes)
        self._salt = [[2 * (n * i + c) + 1 for c in range(n)] for i in range(spec.num_layers)]
        #: key -> digests; a map given by the caller is shared (and filled) by reference
        self._known: dict[bytes, set[int]] = {} if known is None else known
        self.recorded = 0
        self.verified = 0
        self.unknown = 0

    def digests(self, pages: Sequence[int]) -> list[int]:
        """The digest of each of ``pages`` as it is now in the pool."""
        if not pages:
            return []
        p = torch.as_tensor(list(pages), dtype=torch.int64).to(self.pool.device)
        acc = torch.zeros(len(pages), dtype=torch.int64, device=self.pool.device)
        for i, chunks in enumerate(self.pool.chunks):
            for c, chunk in enumerate(chunks):          # uint8 [num_pages, nbytes]
                words = chunk.index_select(0, p).view(torch.int16).to(torch.int64)
                acc += (words * self._w[:words.shape[1]]).sum(dim=1) * self._salt[i][c]
        return acc.tolist()

    def record(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """``pages[j]`` now holds the committed content of ``keys[j]``."""
        for key, d in zip(keys, self.digests(pages)):
            self._known.setdefault(key, set()).add(d)
            self.recorded += 1

    def mismatches(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[int]:
        """Indices ``j`` whose page ``pages[j]`` matches none of the digests of ``keys[j]``."""
        bad = []
        for j, (key, d) in enumerate(zip(keys, self.digests(pages))):
            known = self._known.get(key)
            if known is None:
                self.unknown += 1
            elif d in known:
                self.verified += 1
            else:
                bad.append(j)
        return bad


def load_known(path: str) -> dict[bytes, set[int]]:
    """The digests in ``path`` (a JSON object of hex key -> list of ints), {} if there is no
    such file; anything else there is a one-line `ValueError` naming the file."""
    from kvtier.config import open_regular_file, parse_json
    try:
        f = open_regular_file(path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"--digests {path}: {exc.strerror or exc}") from None
    with f:
        text = f.read(MAX_FILE_BYTES + 1)
    if len(text) > MAX_FILE_BYTES:
        raise ValueError(f"--digests {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        raw = parse_json(text.decode("utf-8", "replace"), f"--digests {path}")
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        return {bytes.fromhex(k): {int(d) for d in v if isinstance(d, int)
                                   and not isinstance(d, bool)} for k, v in raw.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"--digests {path}: not a digests file ({exc})") from None


def save_known(path: str, known: dict[bytes, set[int]]) -> None:
    """Merge ``known`` into ``path`` (what another process saved there meanwhile is kept),
    replacing the file atomically."""
    merged = load_known(path)
    for k, v in known.items():
        merged.setdefault(k, set()).update(v)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({k.hex(): sorted(v) for k, v in merged.items()}, f)
    os.replace(tmp, path)
