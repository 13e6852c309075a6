"""The connector's sides for every KV cache group of a model.

A model of one group (full attention, sliding window or MLA) has one scheduler side and one
worker side, and these classes pass every hook straight through. A hybrid model served by
vLLM's hybrid KV cache manager (sliding-window and full-attention layers, e.g. Gemma 2 and 3)
has several groups, each with its own blocks: each group is tiered on its own (its own
planner and keys, its own share of the host pool, its own executor over its layers), and
these classes hold them together:

* a request's external hit is the shortest group's (a prefix is of use only with every
  group's KV); a sliding-window group loads only its window, as a one-group model does;
* every load is asynchronous, and a request whose load failed in any group is reported in
  ``failed_recving`` (vLLM recomputes it whole): with several groups vLLM cannot map a
  failed block back to its request, so it takes no block-level errors;
* a request is reported received once every group's load of it has landed.

A hybrid model with a group the connector cannot tier (a Mamba state) gets no sides at all:
it runs, and the connector neither loads nor saves (`config.engine_views` says why, once).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from .config import EngineView
from .metadata import (KVTierConnectorStats, KVTierGroupsMetadata, KVTierGroupsWorkerMetadata,
                       KVTierMetadata)
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


def _parts(meta: Any, n: int) -> list[Any]:
    """The per-group metadata of a step (one group: the step's own)."""
    if isinstance(meta, KVTierGroupsMetadata):
        return list(meta.groups)
    return [meta] * n


class Schedulers:
    """The scheduler's half for every group (see the module doc)."""

    def __init__(self, views: list[EngineView], totals: "Counter[str]"):
        self.totals = totals
        # the first group's side keeps the request-level counts (hits per tier, loads);
        # the others count for themselves (`metrics()["groups"]`)
        self.sides = [SchedulerSide(v, totals if i == 0 else Counter())
                      for i, v in enumerate(views)]
        # (vLLM's groups, tiered or not: with several, block ids are not unique)
        self.multi = bool(views) and views[0].num_groups > 1

    @property
    def planner(self) -> Any:
        return self.sides[0].planner if self.sides else None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.sides:
            return 0, False
        outs = [s.get_num_new_matched_tokens(request, num_computed_tokens) for s in self.sides]
        if not self.multi:
            return outs[0]
        n = min(int(t or 0) for t, _ in outs)
        if n:
            for s in self.sides:
                s.set_async(request.request_id)
        return n, n > 0

    def hit_sources(self, request: "Request", num_external_tokens: int, host: Any,
                    disk: Any) -> dict[Any, int] | None:
        outs = [s.hit_sources(request, num_external_tokens, host, disk) for s in self.sides]
        return outs[0] if outs else None

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        for s in self.sides:
            s.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        metas = [s.build_connector_meta(scheduler_output) for s in self.sides]
        if not self.multi:
            return metas[0] if metas else KVTierMetadata()
        return KVTierGroupsMetadata(groups=metas)

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        """The workers' report of a step: each group books its part; the stats (the workers'
        counters, summed over groups and ranks) and the block-level errors vLLM saw (one
        group only: several report failed requests instead) count once."""
        if not self.sides:
            return
        wm = out.kv_connector_worker_meta
        parts = wm.groups if isinstance(wm, KVTierGroupsWorkerMetadata) else [wm]
        for s, m in zip(self.sides, parts):
            s.book_worker_meta(m)
            s.received(out.finished_recving or ())
        stats = out.kv_connector_stats
        if stats is not None and stats.data:
            self.totals.update({k: v for k, v in stats.data.items()
                                if isinstance(v, (int, float))})
        if out.invalid_block_ids:
            self.totals["invalid_blocks_reported"] += len(out.invalid_block_ids)

    def request_finished(self, request: "Request") -> bool:
        """True: a load of the request is still running in some group."""
        return any([s.request_finished(request) for s in self.sides])

    def metrics(self) -> dict[str, Any]:
        if not self.sides:
            return {}
        out = self.sides[0].metrics()
        if self.multi:
            each = [s.metrics() for s in self.sides]
            planner: Counter[str] = Counter()
            for m in each:
                planner.update({k: v for k, v in m["planner"].items()
                                if isinstance(v, int) and not isinstance(v, bool)})
            out["planner"] = dict(planner)       # summed over the groups
            out["groups"] = [{"kv_cache_group": s.view.group,
                              "sliding_window": s.view.sliding_window,
                              "layers": list(s.view.layer_names), **dict(s.totals), **m}
                             for s, m in zip(self.sides, each)]
        return out

    def stats(self) -> KVTierConnectorStats | None:
        outs = [s.stats() for s in self.sides]  # (every side's interval restarts)
        return outs[0] if outs else None

    def shutdown(self) -> None:
        for s in self.sides:
            s.shutdown()


class Workers:
    """A worker's half for every group (see the module doc)."""

    def __init__(self, views: list[EngineView], totals: "Counter[str]", tp_rank: int):
        self.sides = [WorkerSide(v, totals, tp_rank) for v in views]
        # (vLLM's groups, tiered or not: with several, block ids are not unique)
        self.multi = bool(views) and views[0].num_groups > 1
        #: request -> the groups whose asynchronous load of it has not landed yet
        self._waiting: dict[str, set[int]] = {}
        self._failed: set[str] = set()

    @property
    def executor(self) -> Any:
        return self.sides[0].executor if self.sides else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for s in self.sides:
            s.register_kv_caches(kv_caches)

    def bind(self, meta: Any) -> None:
        for s, m in zip(self.sides, _parts(meta, len(self.sides))):
            s.bind(m)

    def start_load_kv(self, meta: Any) -> None:
        for g, (s, m) in enumerate(zip(self.sides, _parts(meta, len(self.sides)))):
            if self.multi and isinstance(m, KVTierMetadata):
                for order in m.loads:
                    if order.is_async:
                        self._waiting.setdefault(order.req_id, set()).add(g)
            s.start_load_kv(m)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for s in self.sides:
            s.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        for s in self.sides:
            s.wait_for_save()

    def get_transfer_results(self, out: Any) -> Any:
        if not self.multi:
            return self.sides[0].get_transfer_results(out) if self.sides else out
        for g, s in enumerate(self.sides):
            part = s.get_transfer_results(KVConnectorTransferResults())
            self._failed |= s.failed_reqs
            s.failed_reqs.clear()
            for req_id in part.finished_recving:
                left = self._waiting.get(req_id)
                if left is not None:
                    left.discard(g)
        for req_id in [r for r, left in self._waiting.items() if not left]:
            del self._waiting[req_id]
            out.finished_recving.add(req_id)
            if req_id in self._failed:
                self._failed.discard(req_id)
                out.failed_recving.add(req_id)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs: set[int] = set()
        for s in self.sides:
            errs |= s.get_block_ids_with_load_errors()
        # several groups: every load is asynchronous and a failed one is its request's
        # failed_recving (block ids are not unique across groups)
        return set() if self.multi else errs

    def build_connector_worker_meta(self) -> Any:
        metas = [s.build_connector_worker_meta() for s in self.sides]
        if not self.multi:
            return metas[0] if metas else None
        if all(m is None for m in metas):
            return None
        return KVTierGroupsWorkerMetadata(groups=metas)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no group's data path has work queued or running (queued L3 writes
        land); False if ``timeout`` passed first."""
        return all([s.executor.wait_idle(timeout) for s in self.sides
                    if s.executor is not None])

    def stats(self) -> KVTierConnectorStats | None:
        data: Counter[str] = Counter()
        for s in self.sides:
            st = s.stats()
            if st is not None:
                data.update(st.data)
        return KVTierConnectorStats(data=dict(data)) if data else None

    def shutdown(self) -> None:
        for s in self.sides:
            s.shutdown()
