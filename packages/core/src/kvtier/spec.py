"""`KVSpec`: the model's KV-cache geometry, and the sizes and fingerprint derived from it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final, Literal

import torch

from .errors import SpecError

#: dtype names kvtier accepts, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

KIND_MHA: Final = "mha"
KIND_MLA: Final = "mla"


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of a dtype given as a name, an alias or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == dtype:
                return name
        raise SpecError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}",
                        field="dtype", value=dtype)
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype.removeprefix("torch."))
        if name in DTYPES:
            return name
    raise SpecError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPES)}", field="dtype",
                    value=dtype)


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"KVSpec.{field} must be a positive int, got {value!r}", field=field,
                        value=value)
    return value


@dataclass(frozen=True)
class KVSpec:
    """KV geometry of one model shard (one tensor-parallel rank).

    MHA/GQA: per layer a K and a V row of ``num_kv_heads x head_dim`` per token.
    MLA: per layer one latent row of ``kv_lora_rank + rope_dim`` per token (no K/V axis).
    ``page_size`` is in tokens.
    """

    num_layers: int
    page_size: int
    dtype: str = "bfloat16"
    kind: Literal["mha", "mla"] = KIND_MHA
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0

    def __post_init__(self) -> None:
        _positive_int("num_layers", self.num_layers)
        _positive_int("page_size", self.page_size)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.kind == KIND_MHA:
            _positive_int("num_kv_heads", self.num_kv_heads)
            _positive_int("head_dim", self.head_dim)
            for name in ("kv_lora_rank", "rope_dim"):
                if getattr(self, name):
                    raise SpecError(f"KVSpec.{name}={getattr(self, name)!r}: an mha spec takes "
                                    "no kv_lora_rank/rope_dim", field=name,
                                    value=getattr(self, name))
        elif self.kind == KIND_MLA:
            _positive_int("kv_lora_rank", self.kv_lora_rank)
            if isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int) \
                    or self.rope_dim < 0:
                raise SpecError(f"KVSpec.rope_dim must be an int >= 0, got {self.rope_dim!r}",
                                field="rope_dim", value=self.rope_dim)
            for name in ("num_kv_heads", "head_dim"):
                if getattr(self, name):
                    raise SpecError(f"KVSpec.{name}={getattr(self, name)!r}: an mla spec takes "
                                    "no num_kv_heads/head_dim", field=name,
                                    value=getattr(self, name))
        else:
            raise SpecError(f"unknown KVSpec.kind {self.kind!r}; expected 'mha' or 'mla'",
                            field="kind", value=self.kind)

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
            dtype: str | torch.dtype = "bfloat16") -> "KVSpec":
        return cls(num_layers=num_layers, page_size=page_size, dtype=dtype_name(dtype),
                   kind=KIND_MHA, num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, page_size: int,
            dtype: str | torch.dtype = "bfloat16") -> "KVSpec":
        return cls(num_layers=num_layers, page_size=page_size, dtype=dtype_name(dtype),
                   kind=KIND_MLA, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVSpec":
        from .config import build_config
        return build_config(cls, data, section="spec")

    # ----- derived sizes -------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_components(self) -> int:
        """2 (K and V) for MHA, 1 (the latent row) for MLA."""
        return 2 if self.kind == KIND_MHA else 1

    @property
    def heads(self) -> int:
        return self.num_kv_heads if self.kind == KIND_MHA else 1

    @property
    def dim(self) -> int:
        return self.head_dim if self.kind == KIND_MHA else self.kv_lora_rank + self.rope_dim

    @property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token's row of one component in one layer: (heads, dim)."""
        return (self.heads, self.dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one component in one layer."""
        return self.heads * self.dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (page, layer, component) chunk: page_size rows."""
        return self.page_size * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page: every layer and component."""
        return self.num_layers * self.num_components * self.chunk_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "page_size": self.page_size, "dtype": self.dtype,
                "kind": self.kind, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "kv_lora_rank": self.kv_lora_rank, "rope_dim": self.rope_dim}

    @cached_property
    def fingerprint(self) -> str:
        """Stable 16-hex-digit digest of the geometry; equal specs give equal fingerprints."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvtier.KVSpec.v1" + blob).hexdigest()[:16]

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Number of *full* pages in ``num_tokens`` tokens."""
        return num_tokens // self.page_size
