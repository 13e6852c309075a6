"""`KVTierConnector`: the `KVConnectorBase_V1` subclass (see the package docstring).

It is a dispatcher, like vLLM's own offloading connector: vLLM builds it once per role, and each
hook goes to the scheduler side (`scheduler.SchedulerSide`: kvtier's planner) or to the worker
side (`worker.WorkerSide`: kvtier's executor). It holds no policy and builds nothing of its own;
what both sides share is the `config.EngineView` made once from vLLM's configs.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    KVConnectorWorkerMetadata, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .config import (block_layout, cache_config_from_vllm, check_extra_config, engine_views,
                     spec_from_kv_cache_config)
from .groups import Schedulers, Workers
from .metadata import KVTierConnectorStats, KVTierMetadata, KVTierWorkerMetadata, LoadOrder

try:      # vLLM >= 0.31 names the tier an external hit came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")

__all__ = ["KVTierConnector", "KVTierMetadata", "KVTierWorkerMetadata", "KVTierConnectorStats",
           "LoadOrder", "cache_config_from_vllm", "spec_from_kv_cache_config", "block_layout"]


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:   # no parallel state (a bare worker)
        return 0


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's tiers (host pool, L3 store) under vLLM's paged KV cache; a hybrid model's
    KV cache groups each on their own (`groups`)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a dropped backup is a later miss, never lost work

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        views, why = engine_views(vllm_config, kv_cache_config)
        if why:
            log.warning("%s", why)
            self.cfg = cache_config_from_vllm(vllm_config)
            self.spec = self.keyer = None
        else:
            view = views[0]
            self.cfg, self.spec, self.keyer = view.cfg, view.spec, view.keyer
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r: a failed load (a corrupted or "
                        "missing L3 object) fails its request instead of being recomputed; "
                        "set kv_load_failure_policy='recompute'", policy)
        #: Cumulative counters (hits per tier; the workers' pages, bytes and failures).
        self.totals: Counter[str] = Counter()
        self._scheduler: Schedulers | None = None
        self._worker: Workers | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = Schedulers(views, self.totals)
        else:
            self._worker = Workers(views, self.totals, _tp_rank())
        for v in views:
            log.info("kvtier connector (%s, KV cache group %d of %d): %d host pages of %d "
                     "bytes, L3 %s, namespace %s", role.name.lower(), v.group, v.num_groups,
                     v.num_host_pages, v.spec.page_bytes, v.cfg.l3_store or "none",
                     v.keyer.namespace_id)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks this while it builds its config (with CUDA graphs, its default on GPUs):
        kvtier checks its whole config here, before any model loads, and answers no."""
        check_extra_config(extra_config, model_id="(vLLM's model)")
        return False

    @property
    def planner(self) -> Any:
        """The scheduler side's `CachePlanner` (None on a worker)."""
        return self._scheduler.planner if self._scheduler is not None else None

    @property
    def executor(self) -> Any:
        """The worker side's `CacheExecutor` (None on the scheduler, or before
        ``register_kv_caches``)."""
        return self._worker.executor if self._worker is not None else None

    # ----- scheduler side ---------------------------------------------------------------------
    def _sched(self) -> Schedulers:
        assert self._scheduler is not None, "a scheduler-side hook called on a worker"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int
                                       ) -> dict[Any, int]:
        out = None
        if CacheHitSource is not None:
            out = self._sched().hit_sources(request, num_external_tokens,
                                            CacheHitSource.HOST, CacheHitSource.DISK)
        if out is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return out

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request), None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request), None

    def metrics(self) -> dict[str, Any]:
        """Cumulative counters: hits per tier (tokens) and, on the scheduler side, the
        planner's page counts and the rates its split runs on; the workers' pages, bytes
        and failures as reported through vLLM's connector stats."""
        out: dict[str, Any] = dict(self.totals)
        if self._scheduler is not None:
            out.update(self._scheduler.metrics())
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    # ----- worker side ------------------------------------------------------------------------
    def _work(self) -> Workers:
        assert self._worker is not None, "a worker-side hook called on the scheduler"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._work().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Backups run in wait_for_save, when every layer of this step's blocks is written:
        # the CPU backend has no copy engine to overlap them with the next layers.
        return

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().get_transfer_results(KVConnectorTransferResults())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the worker's data path (every KV cache group's) is idle: queued L3
        writes have landed (tests, benchmarks, an orderly stop); False on timeout."""
        return self._work().wait_idle(timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_connector_worker_meta()

    # ----- both -------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats() if side is not None else None

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()
