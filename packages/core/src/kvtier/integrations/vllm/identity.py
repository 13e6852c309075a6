"""The key namespace of a vLLM engine: everything in its config that changes a page's bytes.

Fields `kvtier.keys.PageKeyer` takes as keywords are passed as such; the rest go, as canonical
JSON, into its ``salt``, so two engines that could produce different bytes for the same tokens
never share a key: model and revision, dtype and KV-cache dtype, quantization, block size
(= page size), tensor/pipeline-parallel size (the rank is folded into each stored key by
`datapath.rank_key`), RoPE and its scaling, the block layout's byte order and kvtier's object
format.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from ...keys import PageKeyer
from ...spec import KVSpec

#: Version of what a stored page means to this connector (bump on any change of its bytes).
FORMAT_VERSION = 1


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def engine_identity(vllm_config: Any, page_order: str) -> dict[str, Any]:
    """The fields of ``vllm_config`` (a ``vllm.config.VllmConfig``) that change KV bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = getattr(mc, "hf_config", None)
    rope = {k: _plain(getattr(hf, k, None))
            for k in ("rope_scaling", "rope_theta", "rope_parameters", "partial_rotary_factor")}
    return {
        "model": str(mc.model),
        "revision": str(mc.revision or ""),
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cc.cache_dtype),
        "quantization": str(getattr(mc, "quantization", None) or ""),
        "block_size": int(cc.block_size),
        "tp_size": int(pc.tensor_parallel_size),
        "pp_size": int(pc.pipeline_parallel_size),
        "rope": rope,
        "page_order": page_order,
        "format": FORMAT_VERSION,
    }


def make_keyer(model_id: str, spec: KVSpec, identity: dict[str, Any], salt: str) -> PageKeyer:
    """A PageKeyer over ``identity``: the namespace fields kvtier's keys know by name are
    passed by name, the rest go, as canonical JSON, into the salt."""
    from ... import keys as _keys
    target = getattr(_keys, "make_namespace", None) or PageKeyer
    accepted = set(inspect.signature(target).parameters)
    kwargs: dict[str, Any] = {"model_id": model_id, "spec": spec}
    rest = dict(identity)
    by_name = {"model_revision": "revision", "rope": "rope", "device_layout": "page_order",
               "pp_size": "pp_size"}
    for kw, name in by_name.items():
        if kw in accepted and name in rest:
            kwargs[kw] = rest.pop(name)
    if "tp_size" in accepted:      # the scheduler's chain is rank-free: rank_key() adds it
        kwargs["tp_rank"], kwargs["tp_size"] = 0, rest.pop("tp_size")
    kwargs["salt"] = json.dumps({"salt": salt, "vllm": rest}, sort_keys=True,
                                separators=(",", ":"))
    return PageKeyer(**kwargs)


def request_root(keyer: PageKeyer, salt: str | None) -> bytes | None:
    """Start of a request's chain when it carries its own salt (vLLM's ``cache_salt``)."""
    if not salt:
        return None
    return hashlib.sha256(keyer.root + b"kvtier.cache_salt:" + salt.encode()).digest()
