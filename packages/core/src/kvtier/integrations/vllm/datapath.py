"""The worker side's data path: kvtier's host pool, L3 store and page copies over vLLM's own
per-layer KV tensors. No vLLM import: it is driven by plain load/save orders.

A host page is ``page_first``: for each layer, the bytes of that layer's block exactly as the
engine lays one block out (`block_chunks`), so a copy is one contiguous row per (block, layer)
and an L3 object is one host page. What a page's bytes mean (``page_order``) is part of the key
namespace, so engines whose blocks order K and V differently never share an object.

Every host page carries the key it holds (``page_key``); a load whose page does not hold the
expected key, an L3 read that fails, or a copy that raises is reported back as failed blocks,
which vLLM recomputes -- never a block of wrong KV.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...errors import LayoutError, TransferError
from ...host_pool import HostKVPool
from ...interfaces import L3Store
from ...spec import KVSpec
from ...transfer_engines.torch_engine import LayerwiseHandle

log = logging.getLogger("kvtier.vllm")

#: Block layouts the data path copies, and the byte order of one page-layer each produces.
PAGE_ORDER = {"vllm_cpu": "hkv", "vllm_flash": "nhd"}


def detect_layout(spec: KVSpec, t: torch.Tensor) -> str:
    """Which engine block layout ``t`` (one layer's KV tensor) has; LayoutError if none."""
    bs, h, d = spec.page_size, spec.num_kv_heads, spec.head_dim
    if t.dtype != spec.torch_dtype:
        raise LayoutError(f"KV tensor has dtype {t.dtype}, the spec says {spec.torch_dtype}")
    if spec.kind != "mha":
        raise LayoutError("the vLLM data path handles MHA/GQA KV only (no MLA yet)")
    shape = tuple(t.shape)
    if t.dim() == 4 and shape[1:] == (h, bs, 2 * d):
        return "vllm_cpu"
    if t.dim() == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
        return "vllm_flash"
    raise LayoutError(f"KV tensor of shape {shape} is neither vllm_cpu [blocks, {h}, {bs}, "
                      f"{2 * d}] nor vllm_flash [2, blocks, {bs}, {h}, {d}]")


def block_chunks(spec: KVSpec, t: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Views of one layer's tensor as ``[num_blocks, nbytes]`` uint8 rows (no copy)."""
    if layout == "vllm_cpu":
        parts = [t]
    elif layout == "vllm_flash":
        parts = [t[0], t[1]]
    else:
        raise LayoutError(f"unknown block layout {layout!r}; known: {sorted(PAGE_ORDER)}")
    out = []
    for p in parts:
        if not p.is_contiguous():
            raise LayoutError(f"{layout} KV tensor part of shape {tuple(p.shape)} is not "
                              "contiguous")
        out.append(p.view(torch.uint8).reshape(p.shape[0], -1))
    if sum(c.shape[1] for c in out) * spec.num_layers != spec.page_bytes:
        raise LayoutError(f"{layout}: a block-layer of {sum(c.shape[1] for c in out)} bytes "
                          f"does not match the spec's {spec.page_bytes // spec.num_layers}")
    return out


@dataclass
class LoadResult:
    """What one finished load did (plain data, reported to the scheduler)."""

    req_id: str
    failed_blocks: list[int] = field(default_factory=list)
    l3_landed: list[tuple[bytes, int]] = field(default_factory=list)
    l3_failed_pages: list[int] = field(default_factory=list)
    bad_keys: list[bytes] = field(default_factory=list)


class DataPath:
    """Host pool + L3 store + copies for one worker (one TP rank)."""

    def __init__(self, spec: KVSpec, layers: Sequence[torch.Tensor], host_pool: HostKVPool,
                 store: L3Store | None, *, store_key: Callable[[bytes], bytes],
                 l3_batch_pages: int = 64, write_l3: bool = True):
        if len(layers) != spec.num_layers:
            raise LayoutError(f"{len(layers)} KV tensors for a spec of {spec.num_layers} layers")
        if host_pool.layout != "page_first":
            raise LayoutError("the vLLM data path needs a page_first host pool")
        self.spec = spec
        self.layout = detect_layout(spec, layers[0])
        for t in layers:
            if detect_layout(spec, t) != self.layout or t.shape != layers[0].shape:
                raise LayoutError("every layer's KV tensor must have one layout and shape")
        self.page_order = PAGE_ORDER[self.layout]
        self.num_blocks = layers[0].shape[1 if self.layout == "vllm_flash" else 0]
        self.dev = [block_chunks(spec, t, self.layout) for t in layers]
        per_layer = spec.page_bytes // spec.num_layers
        host3 = host_pool.raw.view(host_pool.num_pages, spec.num_layers, per_layer)
        self.host: list[list[torch.Tensor]] = []       # [layer][chunk] -> [pages, nbytes]
        for layer in range(spec.num_layers):
            off, row = 0, []
            for c in self.dev[layer]:
                row.append(host3[:, layer, off:off + c.shape[1]])
                off += c.shape[1]
            self.host.append(row)
        self.host_pool = host_pool
        self.store = store
        self.store_key = store_key
        self.l3_batch_pages = l3_batch_pages
        self.write_l3 = write_l3 and store is not None
        self.page_key: list[bytes | None] = [None] * host_pool.num_pages
        self._lock = threading.Lock()
        self._writes: Counter[int] = Counter()      # host page -> queued/running L3 writes
        self._writes_done = threading.Condition(self._lock)
        self.counters: Counter[str] = Counter()
        self._copy_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._l3_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._copy_loop, name="kvtier-vllm-copy",
                                          daemon=True)]
        if store is not None:
            self._threads.append(threading.Thread(target=self._l3_loop, name="kvtier-vllm-l3",
                                                  daemon=True))
        for th in self._threads:
            th.start()

    # ----- counters -----------------------------------------------------------------------
    def count(self, **deltas: int) -> None:
        with self._lock:
            self.counters.update(deltas)

    def take_counters(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            self.counters.clear()
        return out

    # ----- copies -------------------------------------------------------------------------
    def _copy_layer(self, layer: int, h_idx: torch.Tensor, d_idx: torch.Tensor,
                    to_device: bool) -> None:
        for dev, host in zip(self.dev[layer], self.host[layer]):
            if to_device:
                dev.index_copy_(0, d_idx, host.index_select(0, h_idx))
            else:
                host.index_copy_(0, h_idx, dev.index_select(0, d_idx))

    def _copy_loop(self) -> None:
        while True:
            job = self._copy_jobs.get()
            if job is None:
                return
            h_idx, d_idx, handle = job
            try:
                for layer in range(self.spec.num_layers):
                    self._copy_layer(layer, h_idx, d_idx, True)
                    handle._signal(layer)
            except BaseException as exc:     # the handle raises it to whoever waits
                handle._fail(exc)

    def _idx(self, pages: Sequence[int], limit: int) -> torch.Tensor:
        idx = torch.tensor(list(pages), dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= limit):
            raise TransferError(f"page index out of range [0, {limit})", backend="vllm")
        return idx

    def check_pages(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bool]:
        """Which host pages hold the key the scheduler expects."""
        with self._lock:
            return [self.page_key[p] == k for k, p in zip(keys, pages)]

    def start_load(self, blocks: Sequence[int], pages: Sequence[int]) -> LayerwiseHandle:
        """Host pages -> device blocks, layer by layer on the copy thread."""
        handle = LayerwiseHandle(self.spec.num_layers, "kvtier-vllm")
        self._copy_jobs.put((self._idx(pages, self.host_pool.num_pages),
                             self._idx(blocks, self.num_blocks), handle))
        self.count(l2_load_pages=len(pages), bytes_h2d=len(pages) * self.spec.page_bytes)
        return handle

    def save_layer(self, layer: int, blocks: Sequence[int], pages: Sequence[int]) -> None:
        """Device blocks -> host pages for one layer (called right after the layer ran)."""
        self._copy_layer(layer, self._idx(pages, self.host_pool.num_pages),
                         self._idx(blocks, self.num_blocks), False)

    def claim_for_save(self, pages: Sequence[int]) -> list[bool]:
        """Mark pages about to be overwritten; a page still being written to L3 is refused
        (the save is skipped, never waited for in the forward pass)."""
        ok = []
        with self._lock:
            for p in pages:
                busy = self._writes[p] > 0
                if not busy:
                    self.page_key[p] = None
                ok.append(not busy)
        return ok

    def commit_saves(self, keys: Sequence[bytes], pages: Sequence[int], write_l3: bool) -> None:
        """The pages now hold these keys; queue their L3 writes (write-through)."""
        with self._lock:
            for k, p in zip(keys, pages):
                self.page_key[p] = k
            self.counters.update(saved_pages=len(pages),
                                 bytes_d2h=len(pages) * self.spec.page_bytes)
            if write_l3 and self.write_l3 and pages:
                for p in pages:
                    self._writes[p] += 1
        if write_l3 and self.write_l3 and pages:
            self._l3_jobs.put(("write", list(keys), list(pages)))

    # ----- L3 -----------------------------------------------------------------------------
    def start_async_load(self, req_id: str, blocks: Sequence[int], pages: Sequence[int],
                         keys: Sequence[bytes], from_l3: Sequence[bool]) -> None:
        """L3 -> host pages (the L3 part), then host -> device for every block, off the
        forward path; the result comes back through `poll_results`."""
        self._l3_jobs.put(("load", req_id, list(blocks), list(pages), list(keys),
                           list(from_l3)))

    def _store_call(self, op: str, keys: list[bytes], pages: list[int]) -> list[bool]:
        assert self.store is not None
        out: list[bool] = []
        for i in range(0, len(keys), self.l3_batch_pages):
            k = [self.store_key(x) for x in keys[i:i + self.l3_batch_pages]]
            p = pages[i:i + self.l3_batch_pages]
            try:
                fn = self.store.batch_get if op == "get" else self.store.batch_set
                res = [bool(x) for x in fn(k, p)]
                if len(res) != len(k):
                    raise TransferError(f"store {op} returned {len(res)} results for {len(k)}")
            except Exception as exc:     # a failing store is a miss, counted and logged
                log.warning("kvtier: L3 %s of %d pages failed: %s", op, len(k), exc)
                self.count(l3_errors=1)
                res = [False] * len(k)
            out.extend(res)
        return out

    def _l3_loop(self) -> None:
        while True:
            job = self._l3_jobs.get()
            if job is None:
                return
            try:
                if job[0] == "write":
                    self._l3_write(job[1], job[2])
                else:
                    self._results.put(self._async_load(*job[1:]))
            except BaseException as exc:   # keep the loop alive; the job's blocks fail
                log.exception("kvtier: L3 job failed: %s", exc)
                if job[0] == "load":
                    self._results.put(LoadResult(job[1], failed_blocks=list(job[2]),
                                                 l3_failed_pages=[p for p, f in
                                                                  zip(job[3], job[5]) if f]))

    def _l3_write(self, keys: list[bytes], pages: list[int]) -> None:
        try:
            ok = self._store_call("set", keys, pages)
            self.count(l3_written_pages=sum(ok), l3_write_failures=len(ok) - sum(ok),
                       bytes_l3_written=sum(ok) * self.spec.page_bytes)
        finally:
            with self._lock:
                for p in pages:
                    self._writes[p] -= 1
                    if self._writes[p] <= 0:
                        del self._writes[p]
                self._writes_done.notify_all()

    def _async_load(self, req_id: str, blocks: list[int], pages: list[int],
                    keys: list[bytes], from_l3: list[bool]) -> LoadResult:
        res = LoadResult(req_id)
        l3_pages = [p for p, f in zip(pages, from_l3) if f]
        l3_keys = [k for k, f in zip(keys, from_l3) if f]
        with self._lock:              # a page being written to L3 is not read into
            while any(self._writes[p] for p in l3_pages):
                self._writes_done.wait()
            for p in l3_pages:
                self.page_key[p] = None
        got = self._store_call("get", l3_keys, l3_pages) if l3_pages else []
        landed = dict(zip(l3_pages, got))
        with self._lock:
            for k, p in zip(l3_keys, l3_pages):
                if landed[p]:
                    self.page_key[p] = k
        ok_blocks, ok_pages = [], []
        for b, p, k, f in zip(blocks, pages, keys, from_l3):
            if f:
                good = landed[p]
                (res.l3_landed.append((k, p)) if good else res.l3_failed_pages.append(p))
            else:
                good = self.check_pages([k], [p])[0]
                if not good:
                    res.bad_keys.append(k)
            (ok_blocks.append(b), ok_pages.append(p)) if good else res.failed_blocks.append(b)
        n3 = sum(got)
        self.count(l3_load_pages=n3, l3_load_failures=len(got) - n3,
                   bytes_l3_read=n3 * self.spec.page_bytes,
                   load_failures=len(res.failed_blocks))
        if ok_blocks:
            try:
                h_idx = self._idx(ok_pages, self.host_pool.num_pages)
                d_idx = self._idx(ok_blocks, self.num_blocks)
                for layer in range(self.spec.num_layers):
                    self._copy_layer(layer, h_idx, d_idx, True)
                self.count(bytes_h2d=len(ok_pages) * self.spec.page_bytes,
                           l2_load_pages=len(ok_pages) - n3)
            except Exception as exc:
                log.warning("kvtier: host -> device copy failed: %s", exc)
                res.failed_blocks.extend(ok_blocks)
                self.count(load_failures=len(ok_blocks))
        return res

    def poll_results(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until queued L3 writes are done (tests, shutdown)."""
        with self._lock:
            return self._writes_done.wait_for(lambda: not self._writes, timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.wait_idle(timeout)
        self._copy_jobs.put(None)
        self._l3_jobs.put(None)
        for th in self._threads:
            th.join(timeout=timeout)
        if self.store is not None:
            self.store.close()
        self.host_pool.close()
