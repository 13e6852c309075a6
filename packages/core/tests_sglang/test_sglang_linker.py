"""kvtier's whole stack behind SGLang's unified-cache external linker, on CPU.

Everything SGLang here is its own code: the device pools (`MHATokenToKVPool`,
`MLATokenToKVPool` on ``device="cpu"``), the paged allocator the linker reads the pool from,
`CacheInitParams`, the linker factory with the ``dynamic`` backend (which parses the launch
config through `UnifiedCacheLinkerConfig`), `PoolTransfer`, and the `LayerWiseLoadCounter`
registered on the pool the way SGLang's registry does, waited on through the pool's own
``get_key_buffer`` / ``get_value_buffer`` as a forward does.

Tensor parallelism is simulated in one process: each linker gets its rank the way SGLang gives
it (its attention-TP cache group, read through ``torch.distributed``), and the ranks' lookups
are intersected by SGLang's own ``UnifiedCacheLinkerWrapper._sync_restorable_prefix``.

The ``check_*`` functions are the linker's contract; each is also run against a small,
deliberately broken subclass to show that it catches the break.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker",
                    reason="SGLang is not installed (nox -s tests-sglang installs it)")

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402

from kvtier.errors import ConfigError, LayoutError  # noqa: E402
from kvtier.integrations.sglang.linker import (  # noqa: E402
    KvtierLinker,
    linker_config,
    linker_key,
)

MODEL = "test-org/tiny-model"
PS = 4                  # tokens per page
PAGES = 12              # device pages (slot 0's page is SGLang's padding)


# ----- SGLang's side, built as its registry builds it ------------------------------------------
def make_pool(kind: str = "mha") -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    if kind == "mha":
        return MHATokenToKVPool(size=PAGES * PS, page_size=PS, dtype=torch.bfloat16, head_num=2,
                                head_dim=16, layer_num=3, device="cpu",
                                enable_memory_saver=False, enable_alt_stream=False)
    return MLATokenToKVPool(size=PAGES * PS, page_size=PS, dtype=torch.bfloat16,
                            kv_lora_rank=32, qk_rope_head_dim=8, layer_num=3, device="cpu",
                            enable_memory_saver=False)


@dataclass(frozen=True)
class RankGroup:
    """Stands for SGLang's attention-TP cache group as one simulated rank sees it."""

    rank: int
    size: int


@contextmanager
def as_rank(group: RankGroup | None) -> Iterator[None]:
    """torch.distributed as a worker of ``group`` sees it (initialised, its rank and size in
    that group): what the linker reads its TP rank through. None: one process, no group."""
    if group is None:
        yield
        return

    def rank(group: RankGroup) -> int:
        return group.rank

    def size(group: RankGroup) -> int:
        return group.size

    with mock.patch.multiple(torch.distributed, is_initialized=lambda: True, get_rank=rank,
                             get_world_size=size):
        yield


