"""Adapters that put kvtier under other engines' own cache managers.

Each integration lives in its own module and imports its engine only there, so ``import kvtier``
(and ``import kvtier.integrations``) never imports an engine:

* :mod:`kvtier.integrations.vllm` -- a vLLM V1 KV connector over kvtier's planner (scheduler)
  and executor (workers);
* :mod:`kvtier.integrations.sglang` -- any kvtier L3 store as an SGLang HiCache storage backend,
  and (``.linker``) kvtier's planner and executor behind SGLang's unified-cache linker.
"""

from __future__ import annotations

import json
from typing import Any

#: Where SGLang's ``dynamic`` storage backend finds the kvtier adapter.
SGLANG_MODULE = "kvtier.integrations.sglang"
SGLANG_CLASS = "KVTierHiCacheStorage"


def sglang_extra_config(store: str, store_config: dict[str, Any] | None = None,
                        **options: Any) -> str:
    """The JSON for SGLang's ``--hicache-storage-backend-extra-config`` that loads kvtier's
    adapter (``--hicache-storage-backend dynamic``) over the L3 store ``store``.

    ``options`` are further adapter settings (``key_prefix``, ``skip_existing``) or SGLang's own
    keys (``prefetch_threshold``...). The zero-copy calls are switched on (``interface_v1``).
    Checked when SGLang builds the backend, not here: this needs no SGLang installed.
    """
    cfg: dict[str, Any] = {"backend_name": "kvtier", "module_path": SGLANG_MODULE,
                           "class_name": SGLANG_CLASS, "interface_v1": 1, "store": store,
                           "store_config": dict(store_config or {})}
    cfg.update(options)
    return json.dumps(cfg, sort_keys=False)
