"""The demo's MLA sizes (transformers' DeepSeek-V2, random weights): the latent its cache holds
is what the tiers store and restore, bit for bit, and a prefill on a restored latent prefix
equals a full recompute (paged: bitwise; fast: within the logits tolerance)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvtier.cli import main  # noqa: E402
from kvtier_tools.demo.engine import DemoEngine  # noqa: E402
from kvtier_tools.demo.model import CheckFailedError, DemoModel  # noqa: E402
from kvtier_tools.demo.run import DemoConfig, run_demo  # noqa: E402
from kvtier_tools.demo.workload import Request  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402

PS = 16


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return DemoModel("mla-tiny", page_size=PS, seed=1)


def _tokens(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return model.as_tokens(torch.randint(0, model.vocab_size, (n,), generator=g))


def test_the_pool_holds_the_latent_deepseek_v2_caches(model):
    """transformers' DeepSeek-V2 caches the normalised kv_a_proj output and the rope'd k_pe
    (not per-head K/V): one 32 + 16 row per token and layer, as the mla spec says."""
    s = model.spec
    assert (s.kind, s.num_layers, s.kv_lora_rank, s.rope_dim, s.dim) == ("mla", 2, 32, 16, 48)
    assert s.page_bytes == 2 * PS * 48 * 4 and model.mla and model.family == "deepseek-v2"
    assert model.new_pool(4).layout == "mla"
    attn = model.model.model.layers[0].self_attn
    assert attn.q_lora_rank is None and type(model.model.model.layers[1].mlp).__name__ == \
        "DeepseekV2MLP"                                     # dense: no MoE router
    toks = _tokens(model, 20, seed=2)
    with torch.inference_mode():
        out = model.model(input_ids=toks[None], use_cache=True)
        layer = out.cache.layers[0]
        assert layer.keys.shape == (1, 1, 20, 32) and layer.values.shape == (1, 1, 20, 16)
        h = model.model.model.layers[0].input_layernorm(model.model.model.embed_tokens(toks[None]))
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(h)[..., :32])
    assert torch.equal(layer.keys[0, 0], latent[0])


@pytest.mark.parametrize("n, restored", [(100, 3), (97, 6), (33, 2)])
def test_paged_prefill_on_a_restored_latent_is_bitwise_the_full_recompute(model, n, restored):
    pool = model.new_pool(32)
    toks = _tokens(model, n, seed=n)
    first = list(range(31, 31 - n // PS, -1))                  # scattered pages, reversed
    logits = model.prefill(toks, pool, [], first, mode="paged")
    assert model.check_restored(toks, logits, pool, first).exact
    more = torch.cat([toks, _tokens(model, 21, seed=7)])
    new = list(range(len(more) // PS - restored))
    logits2 = model.prefill(more, pool, first[:restored], new, mode="paged")
    res = model.check_restored(more, logits2, pool, first[:restored] + new)
    assert res.exact and res.passed and res.kv_pages_differing == 0 and res.tolerance == 0.0
    # a wrong latent bit in a page the check reads is caught
    pool.chunks[1][0][new[0], 8] ^= 0x04
    assert model.check_restored(more, logits2, pool, first[:restored] + new) \
        .kv_pages_differing == 1


@pytest.mark.parametrize("chunk", [8192, 40])
def test_fast_prefill_on_a_restored_latent_matches_a_full_recompute(chunk):
    model = DemoModel("mla-tiny", page_size=PS, seed=1, max_forward_tokens=chunk)
    pool = model.new_pool(16)
    toks = _tokens(model, 150, seed=3)
    model.prefill(toks[:96], pool, [], list(range(6)))
    logits = model.prefill(toks, pool, list(range(4)), list(range(8, 13)))
    res = model.check_logits(toks, logits, 4 * PS)
    assert res.passed and res.same_token and res.tolerance == 1e-4
    # the new pages hold the latent of a plain forward over all tokens
    with torch.inference_mode():
        out = model.model(input_ids=toks[None], use_cache=True)
    slots = torch.tensor([p * PS + i for p in list(range(4)) + list(range(8, 13))
                          for i in range(PS)])
    for i, layer in enumerate(out.cache.layers):
        ref = torch.cat((layer.keys[0, 0], layer.values[0, 0]), dim=-1)[:len(slots)]
        got = pool.chunks[i][0].view(torch.float32).view(-1, 48)[slots]
        assert torch.allclose(got, ref, atol=1e-5)


def test_a_latent_restored_from_l2_and_a_file_l3_is_bitwise_what_was_saved(model, tmp_path):
    """The real tiers: a page committed from L1 is backed up to L2 and written to a file L3;
    with L1 (then L2) evicted, the next request restores it from L2 (then L3), bit for bit,
    and its prefill on the restored latent is bitwise a full recompute."""
    cfg = {"model_id": "test-mla", "host_pool_pages": 16, "host_allocator": "mmap",
           "l3_store": "file", "l3_config": {"root": str(tmp_path)},
           "cost_aware_fetch": False}
    eng = DemoEngine(model, cfg, l1_pages=24, prefill_mode="paged")
    try:
        toks = _tokens(model, 120, seed=11).cpu().numpy()
        res = eng.serve(Request(0, 0, 0, toks[:70]), check=True)
        assert res.computed_tokens == 70 and res.check is not None and res.check.exact
        assert eng.cache.wait_idle(timeout=60)
        saved: dict[bytes, torch.Tensor] = {}

        def save() -> None:
            for k, (d, _) in eng.cache.pages().items():
                if d is not None:
                    saved[k] = eng.pool.page_bytes(d).clone()
        save()
        assert len(saved) == 4

        def restore(n: int, tier: str) -> None:
            eng.cache.evict(24)                                 # every page leaves L1
            if tier == "l3":
                eng.cache.evict(16, "l2")
            assert all(d is None for d, _ in eng.cache.pages().values())
            res = eng.serve(Request(0, 0, 0, toks[:n]), check=True)
            assert (res.l2_tokens if tier == "l2" else res.l3_tokens) == len(saved) * PS
            assert res.restored_checked == len(saved) and res.restored_bad == 0
            assert res.check is not None and res.check.exact      # logits and every page
            pages = eng.cache.pages()
            for k, b in saved.items():
                assert torch.equal(eng.pool.page_bytes(pages[k][0]), b), tier
            assert eng.cache.wait_idle(timeout=60)
            save()

        restore(90, "l2")                       # 4 pages from L2, page 5 computed
        restore(110, "l3")                      # those 5 from L3
        m = eng.cache.metrics()
        assert m["bytes_h2d"] >= 8 * model.spec.page_bytes and m["bytes_l3_read"] > 0
    finally:
        eng.close()


def test_kvtier_demo_mla_tiny_prints_the_report(tmp_path, capsys):
    rc = main(["demo", "--model-size", "mla-tiny", "--page-size", "16", "--clients", "2",
               "--rounds", "2", "--first-tokens", "192", "--turn-tokens", "32",
               "--answer-tokens", "16", "--l1-pages", "17", "--l2-pages", "20",
               "--check", "all", "--no-progress", "--no-plot", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "| L1+L2+L3" in out and "recompute tok/s" in out and "L3 read (file)" in out
    assert "DeepSeek-V2-mla-tiny" in err and "KV 384 B per token" in err
    # 5 setups x 4 requests: the load-all and the ideal setups are checked too
    assert "20 prefill(s) on restored KV matched a full recompute" in err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["model"]["kv_lora_rank"] == 32 and data["model"]["page_bytes"] == 16 * 384
    s = {r["setup"]: r for r in data["summary"]}
    assert s["L1+L2"]["l2_hit_pct"] > 0 and s["L1+L2+L3"]["l3_hit_pct"] > 0
    assert s["L1+L2+L3"]["restored_pages_checked"] > 0


def test_a_corrupted_latent_restore_is_caught():
    cfg = DemoConfig.from_dict(dict(
        model_size="mla-tiny", page_size=16, clients=2, rounds=2, first_tokens=192,
        turn_tokens=32, answer_tokens=16, l1_pages=17, l2_pages=20, threads=1,
        progress=False, plot=False, setups=("L1+L2",), check="none"))
    with pytest.raises(CheckFailedError, match="1 restored KV page"):
        run_demo(cfg, corrupt_restore=True, log=lambda *a: None)


def test_model_sizes_name_the_mla_shapes():
    with pytest.raises(ConfigError, match="mla-tiny"):
        DemoConfig.from_dict({"model_size": "mla-huge"})
    from kvtier_tools.demo.model import MODEL_SIZES, describe_sizes
    lite = MODEL_SIZES["mla-lite"]
    assert (lite.layers, lite.hidden, lite.kv_lora_rank, lite.rope_dim, lite.nope_dim,
            lite.v_dim, lite.heads) == (27, 2048, 512, 64, 128, 128, 16)
    # DeepSeek-V2-Lite's KV: 27 x 576 bf16 values = 31,104 B per token
    from kvtier_tools.demo.mla import LatentKV
    spec = LatentKV(lite).spec(lite.layers, 64, "bfloat16")
    assert spec.page_bytes // 64 == 27 * 576 * 2
    assert "mla-lite (DeepSeek-V2 MLA, 27 layers" in describe_sizes()


@pytest.mark.parametrize("how", ["blocks", "lower_right"])
@pytest.mark.parametrize("q_len, kv_len", [(40, 100), (33, 33)])
def test_attention_with_values_narrower_than_keys(monkeypatch, how, q_len, kv_len):
    """MLA's V (v_head_dim) is narrower than Q/K (nope + rope): padded for SDPA's fused
    kernels and cut back, the result is causal SDPA over the unpadded V."""
    from kvtier_tools.demo import model as mod
    monkeypatch.setattr(mod, "ATTENTION_BLOCK_CPU", 16)
    monkeypatch.setattr(mod, "PREFIX_ATTENTION", how)
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(1, 4, q_len, 24, generator=g)
    k = torch.randn(1, 4, kv_len, 24, generator=g)
    v = torch.randn(1, 4, kv_len, 16, generator=g)

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 1
        scaling = 24 ** -0.5
    out, _ = mod._attention(Layer(), q, k, v, None, scaling=24 ** -0.5, dropout=0.0)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           scale=24 ** -0.5)
    assert out.shape == (1, q_len, 4, 16) and out.is_contiguous()
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
