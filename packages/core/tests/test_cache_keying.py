"""One keyer for every path: `TieredKVCache`, `CachePlanner` and `make_keyer` give the same
namespace and keys for one `CacheConfig`, whatever it sets; an L3 written by the in-process
cache is read by the two halves (planner + executor) of the same config, bitwise, and not by a
config or engine identity that differs. Tensor-parallel ranks share the chain and keep their
objects apart in the store."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, CachePlanner, TieredKVCache
from kvtier.cache.keying import make_keyer, rank_key
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.host_pool import HostKVPool
from kvtier.l3_stores.memory import MemoryStore
from kvtier.page_allocator import PageAllocator
from kvtier.testing import fill_random
from kvtier.transfer_engines.torch_engine import TorchTransferEngine

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=24, page_size=5, dtype="bfloat16")

CONFIGS = [
    {"model_id": "m"},
    {"model_id": "m", "salt": "tenant-a", "model_revision": "r2", "rope": "theta=5e5"},
    {"model_id": "m", "key_hash": "blake2b", "host_layout": "layer_first"},
    {"model_id": "m", "tp_size": 4, "tp_rank": 3, "pp_size": 2, "pp_rank": 1},
]
ENGINES = [None, {"dtype": "bfloat16", "kv_cache_dtype": "auto", "rope": {"theta": 1e6}}]


def tokens(seed: int, pages: int = 6) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 50000) for _ in range(pages * SPEC.page_size + 3)]


def page_rows(dpool: DeviceKVPool, d: int) -> list[torch.Tensor]:
    """Views of device page ``d`` in every layer's K and V (token-major rows)."""
    ps = dpool.spec.page_size
    return [t[d * ps:(d + 1) * ps] for comp in dpool.layers for t in comp]


def page_bytes(dpool: DeviceKVPool, d: int) -> torch.Tensor:
    return torch.cat([r.reshape(-1).view(torch.uint8) for r in page_rows(dpool, d)]).clone()


def _cache(cfg, dpool, store=None, engine=None):
    alloc = PageAllocator(dpool.num_pages)
    return TieredKVCache.from_config({"host_pool_pages": 8, **cfg}, device_pool=dpool,
                                     store=store, engine_identity=engine,
                                     allocate_device_pages=alloc.alloc,
                                     free_device_pages=alloc.free), alloc


@pytest.mark.parametrize("engine", ENGINES, ids=["config-only", "engine-fields"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "salted", "blake2b", "tp-pp"])
def test_every_path_makes_the_same_keys(cfg, engine):
    dpool = DeviceKVPool.empty(SPEC, 8)
    cache, _ = _cache(cfg, dpool, engine=engine)
    planner = CachePlanner(cfg, spec=SPEC, device_layout=dpool.page_order,
                           num_host_pages=8, engine_identity=engine)
    from kvtier.cache import CacheConfig
    keyer = make_keyer(CacheConfig.from_dict(cfg), SPEC, device_layout=dpool.page_order,
                       engine=engine)
    assert cache.keyer.namespace == planner.keyer.namespace == keyer.namespace
    toks = tokens(1)
    assert cache.keys(toks) == planner.keys(toks) == keyer.keys(toks)
    if cfg.get("key_hash"):
        assert keyer.hash_name == cfg["key_hash"]
    cache.close()


@pytest.mark.parametrize("change", [{"salt": "x"}, {"model_revision": "r9"},
                                    {"key_hash": "blake2b"}, {"tp_size": 2},
                                    {"host_layout": "layer_first"}, {"pp_size": 2}],
                         ids=lambda c: next(iter(c)))
def test_what_changes_bytes_or_their_meaning_changes_the_namespace(change):
    from kvtier.cache import CacheConfig
    base = CacheConfig.from_dict({"model_id": "m"})
    other = CacheConfig.from_dict({"model_id": "m", **change})
    a = make_keyer(base, SPEC, device_layout="nhd")
    assert make_keyer(other, SPEC, device_layout="nhd").namespace != a.namespace
    assert make_keyer(base, SPEC, device_layout="hnd").namespace != a.namespace
    assert make_keyer(base, SPEC, device_layout="nhd",
                      engine={"kv_cache_dtype": "fp8"}).namespace != a.namespace


def test_planner_needs_the_device_layout():
    with pytest.raises(InvalidArgumentError, match="device_layout"):
        CachePlanner({"model_id": "m"}, spec=SPEC, device_layout="", num_host_pages=4)


