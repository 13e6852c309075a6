"""kvtier's whole stack inside SGLang through its unified-cache external linker (SGLang 0.5.23).

Start SGLang with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic \\
    --unified-cache-external-linker-config '{"linker": "KvtierLinker",
      "linker_module_path": "kvtier.integrations.sglang.linker",
      "linker_extra_config": {"l3_store": "file", "l3_config": {"root": "/mnt/nvme/kvtier"}}}'

SGLang's radix tree keeps L1 (its device pool); below it `KvtierLinker` puts kvtier's L2 host
pool and L3 store. It is a dispatcher and holds no policy: what a lookup offers (the cost split
included), what a load reads from where and what an offload backs up and writes are the
`CachePlanner`'s; the copies and store I/O are the `CacheExecutor`'s, over a `DeviceKVPool`
that describes SGLang's own device buffers in place (token-major K and V, or MLA's latent).

How SGLang's calls map onto kvtier:

* ``lookup`` -- SGLang's page hashes (its chain over the tokens) become kvtier keys in the
  config's namespace (`linker_key`); the planner's offer gives ``n`` leading pages and every
  length ``1..n`` is restorable (full attention is a contiguous prefix).
* ``load`` -- the planner plans the load at once (its L2 pages are pinned from here on); the
  executor runs it from ``start_layer_wise_loading``; a load thread advances SGLang's
  ``LayerWiseLoadCounter`` for layer ``i`` only after layer ``i`` of every copy of the batch
  has landed (the executor's ``wait_layer``, which also waits for the copies an L3 read feeds:
  those start once the read is in L2, then land layer by layer like the others).
  ``finish_layer_wise_loading`` is False when any page of the batch did not land: SGLang then
  drops those requests' output (its contract); a store that fails is not offered again.
* ``cancel_queued_load`` / ``reset`` -- a queued plan is failed back to the planner (pins and
  host pages returned); reset waits for what runs.
* ``offload`` -- the planner's save plan (backups, then L3 writes under the write policy) runs
  on the executor; completions are reported in offload order.

Tensor parallelism: rank and size are this worker's in SGLang's attention-TP cache group. MHA:
a rank holds its own heads; ``tp_size`` is in the key namespace and each rank stores and reads
its shard under its own object keys (`kvtier.cache.keying.rank_key`), so a lookup counts this
rank's shards only and SGLang's tree intersects the ranks' lengths. MLA: the latent is the same
on every rank: one object per page, read by every rank, written by rank 0 alone (another
rank's L3 writes, write-through and write-back, are left to rank 0 and booked done).

Components: full attention (MHA ``MHATokenToKVPool`` and MLA ``MLATokenToKVPool``) is handled;
every other tree component (SWA, Mamba, ...) is refused at start with one line per component.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from ...cache import CacheConfig, CacheExecutor, CachePlanner, Plan, PlanResult
from ...cache.l3io import L3IO
from ...device_pool import DeviceKVPool
from ...errors import ConfigError, InvalidArgumentError, LayoutError
from ...metrics import Metrics
from ...spec import KVSpec, dtype_name

try:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )
except (ImportError, OSError, RuntimeError) as _exc:  # pragma: no cover - needs no sglang
    raise ImportError(
        f"kvtier.integrations.sglang.linker needs SGLang's unified-cache linker interface "
        f"(sglang.srt.mem_cache.unified_cache, written against sglang 0.5.23): "
        f"{type(_exc).__name__}: {_exc}. Install SGLang for your accelerator first.") from _exc

log = logging.getLogger("kvtier.sglang")

__all__ = ["KvtierLinker", "linker_config", "linker_key", "FORMAT_VERSION"]

#: Version of what a stored page means to this linker (bump on any change of its bytes).
FORMAT_VERSION = 1
#: Why each tree component other than full attention is not served (one line each).
_REFUSED = {
    "SWA": "sliding-window pages are restorable only as a window ending on an offloaded node "
           "boundary; kvtier's planner keys contiguous prefixes only",
    "MAMBA": "a Mamba state is one slot per node, not pages of tokens; kvtier stores pages",
}


def linker_config(l3_store: str | None = None, l3_config: Mapping[str, Any] | None = None,
                  **cache: Any) -> dict[str, Any]:
    """The object for ``--unified-cache-external-linker-config`` (``json.dumps`` it)."""
    extra: dict[str, Any] = dict(cache)
    if l3_store is not None:
        extra["l3_store"] = l3_store
        extra["l3_config"] = dict(l3_config or {})
    return {"linker": "KvtierLinker", "linker_module_path": __name__,
            "linker_extra_config": extra}


def linker_key(root: bytes, page_hash: str) -> bytes:
    """kvtier's key of the page SGLang names ``page_hash`` (its chained hash over the tokens,
    with the request's extra key) in the namespace whose root is ``root``."""
    return hashlib.sha256(root + b"kvtier.sglang:" + page_hash.encode()).digest()


