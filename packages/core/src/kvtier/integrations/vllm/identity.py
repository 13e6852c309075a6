"""What of a vLLM engine's config changes a page's bytes, for the cache's one keyer.

`kvtier.cache.keying.make_keyer` builds the connector's keys like every other path's: from
kvtier's `CacheConfig` (model id, revision, TP and PP sizes: `cache_config_from_vllm` sets them
from vLLM), the KV geometry (the `KVSpec`: block size = page size, KV dtype), the block
layout's byte order, and the fields below, which only vLLM knows: model dtype, KV-cache dtype
(and the layers kept out of its quantization), quantization, RoPE and its scaling, and the
connector's format version; `config.engine_views` adds a sliding window and, for a hybrid
model, the KV cache group. Two engines that could produce different bytes for the same tokens
never share a key.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ...keys import PageKeyer

#: Version of what a stored page means to this connector (bump on any change of its bytes).
FORMAT_VERSION = 1


def engine_identity(vllm_config: Any) -> dict[str, Any]:
    """The fields of ``vllm_config`` (a ``vllm.config.VllmConfig``) that change KV bytes and
    that `CacheConfig` does not carry."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = getattr(mc, "hf_config", None)
    rope = {k: getattr(hf, k, None)
            for k in ("rope_scaling", "rope_theta", "rope_parameters", "partial_rotary_factor")}
    out = {
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cc.cache_dtype),
        "quantization": str(getattr(mc, "quantization", None) or ""),
        "rope": rope,
        "format": FORMAT_VERSION,
    }
    skip = list(getattr(cc, "kv_cache_dtype_skip_layers", None) or [])
    if skip:      # layers kept out of a quantized KV cache: other bytes for them
        out["kv_cache_dtype_skip_layers"] = [str(x) for x in skip]
    return out


def request_root(keyer: PageKeyer, salt: str | None) -> bytes | None:
    """Start of a request's chain when it carries its own salt (vLLM's ``cache_salt``)."""
    if not salt:
        return None
    return hashlib.sha256(keyer.root + b"kvtier.cache_salt:" + salt.encode()).digest()