def _fill(cache: TieredKVCache, alloc: PageAllocator, dpool: DeviceKVPool, toks):
    """The engine computes ``toks``; their pages go down to L3. Returns each page's bytes."""
    m = cache.match(toks)
    pages = alloc.alloc(len(m.keys))
    for d in pages:
        for rows in page_rows(dpool, d):
            fill_random(rows)
    want = [page_bytes(dpool, d) for d in pages]
    cache.commit(toks, pages, match=m)
    alloc.free(cache.release(m))
    assert cache.wait_idle(20)
    return want


@pytest.mark.parametrize("engine", ENGINES, ids=["config-only", "engine-fields"])
def test_the_in_process_cache_l3_is_read_by_the_two_halves_of_the_same_config(engine):
    cfg = {"model_id": "m", "salt": "s", "tp_size": 2, "tp_rank": 1}
    store = MemoryStore(spec=SPEC)
    dpool = DeviceKVPool.empty(SPEC, 8)
    cache, alloc = _cache(cfg, dpool, store=store, engine=engine)
    toks = tokens(2, pages=4)
    want = _fill(cache, alloc, dpool, toks)
    cache.close()
    keys = cache.keys(toks)
    # rank 1's objects are stored under its rank key: another rank sees none of them
    assert store.batch_exists([rank_key(k, 1, 2) for k in keys]) == 4
    assert store.batch_exists(keys) == 0 and store.batch_exists(
        [rank_key(k, 0, 2) for k in keys]) == 0

    # the two halves of the same config, another device pool, a fresh host pool
    dpool2 = DeviceKVPool.empty(SPEC, 8)
    host = HostKVPool(SPEC, 8, allocator=TorchPinnedAllocator())
    view = _rank_view(store, 1, 2)
    view.attach(host)
    ex = CacheExecutor(host_pool=host, engine=TorchTransferEngine(dpool2, host), store=view)
    pl = CachePlanner(cfg, spec=SPEC, device_layout=dpool2.page_order, num_host_pages=8,
                      engine_identity=engine,
                      l3_exists=lambda ks: store.batch_exists([rank_key(k, 1, 2) for k in ks]))
    hit = pl.lookup(pl.keys(toks))
    assert (hit.l2_pages, hit.l3_pages) == (0, 4)
    plan = pl.plan_load(pl.keys(toks), [7, 2, 5, 0])
    ex.submit(plan)
    assert ex.wait(plan.plan_id, 20)
    (res,) = ex.poll()
    assert res.loaded_prefix == 4
    pl.complete(res)
    for d, w in zip([7, 2, 5, 0], want):
        assert torch.equal(page_bytes(dpool2, d), w)
    ex.close()

    # a config or an engine identity that differs finds nothing
    for other_cfg, other_engine in (({**cfg, "salt": "t"}, engine),
                                    (cfg, {"kv_cache_dtype": "fp8"})):
        pl2 = CachePlanner(other_cfg, spec=SPEC, device_layout=dpool2.page_order,
                           num_host_pages=8, engine_identity=other_engine,
                           l3_exists=lambda ks: store.batch_exists(
                               [rank_key(k, 1, 2) for k in ks]))
        assert pl2.lookup(pl2.keys(toks)).l3_pages == 0


def _rank_view(store, rank, size):
    from kvtier.cache.keying import RankKeyStore
    return RankKeyStore(store, rank, size)


def test_kv_dtype_and_attention_kind_are_in_every_key():
    """A page of another KV dtype (fp8 included) or another attention kind (MLA's latent
    against K and V) never shares a key, even where the row sizes agree."""
    from kvtier.cache import CacheConfig
    cfg = CacheConfig.from_dict({"model_id": "m"})
    mha = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=288, page_size=5, dtype="bfloat16")
    specs = [mha,
             KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=288, page_size=5,
                        dtype="float8_e4m3fn"),
             KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=5),
             KVSpec.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, page_size=5,
                        dtype="float8_e4m3fn"),
             KVSpec.mla(num_layers=2, kv_lora_rank=448, rope_dim=128, page_size=5)]
    toks = tokens(4, pages=2)
    keys = [tuple(make_keyer(cfg, s, device_layout="nhd").keys(toks)) for s in specs]
    assert len(set(keys)) == len(specs)