def check_extra_config(extra: Any, **from_sglang: Any) -> CacheConfig:
    """kvtier's CacheConfig from ``linker_extra_config`` and what SGLang decides
    (`CacheConfig.inside_engine`), refusing what the linker cannot serve."""
    cfg = CacheConfig.inside_engine(extra, where="linker_extra_config", engine="SGLang",
                                    **from_sglang)
    if cfg.host_layout != "page_first":
        raise ConfigError("the SGLang linker needs host_layout='page_first'",
                          key="host_layout", value=cfg.host_layout)
    return cfg


def refused_components(components: Iterable[Any]) -> list[str]:
    """One line per tree component the linker does not serve (empty: all served)."""
    out = []
    for c in sorted(components, key=int):
        if c == ComponentType.FULL:
            continue
        name = getattr(c, "name", str(c))
        out.append(f"{name}: {_REFUSED.get(name, 'not a paged full-attention KV pool')}")
    return out


def describe_kvcache(kvcache: Any, page_size: int) -> tuple[KVSpec, DeviceKVPool]:
    """The KVSpec and a zero-copy `DeviceKVPool` of SGLang's device token pool: per layer
    ``k_buffer``/``v_buffer`` ``[slots, heads, dim]`` (MHA) or ``kv_buffer``
    ``[slots, 1, latent]`` (MLA), cut to whole pages. Other pools are refused by name."""
    kind = type(kvcache).__name__
    layers = int(kvcache.layer_num)
    dtype = dtype_name(kvcache.dtype)
    if type(kvcache) is MHATokenToKVPool:
        if getattr(kvcache, "use_hnd", False):
            raise LayoutError(f"{kind}: the HND layout (SGLANG_USE_HND_KVCACHE) is not served")
        if kvcache.v_head_dim != kvcache.head_dim:
            raise LayoutError(f"{kind}: K and V of different head sizes ({kvcache.head_dim}, "
                              f"{kvcache.v_head_dim}) are not served")
        spec = KVSpec.mha(num_layers=layers, num_kv_heads=int(kvcache.head_num),
                          head_dim=int(kvcache.head_dim), page_size=page_size, dtype=dtype)
        comps = [list(kvcache.k_buffer), list(kvcache.v_buffer)]
    elif type(kvcache) is MLATokenToKVPool:
        rope = int(kvcache.qk_rope_head_dim)
        spec = KVSpec.mla(num_layers=layers, kv_lora_rank=int(kvcache.kv_lora_rank),
                          rope_dim=rope, page_size=page_size, dtype=dtype)
        comps = [list(kvcache.kv_buffer)]
    else:
        raise LayoutError(f"the kvtier linker serves SGLang's MHATokenToKVPool and "
                          f"MLATokenToKVPool; this model's device pool is {kind} (quantized, "
                          f"hybrid or other pools keep bytes kvtier does not store)")
    slots = comps[0][0].shape[0] // page_size * page_size     # whole pages only: a view
    views = [[t.view(spec.torch_dtype)[:slots] for t in c] for c in comps]
    pool = DeviceKVPool(spec, views[0], views[1] if len(views) == 2 else None)
    return spec, pool


