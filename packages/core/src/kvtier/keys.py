"""Page keys: ``key_i = SHA-256(key_{i-1} || tokens of page i)``, ``key_{-1} = SHA-256(ns)``.

The namespace folds in the model id, the KVSpec fingerprint, the tensor-parallel rank and size
and an optional salt (LoRA adapter, tenant), so no two models, layouts or ranks share a key.
Because keys chain, "longest cached prefix" is "how many leading keys exist".

Tokens are hashed as little-endian uint32; the conversion is one vectorised numpy call and the
chain is one hashlib call per page (never a Python loop per token).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError, TokensError
from .spec import KVSpec

KEY_BYTES = 32
_MAX_TOKEN = 2**32 - 1


def tokens_to_array(tokens: Any) -> np.ndarray:
    """Validate a token sequence and return it as a contiguous little-endian uint32 array."""
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise TokensError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):   # a torch tensor
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex \
                or str(tokens.dtype) == "torch.bool":
            raise TokensError(f"token tensor must be of an integer dtype, got {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise TokensError(f"tokens are not a 1-D sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise TokensError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise TokensError(f"tokens must be integers, got dtype {arr.dtype} "
                          f"(first item {arr.flat[0]!r})")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise TokensError(f"token ids must be >= 0, got {int(arr.min())}")
    if int(arr.max()) > _MAX_TOKEN:
        raise TokensError(f"token ids must be < 2**32, got {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype="<u4")


def namespace_bytes(*, model_id: str, spec: KVSpec, tp_rank: int = 0, tp_size: int = 1,
                    salt: str = "") -> bytes:
    """The canonical namespace record every key chain starts from."""
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"model_id must be a non-empty string, got {model_id!r}",
                          key="model_id", value=model_id)
    for name, v in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name} must be an int, got {v!r}", key=name, value=v)
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} "
                          f"tp_size={tp_size}", key="tp_rank", value=tp_rank)
    if not isinstance(salt, str):
        raise ConfigError(f"salt must be a string, got {salt!r}", key="salt", value=salt)
    record = {"v": 1, "model": model_id, "spec": spec.fingerprint, "tp_rank": tp_rank,
              "tp_size": tp_size, "salt": salt}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


class PageKeyer:
    """Makes chained page keys for one namespace (model, KV geometry, TP rank, salt)."""

    def __init__(self, *, model_id: str, spec: KVSpec, tp_rank: int = 0, tp_size: int = 1,
                 salt: str = ""):
        self.spec = spec
        self.page_size = spec.page_size
        self.namespace = namespace_bytes(model_id=model_id, spec=spec, tp_rank=tp_rank,
                                         tp_size=tp_size, salt=salt)
        self.root = hashlib.sha256(self.namespace).digest()
        #: Short printable id of the namespace (store prefixes, file names).
        self.namespace_id = self.root[:8].hex()

    def keys(self, tokens: Any, *, prev: bytes | None = None) -> list[bytes]:
        """Keys of every *full* page of ``tokens`` (a partial last page gets no key).

        ``prev`` continues a chain: pass the key of the page before ``tokens[0]``.
        """
        arr = tokens_to_array(tokens)
        n = arr.size // self.page_size
        if prev is None:
            prev = self.root
        elif not isinstance(prev, bytes) or len(prev) != KEY_BYTES:
            raise TokensError(f"prev must be a {KEY_BYTES}-byte key, got {prev!r}")
        if n == 0:
            return []
        buf = arr[: n * self.page_size].tobytes()
        step = self.page_size * 4
        sha = hashlib.sha256
        out: list[bytes] = []
        append = out.append
        for off in range(0, n * step, step):     # one C-level hash per page
            h = sha(prev)
            h.update(buf[off:off + step])
            prev = h.digest()
            append(prev)
        return out


def reference_keys(namespace: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Plain, slow reference of the chaining rule (for tests)."""
    prev = hashlib.sha256(namespace).digest()
    out = []
    for i in range(len(tokens) // page_size):
        page = b"".join(int(t).to_bytes(4, "little") for t in
                        tokens[i * page_size:(i + 1) * page_size])
        prev = hashlib.sha256(prev + page).digest()
        out.append(prev)
    return out
