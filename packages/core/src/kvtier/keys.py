"""Page keys: ``key_i = H(key_{i-1} || tokens of page i)``, ``key_{-1} = H(namespace)``.

The namespace (:class:`KeyNamespace`) folds in everything that changes the bytes of a page:
model id and revision, the KVSpec fingerprint (geometry, dtype, page size), RoPE and its
scaling, the device and host layouts, tensor- and pipeline-parallel rank and size, an optional
salt (LoRA adapter, tenant), kvtier's object-format version and the hash itself, so no two
configurations that could produce different bytes share a key. Because keys chain, "longest
cached prefix" is "how many leading keys exist".

``H`` is SHA-256 by default; ``hash="blake2b"`` (hashlib, 32-byte digests) or ``"blake3"``
(``pip install 'kvtier-core[blake3]'``) are options -- keys of different hashes never
collide, the hash name is part of the namespace. Engines that bring their own page hash
(SGLang's HiCache adapter) do not use these keys at all.

Tokens are hashed as little-endian uint32; the conversion is one vectorised numpy call. The
chain itself is one native call for the whole prompt when the optional ``kvtier-native-keys``
package is installed (``pip install 'kvtier-core[native-keys]'``; SHA-256 on OpenSSL's
libcrypto) and the hash is one it supports, otherwise a Python loop of one hash call per page
(never a loop per token); both give the same keys bit for bit. ``KVTIER_NATIVE_KEYS=0`` in the
environment keeps the Python loop; :attr:`PageKeyer.implementation` says which one a keyer uses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .errors import ConfigError, TokensError
from .spec import KVSpec

KEY_BYTES = 32
_MAX_TOKEN = 2**32 - 1
#: Version of the meaning of a stored page's bytes as kvtier writes them; bumping it gives
#: every key a new namespace (no old object is ever read as a new one).
OBJECT_FORMAT_VERSION = 1


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


def _blake2b(data: bytes = b"") -> Any:
    return hashlib.blake2b(data, digest_size=KEY_BYTES)


def _blake3() -> Callable[..., Any]:
    try:
        from blake3 import blake3
    except ImportError:
        raise ConfigError("hash='blake3' needs the blake3 package (pip install "
                          "'kvtier-core[blake3]')", key="hash", value="blake3") from None
    return blake3


#: name -> constructor of a hash object with ``update``/``digest`` and 32-byte digests.
HASHES: dict[str, Callable[[], Callable[..., Any]]] = {
    "sha256": lambda: hashlib.sha256,
    "blake2b": lambda: _blake2b,
    "blake3": _blake3,
}


def hash_function(name: str) -> Callable[..., Any]:
    """The constructor of hash ``name`` (a typed error for an unknown or missing one)."""
    if name not in HASHES:
        raise ConfigError(f"hash must be one of {sorted(HASHES)}, got {name!r}", key="hash",
                          value=name)
    return HASHES[name]()


#: Environment variable that, set to ``0`` (or ``false``/``no``/``off``), keeps every new
#: :class:`PageKeyer` on the Python loop even where ``kvtier-native-keys`` is installed.
NATIVE_KEYS_ENV = "KVTIER_NATIVE_KEYS"


def native_chain(name: str) -> Callable[[bytes, Any, int], list[bytes]] | None:
    """``kvtier_native_keys``' chain function for hash ``name`` (``chain(root, data,
    page_bytes) -> list of 32-byte keys``), or None: the package is not installed, does
    not support ``name``, or ``KVTIER_NATIVE_KEYS=0`` turns it off."""
    if os.environ.get(NATIVE_KEYS_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    module = _native_module()
    return None if module is None else module.CHAINS.get(name)


@functools.lru_cache(maxsize=1)
def _native_module() -> Any:
    try:
        import kvtier_native_keys
    except ImportError:
        return None
    return kvtier_native_keys


def canonical_rope(rope: Any) -> str:
    """RoPE and its scaling as one canonical string: a string as given, a mapping (e.g. a
    Hugging Face config's ``rope_theta`` + ``rope_scaling``) as sorted compact JSON."""
    if rope is None:
        return ""
    if isinstance(rope, str):
        return rope
    if isinstance(rope, Mapping):
        try:
            return json.dumps(rope, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"rope must be JSON-serialisable, got {rope!r}: {exc}",
                              key="rope", value=rope) from None
    raise ConfigError(f"rope must be a string or a mapping, got {rope!r}", key="rope",
                      value=rope)


@dataclass(frozen=True)
class KeyNamespace:
    """Everything a page's bytes depend on besides its tokens; keys of two namespaces that
    differ in any field never coincide."""

    model_id: str
    spec_fingerprint: str
    model_revision: str = ""
    rope: str = ""
    device_layout: str = ""
    host_layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    salt: str = ""
    format_version: int = OBJECT_FORMAT_VERSION
    hash: str = "sha256"

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}",
                              key="model_id", value=self.model_id)
        for name in ("spec_fingerprint", "model_revision", "rope", "device_layout",
                     "host_layout", "salt"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise ConfigError(f"{name} must be a string, got {v!r}", key=name, value=v)
        for name in ("tp_rank", "tp_size", "pp_rank", "pp_size", "format_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}", key=name, value=v)
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if n < 1 or not 0 <= r < n:
                raise ConfigError(f"need 0 <= {rank} < {size}, got {rank}={r} {size}={n}",
                                  key=rank, value=r)
        if self.format_version < 1:
            raise ConfigError(f"format_version must be >= 1, got {self.format_version}",
                              key="format_version", value=self.format_version)
        hash_function(self.hash)

    def record(self) -> dict[str, Any]:
        return {"v": 2, **asdict(self)}

    def to_bytes(self) -> bytes:
        """The canonical namespace record every key chain starts from."""
        return json.dumps(self.record(), sort_keys=True, separators=(",", ":")).encode()


def namespace_bytes(*, model_id: str, spec: KVSpec, tp_rank: int = 0, tp_size: int = 1,
                    salt: str = "", **identity: Any) -> bytes:
    """The canonical namespace record (see :class:`KeyNamespace` for ``identity``)."""
    return make_namespace(model_id=model_id, spec=spec, tp_rank=tp_rank, tp_size=tp_size,
                          salt=salt, **identity).to_bytes()


def make_namespace(*, model_id: str, spec: KVSpec, tp_rank: int = 0, tp_size: int = 1,
                   salt: str = "", model_revision: str = "", rope: Any = None,
                   device_layout: str = "", host_layout: str = "", pp_rank: int = 0,
                   pp_size: int = 1, format_version: int = OBJECT_FORMAT_VERSION,
                   hash: str = "sha256") -> KeyNamespace:
    if not isinstance(spec, KVSpec):
        raise ConfigError(f"spec must be a KVSpec, got {type(spec).__name__}", key="spec")
    return KeyNamespace(model_id=model_id, spec_fingerprint=spec.fingerprint,
                        model_revision=model_revision, rope=canonical_rope(rope),
                        device_layout=device_layout, host_layout=host_layout,
                        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                        salt=salt, format_version=format_version, hash=hash)


class PageKeyer:
    """Makes chained page keys for one namespace (see :class:`KeyNamespace`).

    Keyword arguments beyond ``model_id``/``spec``/``tp_rank``/``tp_size``/``salt``:
    ``model_revision``, ``rope`` (a string, or a mapping such as ``{"rope_theta": ...,
    "rope_scaling": {...}}``), ``device_layout``, ``host_layout``, ``pp_rank``, ``pp_size``,
    ``format_version`` and ``hash`` (``"sha256"``, ``"blake2b"``, ``"blake3"``).

    :attr:`implementation` is ``"native"`` where the chain runs in one call of
    ``kvtier-native-keys`` (SHA-256, package installed, ``KVTIER_NATIVE_KEYS`` not ``0`` when
    the keyer was made), else ``"python"``; the keys are the same either way."""

    def __init__(self, *, model_id: str, spec: KVSpec, tp_rank: int = 0, tp_size: int = 1,
                 salt: str = "", **identity: Any):
        self.spec = spec
        self.page_size = spec.page_size
        self.identity = make_namespace(model_id=model_id, spec=spec, tp_rank=tp_rank,
                                       tp_size=tp_size, salt=salt, **identity)
        self.hash_name = self.identity.hash
        self._hash = hash_function(self.hash_name)
        self.namespace = self.identity.to_bytes()
        self.root = self._hash(self.namespace).digest()
        #: Short printable id of the namespace (store prefixes, file names).
        self.namespace_id = self.root[:8].hex()
        self._native = native_chain(self.hash_name)
        #: "native" (one kvtier_native_keys call per prompt) or "python" (one hash call per page).
        self.implementation = "python" if self._native is None else "native"

    def keys(self, tokens: Any, *, prev: bytes | None = None) -> list[bytes]:
        """Keys of every *full* page of ``tokens`` (a partial last page gets no key).

        ``prev`` continues a chain: pass the key of the page before ``tokens[0]``. The chain
        is one ``kvtier_native_keys`` call or one hash call per page (:attr:`implementation`).
        """
        arr = tokens_to_array(tokens)
        n = arr.size // self.page_size
        if prev is None:
            prev = self.root
        elif not isinstance(prev, bytes) or len(prev) != KEY_BYTES:
            raise TokensError(f"prev must be a {KEY_BYTES}-byte key, got {prev!r}")
        if n == 0:
            return []
        step = self.page_size * 4
        if self._native is not None:
            return self._native(prev, arr[: n * self.page_size], step)
        buf = arr[: n * self.page_size].tobytes()
        h = self._hash
        out: list[bytes] = []
        append = out.append
        for off in range(0, n * step, step):     # one C-level hash per page
            prev = h(prev + buf[off:off + step]).digest()
            append(prev)
        return out


def reference_keys(namespace: bytes, tokens: Sequence[int], page_size: int,
                   hash: str = "sha256") -> list[bytes]:
    """Plain, slow reference of the chaining rule (for tests)."""
    h = hash_function(hash)
    prev = h(namespace).digest()
    out = []
    for i in range(len(tokens) // page_size):
        page = b"".join(int(t).to_bytes(4, "little") for t in
                        tokens[i * page_size:(i + 1) * page_size])
        prev = h(prev + page).digest()
        out.append(prev)
    return out