def _parallel(server_args: Any, params: Any) -> tuple[int, int]:
    """(rank, size) of this worker in its attention tensor-parallel group."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group",
                                                                    None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank(group=group),
                torch.distributed.get_world_size(group=group))
    return 0, 1


@dataclass
class _Load:
    rid: str
    plan: Plan
    pages: int                      # device pages SGLang asked for


@dataclass
class _Batch:
    index: int
    loads: list[_Load]
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


@dataclass
class _Offload:
    plan: Plan
    result: PlanResult | None = None


class KvtierLinker(UnifiedCacheLinker):
    """kvtier's planner and executor behind SGLang's `UnifiedCacheLinker` (module doc)."""

    def __init__(self, server_args: Any, params: Any, *, components: Iterable[Any],
                 extra_config: Mapping[str, Any] | None = None, forward_stream: Any = None):
        refused = refused_components(components)
        if refused:
            raise LayoutError("the kvtier linker serves full attention only; refused: "
                              + "; ".join(refused))
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.spec, self.device_pool = describe_kvcache(kvcache, self.page_size)
        self.num_layers = self.spec.num_layers
        rank, size = _parallel(server_args, params)
        mla = self.spec.kind == "mla"
        self.cfg = cfg = check_extra_config(
            extra_config, model_id=str(getattr(server_args, "model_path", "") or ""),
            model_revision=str(getattr(server_args, "revision", "") or ""),
            # MLA's latent is the same on every rank: one object per page, rank 0 writes it
            tp_size=1 if mla else size, tp_rank=0 if mla else rank,
            pp_rank=int(getattr(params, "pp_rank", 0)), pp_size=int(getattr(params, "pp_size",
                                                                            1)))
        self.writes_l3 = not mla or rank == 0
        self.identity = {
            "engine": "sglang-linker", "format": FORMAT_VERSION, "dtype": self.spec.dtype,
            "kv_cache_dtype": str(getattr(server_args, "kv_cache_dtype", "auto")),
            "attn_cp": [int(getattr(params, "attn_cp_rank", 0)),
                        int(getattr(params, "attn_cp_size", 1))],
            "start_layer": int(getattr(kvcache, "start_layer", 0) or 0),
        }
        n_host = cfg.host_pages_for(self.spec.page_bytes, self.device_pool.num_pages)
        self.executor = CacheExecutor.from_config(cfg, device_pool=self.device_pool,
                                                  num_host_pages=n_host,
                                                  engine_identity=self.identity)
        exists = None
        self._exists_io: L3IO | None = None
        if self.executor.store is not None:
            # existence checks under the store-call deadline: a stuck store costs misses
            io = self._exists_io = L3IO(self.executor.store, threads=0,
                                        error_limit=cfg.l3_error_limit,
                                        call_timeout_s=cfg.l3_call_timeout_s,
                                        metrics=Metrics(), name="kvtier-linker-l3")
            exists = io.exists
        try:
            self.planner = CachePlanner(cfg, spec=self.spec,
                                        device_layout=self.device_pool.page_order,
                                        num_host_pages=n_host, l3_exists=exists,
                                        engine_identity=self.identity)
        except BaseException:
            self.executor.close(cfg.close_timeout_s)
            raise
        # both halves in this process: L3 hits load in place where this data path can
        self.planner.set_in_place(self.executor.in_place is not None)
        self.root = self.planner.keyer.root
        self.pools: dict[Any, Any] = {PoolName.KV: kvcache}
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self._lock = threading.RLock()
        self._queued: dict[str, _Load] = {}
        self._batches: dict[int, _Batch] = {}
        self._watch: dict[int, PlanResult | None] = {}       # plan id -> result once done
        self._unwritten: dict[int, int] = {}    # plan id -> L3 writes left to rank 0 (MLA)
        self._offloads: deque[_Offload] = deque()
        self._jobs: queue.Queue[_Batch | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._load_loop, daemon=True,
                                        name=f"kvtier-linker-load-tp{rank}")
        self._thread.start()
        self._saves: queue.Queue[tuple[Plan, list[Any]] | None] = queue.Queue()
        self._save_thread = threading.Thread(target=self._save_loop, daemon=True,
                                             name=f"kvtier-linker-offload-tp{rank}")
        self._save_thread.start()
        log.info("kvtier linker: %s %s pages of %d tokens, %d host pages, L3 %s, rank %d/%d",
                 type(kvcache).__name__, self.spec.kind, self.page_size, n_host,
                 cfg.l3_store or "none", rank, size)

    # ----- SGLang's calls ---------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv(transfers, "lookup")
        if kv is None or not kv.keys:
            return []
        self._drain()
        offer = self.planner.offer(self._keys(kv.keys))
        if offer.probe is not None:
            self._run(offer.probe)
        return list(range(1, offer.pages + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = self._kv(transfers, "load")
        if kv is None:
            return False
        keys = self._keys(kv.keys or [])
        pages = self._pages(kv.device_indices, len(keys), "load")
        with self._lock:
            if rid in self._queued:
                raise InvalidArgumentError(f"a load of request {rid!r} is already queued",
                                           argument="rid", value=rid)
            plan = self.planner.plan_load(keys, pages, 0)
            self._queued[rid] = _Load(rid, plan, len(pages))
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            q = self._queued.pop(rid, None)
        if q is None:
            return False
        self.planner.fail(q.plan.plan_id)
        return True

    def start_layer_wise_loading(self) -> int:
        self._drain()
        with self._lock:
            if not self._queued:
                return -1
            loads = list(self._queued.values())
            self._queued.clear()
            index = self.layer_done_counter.update_producer()
            batch = self._batches[index] = _Batch(index, loads)
        for ld in loads:
            self._run(ld.plan, watch=True)
        self._jobs.put(batch)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = self.layer_done_counter.finish(counter_index)
        with self._lock:
            batch = self._batches.pop(counter_index, None)
        if batch is None:
            return landed
        batch.done.wait()
        return landed and batch.ok

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = self._kv(transfers, "offload")
        if kv is None:
            return False
        keys = self._keys(kv.keys or [])
        pages = self._pages(kv.device_indices, len(keys), "offload")
        # the forward may still be writing the pages: the offload thread waits for these
        events = self.record_offload_ready() if self.forward_stream is not None else []
        self._drain()
        plan = self.planner.plan_save(keys, pages, 0)
        entry = _Offload(plan)
        with self._lock:
            self._offloads.append(entry)
        if plan.empty:
            self._book(plan.failed(), run=False)
            entry.result = PlanResult(plan.plan_id)       # nothing to do: done, and fine
        else:
            self._saves.put((plan, events))
        return True

    def num_completed_offloads(self) -> int:
        self._drain()
        with self._lock:
            n = 0
            for e in self._offloads:
                if e.result is None:
                    break
                n += 1
            return n

    def pop_completed_offload(self) -> bool:
        self._drain()
        with self._lock:
            if not self._offloads or self._offloads[0].result is None:
                raise InvalidArgumentError("no completed offload to pop", argument="offload")
            return self._offloads.popleft().result.ok  # type: ignore[union-attr]

    def reset(self) -> None:
        with self._lock:
            queued = list(self._queued.values())
            self._queued.clear()
        for q in queued:
            self.planner.fail(q.plan.plan_id)
        self._jobs.join()                        # started batches: their layers all land
        self._saves.join()                       # queued offloads: submitted
        self.executor.wait_idle(self.cfg.close_timeout_s)
        self._drain()
        with self._lock:
            self._offloads.clear()
            self._batches.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._jobs.put(None)
        self._saves.put(None)
        self._thread.join(self.cfg.close_timeout_s)
        self._save_thread.join(self.cfg.close_timeout_s)
        self.executor.close(self.cfg.close_timeout_s)
        self._drain()
        if self._exists_io is not None:
            self._exists_io.stop(self.cfg.close_timeout_s)

    # ----- kvtier's side ----------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        return {"planner": self.planner.metrics(), "executor": self.executor.metrics()}

    def _keys(self, hashes: Sequence[str]) -> list[bytes]:
        return [linker_key(self.root, h) for h in hashes]

    def _kv(self, transfers: Sequence[PoolTransfer], what: str) -> PoolTransfer | None:
        """The full-attention transfer; any other pool is refused (one log line)."""
        kv = None
        for t in transfers:
            if t.name == PoolName.KV:
                kv = t
            else:
                log.warning("kvtier linker: %s of pool %s refused: only full attention is "
                            "served", what, getattr(t.name, "value", t.name))
                return None
        return kv

    def _pages(self, indices: Any, n: int, what: str) -> list[int]:
        """Device pages of SGLang's token slots ``indices``: whole pages, in order."""
        ps = self.page_size
        if indices is None:
            raise InvalidArgumentError(f"{what}: the KV transfer has no device indices",
                                       argument="device_indices")
        idx = torch.as_tensor(indices).to("cpu", torch.int64).view(-1)
        if idx.numel() != n * ps:
            raise InvalidArgumentError(f"{what}: {idx.numel()} device slots for {n} pages of "
                                       f"{ps} tokens", argument="device_indices")
        rows = idx.view(n, ps)
        first = rows[:, 0]
        if n and (bool((first % ps).ne(0).any()) or
                  not torch.equal(rows, first[:, None] + torch.arange(ps))):
            raise InvalidArgumentError(f"{what}: device slots are not whole pages",
                                       argument="device_indices")
        return [int(p) for p in (first // ps).tolist()]

    def _run(self, plan: Plan, watch: bool = False) -> None:
        sent = plan
        with self._lock:
            if watch:                           # a load: its result judges the batch
                self._watch[plan.plan_id] = None
            if plan.l3_writes and not self.writes_l3:
                # MLA, rank > 0: rank 0 writes the same latent (write-back evictions too)
                sent = dataclasses.replace(plan, l3_writes=())
                self._unwritten[plan.plan_id] = len(plan.l3_writes)
        try:
            self.executor.submit(sent)
        except Exception as exc:                # a plan the data path refuses: it failed
            log.warning("kvtier linker: plan %d refused: %s", plan.plan_id, exc)
            with self._lock:
                self._unwritten.pop(plan.plan_id, None)
            self._book(plan.failed())

    def _drain(self) -> None:
        for res in self.executor.poll():
            self._book(res)

    def _book(self, res: PlanResult, run: bool = True) -> None:
        if not res.released_host_pages:
            with self._lock:
                unwritten = self._unwritten.pop(res.plan_id, 0)
            if unwritten:                       # this rank's part of rank 0's writes: done
                res = dataclasses.replace(res, l3_writes=(True,) * unwritten)
        try:
            self.planner.complete(res)
        except Exception as exc:             # a result the planner does not know: log only
            log.warning("kvtier linker: result of plan %s not booked: %s", res.plan_id, exc)
        if not run or res.released_host_pages:
            return
        with self._lock:
            if res.plan_id in self._watch:
                self._watch[res.plan_id] = res
            for e in self._offloads:
                if e.plan.plan_id == res.plan_id:
                    e.result = res

    def _result(self, plan: Plan) -> PlanResult:
        self.executor.wait(plan.plan_id)
        self._drain()
        with self._lock:
            res = self._watch.pop(plan.plan_id, None)
        return res if res is not None else plan.failed()

    def _load_loop(self) -> None:
        while True:
            batch = self._jobs.get()
            try:
                if batch is None:
                    return
                self._land(batch)
            finally:
                self._jobs.task_done()

    def _save_loop(self) -> None:
        while True:
            job = self._saves.get()
            try:
                if job is None:
                    return
                plan, events = job
                try:
                    for ev in events:       # the forward's writes of these pages are done
                        ev.synchronize()
                except BaseException as exc:   # noqa: BLE001 - the offload fails, in order
                    log.warning("kvtier linker: offload %d not started: %s", plan.plan_id, exc)
                    self._book(plan.failed())
                    continue
                self._run(plan)
            finally:
                self._saves.task_done()

    def _land(self, batch: _Batch) -> None:
        """Advance the counter layer by layer, each layer only once every copy of it landed;
        then judge the batch (every page of every load, or it failed)."""
        counter = self.layer_done_counter
        ex = self.executor
        try:
            for layer in range(self.num_layers):
                for ld in batch.loads:      # from L2, fed by an L3 read, or in place alike
                    if ld.plan.load_pages:
                        ex.wait_layer(ld.plan.plan_id, layer)
                counter.complete(batch.index, layer)
            ok = True
            for ld in batch.loads:
                res = self._result(ld.plan)
                if len(res.load_results) != ld.pages or not all(res.load_results):
                    ok = False
            batch.ok = ok
        except BaseException as exc:            # noqa: BLE001 - the counter must resolve
            log.exception("kvtier linker: load batch %d failed", batch.index)
            counter.fail(batch.index, exc)
        finally:
            batch.done.set()