def make_linker(pool: Any, extra: dict, *, cls: type = KvtierLinker,
                components: set | None = None, model: str = MODEL,
                tp: tuple[int, int] | None = None) -> Any:
    """What SGLang's registry does: the factory (dynamic backend, launch config parsed by
    SGLang), then the linker's counter registered on the device pool. ``tp``: (rank, size)
    of a simulated worker, given as SGLang gives it (its attention-TP cache group)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    alloc = PagedTokenToKVPoolAllocator(size=pool.size, page_size=PS, dtype=pool.dtype,
                                        device="cpu", kvcache=pool, need_sort=False)
    group = RankGroup(*tp) if tp is not None else None
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=alloc, page_size=PS,
                             attn_tp_cache_group=group)
    server_args = SimpleNamespace(model_path=model, revision=None, kv_cache_dtype="auto")
    config = linker_config(**extra)
    config["linker"] = cls.__name__
    config["linker_module_path"] = cls.__module__
    with as_rank(group):
        linker = create_unified_cache_linker(server_args, params, backend="dynamic",
                                             config=config,
                                             components=components or {ComponentType.FULL})
    pool.register_layer_transfer_counter(linker.layer_done_counter)
    return linker


def tree_hit_pages(lookups: list[list[int]], num_pages: int) -> list[int]:
    """The hit each rank's tree takes from its linker's lookup, computed by SGLang's own
    ``UnifiedCacheLinkerWrapper._sync_restorable_prefix``: each rank's 0/1 mask of restorable
    lengths, all-reduced with MIN over the attention-TP group, the longest length left. The
    all-reduce is played in two passes: every rank's mask first, then each rank's reduction."""
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        UnifiedCacheLinkerWrapper,
    )
    sync = UnifiedCacheLinkerWrapper._sync_restorable_prefix
    masks: list[torch.Tensor] = []

    def gather(mask: torch.Tensor, op: Any) -> None:
        assert op == torch.distributed.ReduceOp.MIN
        masks.append(mask.clone())

    def reduce(mask: torch.Tensor, op: Any) -> None:
        mask.copy_(torch.stack(masks).min(dim=0).values)

    def tree(all_reduce: Any) -> Any:
        return SimpleNamespace(cache=SimpleNamespace(_all_reduce_attn_groups=all_reduce))

    for hits in lookups:
        sync(tree(gather), hits, num_pages=num_pages, device_hit_pages=0)
    return [sync(tree(reduce), hits, num_pages=num_pages, device_hit_pages=0)
            for hits in lookups]


def extra(tmp_path: Path, **kw: Any) -> dict:
    out = {"l3_store": "file", "l3_config": {"root": str(tmp_path / "l3")},
           "cost_aware_fetch": False, "host_allocator": "mmap", "close_timeout_s": 10.0}
    out.update(kw)
    return out


def hashes(n: int, seed: str) -> list[str]:
    """Page hashes as SGLang chains them (hex SHA-256 over the previous one)."""
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in pages])


def buffers(pool: Any) -> list[torch.Tensor]:
    """Every per-layer buffer of the pool, in layer order (K then V per layer)."""
    if hasattr(pool, "kv_buffer"):
        return list(pool.kv_buffer)
    return [b for pair in zip(pool.k_buffer, pool.v_buffer) for b in pair]


def layer_bufs(pool: Any, layer: int) -> list[torch.Tensor]:
    if hasattr(pool, "kv_buffer"):
        return [pool.kv_buffer[layer]]
    return [pool.k_buffer[layer], pool.v_buffer[layer]]


def read(pool: Any, pages: list[int], layer: int | None = None) -> torch.Tensor:
    bufs = buffers(pool) if layer is None else layer_bufs(pool, layer)
    idx = slots(pages)
    return torch.cat([b[idx].contiguous().view(-1).view(torch.uint8) for b in bufs])


def fill(pool: Any, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = slots(pages)
    for b in buffers(pool):
        u8 = b.view(torch.uint8)
        rows = torch.randint(0, 256, (len(idx), *u8.shape[1:]), generator=g, dtype=torch.uint8)
        u8[idx] = rows


def zero(pool: Any, pages: list[int]) -> None:
    idx = slots(pages)
    for b in buffers(pool):
        b.view(torch.uint8)[idx] = 0


def kv(pages: list[int], keys: list[str]) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.KV, device_indices=slots(pages), keys=list(keys))]


def lookup_keys(keys: list[str]) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.KV, keys=list(keys))]


def offload(linker: Any, pages: list[int], keys: list[str]) -> bool:
    assert linker.offload(kv(pages, keys))
    deadline = time.monotonic() + 20
    while linker.num_completed_offloads() < 1:
        assert time.monotonic() < deadline, "offload never completed"
        time.sleep(0.005)
    return linker.pop_completed_offload()


def forward(pool: Any, linker: Any, index: int) -> None:
    """What a forward does: the consumer index, then each layer's buffers through the pool's
    own hooks (which wait on the linker's counter)."""
    linker.layer_done_counter.set_consumer(index)
    for layer in range(pool.layer_num):
        if hasattr(pool, "kv_buffer"):
            pool.get_key_buffer(layer)
        else:
            pool.get_key_buffer(layer)
            pool.get_value_buffer(layer)


def run_load(pool: Any, linker: Any, rid: str, pages: list[int], keys: list[str]) -> bool:
    assert linker.load(rid, kv(pages, keys))
    index = linker.start_layer_wise_loading()
    assert index >= 0
    forward(pool, linker, index)
    return linker.finish_layer_wise_loading(index)


# ----- the contract checks ---------------------------------------------------------------------
def check_round_trip(pool: Any, linker: Any, keys: list[str], src: list[int], dst: list[int],
                     want: torch.Tensor) -> None:
    """Every page is restorable at every length, and a load lands the very bytes."""
    assert linker.lookup("r", lookup_keys(keys)) == list(range(1, len(keys) + 1))
    zero(pool, dst)
    assert run_load(pool, linker, "r", dst, keys)
    assert torch.equal(read(pool, dst), want), "loaded KV differs from what was offloaded"


def check_layer_order(pool: Any, linker: Any, dst: list[int], keys: list[str],
                      want_layers: list[torch.Tensor]) -> None:
    """At the moment the counter marks layer i done, layer i's pages hold their bytes."""
    counter = linker.layer_done_counter
    early: list[int] = []
    inner = counter.complete

    def complete(index: int, layer: int) -> None:
        if not torch.equal(read(pool, dst, layer), want_layers[layer]):
            early.append(layer)
        inner(index, layer)

    counter.complete = complete
    try:
        zero(pool, dst)
        run_load(pool, linker, "order", dst, keys)
    finally:
        del counter.complete
    assert not early, f"the counter ran ahead of the copies at layers {early}"


def check_cancel(pool: Any, linker: Any, keys: list[str], a: list[int], b: list[int],
                 want: torch.Tensor) -> None:
    """A cancelled queued load writes nothing and holds nothing; the others still land."""
    free = linker.planner.host.free_count
    zero(pool, a + b)
    assert linker.load("keep", kv(a, keys)) and linker.load("drop", kv(b, keys))
    assert linker.cancel_queued_load("drop")
    assert not linker.cancel_queued_load("drop")
    index = linker.start_layer_wise_loading()
    forward(pool, linker, index)
    assert linker.finish_layer_wise_loading(index)
    assert not linker.cancel_queued_load("keep")          # started: not cancellable
    assert torch.equal(read(pool, a), want)
    assert not read(pool, b).any(), "a cancelled load wrote device pages"
    pending = linker.planner.pending_plans()
    assert not pending, f"plans still pending after cancel: {pending}"
    pins = [nd for nd in linker.planner.index.nodes.values() if nd.l2_pins]
    assert not pins, f"{len(pins)} L2 pages still pinned after cancel"
    assert linker.planner.host.free_count == free
    linker.planner.check()


def check_identity(other: Any, keys: list[str]) -> None:
    """A linker of another identity (another model) finds none of the pages."""
    assert other.lookup("x", lookup_keys(keys)) == [], "pages of another identity offered"


# ----- broken linkers: each check must catch its break -----------------------------------------
class EagerCounterLinker(KvtierLinker):
    """Broken: marks every layer done at once, before the copies (which start late)."""

    def _run(self, plan: Any, watch: bool = False) -> None:
        if plan.loads:
            if watch:
                with self._lock:
                    self._watch[plan.plan_id] = None
            threading.Timer(0.2, KvtierLinker._run, (self, plan)).start()
            return
        super()._run(plan, watch)

    def _land(self, batch: Any) -> None:
        for layer in range(self.num_layers):
            self.layer_done_counter.complete(batch.index, layer)
        time.sleep(0.4)
        batch.ok = True
        batch.done.set()


class ForeignKeysLinker(KvtierLinker):
    """Broken: keys SGLang's hash alone, dropping kvtier's namespace (model, geometry...)."""

    def _keys(self, page_hashes: Any) -> list[bytes]:
        return [hashlib.sha256(h.encode()).digest() for h in page_hashes]


class LeakyCancelLinker(KvtierLinker):
    """Broken: drops a cancelled load without failing its plan (pins and host pages kept)."""

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            return self._queued.pop(rid, None) is not None


# ----- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_linker_round_trip_l2_and_file_l3(tmp_path: Path, kind: str) -> None:
    pool = make_pool(kind)
    keys, src, dst = hashes(4, kind), [1, 2, 3, 4], [7, 8, 9, 10]
    fill(pool, src, seed=1)
    want = read(pool, src)
    linker = make_linker(pool, extra(tmp_path))
    try:
        assert offload(linker, src, keys)
        check_round_trip(pool, linker, keys, src, dst, want)            # from L2
        m = linker.planner.metrics()
        assert m["l2_hit_pages"] == 4 and m["l3_hit_pages"] == 0
    finally:
        linker.close()
    # a new linker (a restart: empty L2) over the same file store: every page from L3
    pool2 = make_pool(kind)
    fresh = make_linker(pool2, extra(tmp_path))
    try:
        check_round_trip(pool2, fresh, keys, src, dst, want)
        assert fresh.planner.metrics()["l3_hit_pages"] == 4
        check_layer_order(pool2, fresh, [2, 3, 4, 5], keys,
                          [read(pool2, dst, layer) for layer in range(pool2.layer_num)])
    finally:
        fresh.close()


def test_linker_shm_l3_loads_in_place(tmp_path: Path) -> None:
    """A `shm` L3 is read in place: a second linker (another SGLang process on the host, its
    L2 empty) loads every page straight from the arena into SGLang's pool, bitwise, layer by
    layer; nothing is read into a host page."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def pool_4k() -> Any:              # 2 layers x K,V x 4 tokens x 2 heads x 64 x 2 B = 4 KiB
        return MHATokenToKVPool(size=PAGES * PS, page_size=PS, dtype=torch.bfloat16,
                                head_num=2, head_dim=64, layer_num=2, device="cpu",
                                enable_memory_saver=False, enable_alt_stream=False)
    arena = f"kvtier-test-linker-{os.getpid()}-{os.urandom(4).hex()}"
    shm = extra(tmp_path, l3_store="shm",
                l3_config={"name": arena, "capacity_pages": 32, "remove_when_unused": True})
    pool = pool_4k()
    keys, src, dst = hashes(4, "shm"), [1, 2, 3, 4], [7, 8, 9, 10]
    fill(pool, src, seed=5)
    want = read(pool, src)
    first = make_linker(pool, shm)
    try:
        assert first.executor.in_place is not None and first.planner.in_place
        assert offload(first, src, keys)
        deadline = time.monotonic() + 20
        while first.executor.store.batch_exists(first._keys(keys)) < 4:     # written through
            assert time.monotonic() < deadline, "the L3 writes never landed"
            time.sleep(0.01)
        pool2 = pool_4k()
        second = make_linker(pool2, shm)
        try:
            check_round_trip(pool2, second, keys, src, dst, want)
            m = second.planner.metrics()
            assert m["l3_in_place_pages"] == 4 and m["l3_hit_pages"] == 4
            assert second.executor.metrics().get("l3_read_missed_pages", 0) == 0
            assert second.executor.store.stats()["in_place_reads"] == 4
            check_layer_order(pool2, second, [2, 3, 5, 6], keys,
                              [read(pool2, dst, layer) for layer in range(pool2.layer_num)])
        finally:
            second.close()
    finally:
        first.close()


def test_linker_layer_order_l2(tmp_path: Path) -> None:
    pool = make_pool()
    keys, src, dst = hashes(5, "order"), [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    fill(pool, src, seed=2)
    want = [read(pool, src, layer) for layer in range(pool.layer_num)]
    linker = make_linker(pool, extra(tmp_path))
    try:
        assert offload(linker, src, keys)
        check_layer_order(pool, linker, dst, keys, want)
    finally:
        linker.close()


def test_linker_layer_order_l3_fed_streams_per_layer(tmp_path: Path) -> None:
    """A load an L3 read feeds (a restarted linker, empty L2): each layer is on the device when
    the counter marks it, and the counter marks layer 0 before anything waits for the whole
    plan (the layers stream; they are not released together at the end)."""
    rng = random.Random(11)
    pool = make_pool()
    keys = hashes(5, "l3-order")
    src = rng.sample(range(1, PAGES), 5)
    dst = rng.sample(range(1, PAGES), 5)
    fill(pool, src, seed=11)
    want = [read(pool, src, layer) for layer in range(pool.layer_num)]
    first = make_linker(pool, extra(tmp_path))
    try:
        assert offload(first, src, keys)
    finally:
        first.close()
    pool2 = make_pool()
    linker = make_linker(pool2, extra(tmp_path))
    events: list[str] = []
    counter, ex = linker.layer_done_counter, linker.executor
    complete, wait = counter.complete, ex.wait

    def marked(index: int, layer: int) -> None:
        events.append(f"layer {layer}")
        complete(index, layer)

    def waited(plan_id: int, timeout: float | None = None) -> bool:
        events.append("whole plan")
        return wait(plan_id, timeout)

    try:
        assert linker.lookup("r", lookup_keys(keys)) == [1, 2, 3, 4, 5]
        counter.complete, ex.wait = marked, waited
        check_layer_order(pool2, linker, dst, keys, want)
        assert linker.planner.metrics()["l3_hit_pages"] == 5
        assert events[0] == "layer 0", f"the counter waited for the whole plan: {events}"
        assert torch.equal(read(pool2, dst), read(pool, src))
    finally:
        counter.__dict__.pop("complete", None)
        ex.__dict__.pop("wait", None)
        linker.close()


@pytest.mark.parametrize("source", ["l2", "l3"])
def test_layer_order_check_catches_an_eager_counter(tmp_path: Path, source: str) -> None:
    pool = make_pool()
    keys, src, dst = hashes(3, "eager-" + source), [1, 2, 3], [6, 7, 8]
    fill(pool, src, seed=3)
    want = [read(pool, src, layer) for layer in range(pool.layer_num)]
    linker = make_linker(pool, extra(tmp_path), cls=EagerCounterLinker)
    try:
        assert offload(linker, src, keys)
        if source == "l3":                        # a restart: the load reads L3 first
            linker.close()
            pool = make_pool()
            linker = make_linker(pool, extra(tmp_path), cls=EagerCounterLinker)
            assert linker.lookup("r", lookup_keys(keys)) == [1, 2, 3]
        with pytest.raises(AssertionError, match="ran ahead"):
            check_layer_order(pool, linker, dst, keys, want)
        time.sleep(0.3)                           # its late copies end before close
        planned = linker.planner.metrics()
        assert planned["planned_l3_load_pages"] == (3 if source == "l3" else 0)
    finally:
        linker.close()


def test_linker_cancel_mid_load(tmp_path: Path) -> None:
    pool = make_pool()
    keys, src = hashes(3, "cancel"), [1, 2, 3]
    fill(pool, src, seed=4)
    want = read(pool, src)
    linker = make_linker(pool, extra(tmp_path))
    try:
        assert offload(linker, src, keys)
        check_cancel(pool, linker, keys, [5, 6, 7], [9, 10, 11], want)
        # reset drops queued loads the same way
        assert linker.load("queued", kv([5, 6, 7], keys))
        linker.reset()
        assert not linker.planner.pending_plans()
        assert linker.start_layer_wise_loading() == -1
    finally:
        linker.close()


def test_cancel_check_catches_leaked_pins(tmp_path: Path) -> None:
    pool = make_pool()
    keys, src = hashes(3, "leak"), [1, 2, 3]
    fill(pool, src, seed=5)
    want = read(pool, src)
    linker = make_linker(pool, extra(tmp_path), cls=LeakyCancelLinker)
    try:
        assert offload(linker, src, keys)
        with pytest.raises(AssertionError, match="pending after cancel|pinned"):
            check_cancel(pool, linker, keys, [5, 6, 7], [9, 10, 11], want)
    finally:
        linker.close()


@pytest.mark.parametrize("cls,caught", [(KvtierLinker, False), (ForeignKeysLinker, True)])
def test_identity_check(tmp_path: Path, cls: type, caught: bool) -> None:
    """Two models over one store that shares its object space (an explicit namespace): only
    kvtier's keys keep them apart."""
    l3 = {"root": str(tmp_path / "l3"), "namespace": "shared"}
    keys, src = hashes(3, "ident"), [1, 2, 3]
    pool_a, pool_b = make_pool(), make_pool()
    fill(pool_a, src, seed=6)
    a = make_linker(pool_a, extra(tmp_path, l3_config=l3), cls=cls, model="org/model-a")
    b = make_linker(pool_b, extra(tmp_path, l3_config=l3), cls=cls, model="org/model-b")
    try:
        assert offload(a, src, keys)
        assert a.lookup("a", lookup_keys(keys)) == [1, 2, 3]
        if caught:
            with pytest.raises(AssertionError, match="another identity"):
                check_identity(b, keys)
        else:
            check_identity(b, keys)
    finally:
        a.close()
        b.close()


def test_linker_failing_store_costs_a_miss(tmp_path: Path) -> None:
    """Objects corrupted under a restarted linker: the load reports failure (SGLang drops that
    request's output, never uses the slots), the bytes are not claimed, and the next lookup
    offers nothing (the pages are recomputed)."""
    pool = make_pool()
    keys, src, dst = hashes(3, "corrupt"), [1, 2, 3], [6, 7, 8]
    fill(pool, src, seed=7)
    cfg = extra(tmp_path, l3_config={"root": str(tmp_path / "l3"), "format": "objects"})
    first = make_linker(pool, cfg)
    try:
        assert offload(first, src, keys)
    finally:
        first.close()
    objs = [p for p in (tmp_path / "l3").rglob("*.kvp")]
    assert len(objs) == 3
    for p in objs:                                        # flip bytes in every object
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 2, len(data), 7):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))
    pool2 = make_pool()
    linker = make_linker(pool2, cfg)
    try:
        assert linker.lookup("r", lookup_keys(keys)) == [1, 2, 3]     # present, unreadable
        zero(pool2, dst)
        assert not run_load(pool2, linker, "r", dst, keys)
        assert linker.lookup("r2", lookup_keys(keys)) == []             # a miss from now on
        assert not linker.planner.pending_plans()
        linker.planner.check()
    finally:
        linker.close()


def test_linker_refuses_swa_and_mamba_per_component(tmp_path: Path) -> None:
    pool = make_pool()
    with pytest.raises(LayoutError) as err:
        make_linker(pool, extra(tmp_path),
                    components={ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA})
    msg = str(err.value)
    assert "SWA: sliding-window" in msg and "MAMBA: a Mamba state" in msg


def test_linker_config_unknown_key_and_sglang_keys(tmp_path: Path) -> None:
    pool = make_pool()
    with pytest.raises(ConfigError, match="did you mean 'l3_store'"):
        make_linker(pool, {"l3_stor": "file"})
    with pytest.raises(ConfigError, match="tp_size"):
        make_linker(pool, extra(tmp_path, tp_size=2))


def test_launch_config_parses_as_sglang_does() -> None:
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig
    cfg = UnifiedCacheLinkerConfig.from_dict(
        linker_config("file", {"root": "/mnt/nvme/kvtier"}))
    assert (cfg.linker, cfg.linker_module_path) == ("KvtierLinker",
                                                   "kvtier.integrations.sglang.linker")
    assert cfg.linker_extra_config == {"l3_store": "file",
                                       "l3_config": {"root": "/mnt/nvme/kvtier"}}


def test_linker_tp2_mha_each_rank_its_own_shard(tmp_path: Path) -> None:
    """Two MHA ranks of tp_size 2 over one file store, each pool holding its half of the
    heads: each rank stores its shard under its own keys and reads back only its own; for
    the same history both lookups agree; when one rank lost a page, SGLang's intersection of
    the lookups restores only the prefix both hold, on each rank bitwise its own shard."""
    rng = random.Random(21)
    keys = hashes(4, "tp2")
    src = rng.sample(range(1, PAGES), 4)
    dst = rng.sample(range(1, PAGES), 4)
    pools = [make_pool(), make_pool()]
    for rank, pool in enumerate(pools):
        fill(pool, src, seed=21 + rank)
    want = [read(pool, src) for pool in pools]
    assert not torch.equal(want[0], want[1])
    ranks = [make_linker(pools[r], extra(tmp_path), tp=(r, 2)) for r in (0, 1)]
    try:
        assert ranks[0].root == ranks[1].root              # one chain; the rank is in the key
        for linker in ranks:
            assert offload(linker, src, keys)
        hits = [linker.lookup("q", lookup_keys(keys)) for linker in ranks]
        assert hits == [[1, 2, 3, 4]] * 2
        assert tree_hit_pages(hits, 4) == [4, 4]
        # rank 1 loses its shard of page 2 (rank 0's, under its own key, stays)
        kv_key = linker_key(ranks[1].root, keys[2])
        assert ranks[1].executor.store.delete([kv_key]) == 1
        assert ranks[0].executor.store.batch_exists([linker_key(ranks[0].root, k)
                                                     for k in keys]) == 4
    finally:
        for linker in ranks:
            linker.close()
    # both ranks restarted (empty L2): everything comes from the store
    pools2 = [make_pool(), make_pool()]
    fresh = [make_linker(pools2[r], extra(tmp_path), tp=(r, 2)) for r in (0, 1)]
    try:
        hits = [linker.lookup("r", lookup_keys(keys)) for linker in fresh]
        assert hits == [[1, 2, 3, 4], [1, 2]]
        common = tree_hit_pages(hits, 4)
        assert common == [2, 2]
        for rank, (pool, linker) in enumerate(zip(pools2, fresh)):
            zero(pool, dst)
            assert run_load(pool, linker, "r", dst[:2], keys[:2])
            assert torch.equal(read(pool, dst[:2]), read(pools[rank], src[:2])), \
                f"rank {rank} did not restore its own shard"
            assert not read(pool, dst[2:]).any(), "pages past the common prefix loaded"
            assert linker.planner.metrics()["l3_hit_pages"] == 2
            assert not linker.planner.pending_plans()
    finally:
        for linker in fresh:
            linker.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_linker_mla_rank0_single_writer(tmp_path: Path, policy: str) -> None:
    """MLA over tp_size 2: the latent is the same on every rank, so rank 1 backs pages up to
    its L2 but writes nothing to L3 (write-through writes, or write-back ones as its small L2
    evicts); rank 0 writes one object per page; a restarted rank 1 loads them bitwise."""
    rng = random.Random(31)
    keys = hashes(6, "mla-" + policy)
    src = rng.sample(range(1, PAGES), 6)
    dst = rng.sample(range(1, PAGES), 6)
    pools = [make_pool("mla"), make_pool("mla")]
    fill(pools[0], src, seed=31)
    fill(pools[1], src, seed=31)                             # the same latent on both ranks
    cfg = extra(tmp_path, write_policy=policy, host_pool_pages=3)
    ranks = [make_linker(pools[r], cfg, tp=(r, 2)) for r in (0, 1)]
    planned: list[int] = []
    plan_save = ranks[1].planner.plan_save

    def counted(*args: Any, **kw: Any) -> Any:
        plan = plan_save(*args, **kw)
        planned.append(len(plan.l3_writes))
        return plan

    ranks[1].planner.plan_save = counted
    store_keys = [linker_key(ranks[0].root, k) for k in keys]
    try:
        assert ranks[0].root == ranks[1].root
        for i in range(0, 6, 2):                              # three offloads of two pages
            assert offload(ranks[1], src[i:i + 2], keys[i:i + 2])
        ranks[1].executor.wait_idle(10)
        assert sum(planned) > 0, "rank 1's planner planned no L3 write: nothing was tested"
        store = ranks[1].executor.store
        written = [k for k in store_keys if store.batch_exists([k])]
        assert not written, f"rank 1 wrote {len(written)} MLA pages to L3"
        assert not ranks[1].planner.pending_plans()
        ranks[1].planner.check()
        for i in range(0, 6, 2):
            assert offload(ranks[0], src[i:i + 2], keys[i:i + 2])
        ranks[0].executor.wait_idle(10)
        stored = store.batch_exists(store_keys)          # leading pages rank 0 wrote
        assert stored == 6 if policy == "write_through" else stored >= 2
    finally:
        for linker in ranks:
            linker.close()
    pool1 = make_pool("mla")
    fresh = make_linker(pool1, extra(tmp_path), tp=(1, 2))
    try:
        assert fresh.lookup("r", lookup_keys(keys)) == list(range(1, stored + 1))
        zero(pool1, dst)
        assert run_load(pool1, fresh, "r", dst[:stored], keys[:stored])
        assert torch.equal(read(pool1, dst[:stored]), read(pools[0], src[:stored]))
        assert fresh.planner.metrics()["l3_hit_pages"] == stored
    finally:
        fresh.close()
