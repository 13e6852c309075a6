"""The demo model's prefills: restored-prefix prefill vs full recompute (paged: bitwise;
fast: within the tolerance), RoPE offsets, layer-by-layer overlap with the loads."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers")

from kvtier import DeviceKVPool  # noqa: E402
from kvtier_tools.demo.model import DemoModel, default_tolerance  # noqa: E402
from kvtier.errors import ConfigError, InvalidArgumentError  # noqa: E402

PS = 16


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return DemoModel("tiny", page_size=PS, seed=1)


def _tokens(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return model.as_tokens(torch.randint(0, model.vocab_size, (n,), generator=g))


def _plain_forward(model, tokens):
    """One unchunked forward over all tokens: logits of the last token and per-layer K, V."""
    with torch.inference_mode():
        out = model.model(input_ids=tokens[None], use_cache=True)
    kv = [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
          for layer in out.cache.layers]
    return out.logits[0, -1], kv


def test_spec_matches_the_model(model):
    s = model.spec
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.page_size, s.dtype) == \
        (2, 2, 16, PS, "float32")
    assert model.size.kv_heads < model.size.heads           # grouped-query attention
    assert model.tolerance == 0.0 == default_tolerance(torch.device("cpu"), torch.float32)
    again = DemoModel("tiny", page_size=PS, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.model.parameters(),
                                                   again.model.parameters()))


@pytest.mark.parametrize("n, restored", [(100, 3), (96, 5), (97, 6), (40, 1), (33, 2)])
def test_prefill_on_restored_pages_is_bitwise_the_full_recompute(model, n, restored):
    pool = DeviceKVPool.empty(model.spec, 32)
    toks = _tokens(model, n, seed=n)
    first = list(range(31, 31 - n // PS, -1))                  # scattered pages, reversed
    logits = model.prefill(toks, pool, [], first, mode="paged")
    assert model.check_restored(toks, logits, pool, first).exact
    # a later request restores `restored` pages and computes the rest into other pages
    more = torch.cat([toks, _tokens(model, 21, seed=7)])
    new = list(range(len(more) // PS - restored))
    pages = first[:restored] + new
    logits2 = model.prefill(more, pool, first[:restored], new, mode="paged")
    res = model.check_restored(more, logits2, pool, pages)
    assert res.exact and res.passed and res.kv_pages_differing == 0
    assert res.logits_max_abs_diff == 0.0 == res.kv_max_abs_diff


def test_rope_positions_continue_after_the_restored_prefix(model):
    pool = DeviceKVPool.empty(model.spec, 16)
    toks = _tokens(model, 150, seed=3)
    model.prefill(toks[:96], pool, [], list(range(6)), mode="paged")
    logits = model.prefill(toks, pool, list(range(4)), list(range(8, 13)), mode="paged")
    ref_logits, ref_kv = _plain_forward(model, toks)
    # chunking changes rounding, not results: close to one plain forward of all tokens
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-4)
    pages = list(range(4)) + list(range(8, 13))
    slots = torch.tensor([p * PS + i for p in pages for i in range(PS)])
    for layer, (k, v) in enumerate(ref_kv):
        assert torch.allclose(pool.layers[0][layer][slots], k[:len(slots)], atol=1e-5)
        assert torch.allclose(pool.layers[1][layer][slots], v[:len(slots)], atol=1e-5)
    # the same suffix computed at positions starting from 0 gives other keys: the
    # comparison above would catch a wrong RoPE offset
    from transformers import DynamicCache
    with torch.inference_mode():
        out = model.model(input_ids=toks[None, 64:80], cache=DynamicCache(), use_cache=True)
    wrong_k = out.cache.layers[0].keys[0].transpose(0, 1)
    assert not torch.allclose(wrong_k, ref_kv[0][0][64:80], atol=1e-3)


def test_check_catches_one_flipped_bit(model):
    pool = DeviceKVPool.empty(model.spec, 8)
    toks = _tokens(model, 70, seed=5)
    logits = model.prefill(toks, pool, [], [0, 1, 2, 3], mode="paged")
    pool.layers[1][1][2 * PS + 3].view(torch.uint8).view(-1)[5] ^= 0x10
    res = model.check_restored(toks, logits, pool, [0, 1, 2, 3])
    assert not res.exact and not res.passed and res.kv_pages_differing == 1
    logits = logits.clone()
    logits[7] = torch.nextafter(logits[7], torch.tensor(1e9))
    assert model.check_restored(toks, logits, pool, [0, 1, 2, 3]).logits_max_abs_diff > 0


def test_bad_arguments(model):
    pool = DeviceKVPool.empty(model.spec, 8)
    toks = _tokens(model, 32, seed=1)
    with pytest.raises(InvalidArgumentError, match="nothing of 32 tokens"):
        model.prefill(toks, pool, [0, 1], [])
    with pytest.raises(InvalidArgumentError, match="full pages"):
        model.prefill(toks, pool, [0], [])
    with pytest.raises(InvalidArgumentError):
        model.as_tokens([])
    with pytest.raises(ConfigError, match="model size"):
        DemoModel("huge")
    with pytest.raises(InvalidArgumentError, match="mode"):
        model.prefill(toks, pool, [], [0, 1], mode="eager")
    with pytest.raises(ConfigError, match="max_forward_tokens"):
        DemoModel("tiny", max_forward_tokens=0)


@pytest.mark.parametrize("n, restored, chunk", [(100, 3, 8192), (97, 6, 8192), (150, 2, 40),
                                                (33, 2, 1)])
def test_fast_prefill_on_restored_pages_matches_a_full_recompute(n, restored, chunk):
    model = DemoModel("tiny", page_size=PS, seed=1, max_forward_tokens=chunk)
    pool = DeviceKVPool.empty(model.spec, 32)
    toks = _tokens(model, n, seed=n)
    first = list(range(31, 31 - n // PS, -1))
    model.prefill(toks, pool, [], first)
    more = torch.cat([toks, _tokens(model, 21, seed=7)])
    new = list(range(len(more) // PS - restored))
    logits = model.prefill(more, pool, first[:restored], new)
    res = model.check_logits(more, logits)
    assert res.passed and res.same_token and res.tolerance == model.fast_tolerance == 1e-4
    assert res.logits_max_abs_diff <= 1e-4 * max(1.0, float(logits.abs().max()))
    ref_logits, ref_kv = _plain_forward(model, more)
    assert int(logits.argmax()) == int(ref_logits.argmax())
    slots = torch.tensor([p * PS + i for p in first[:restored] + new for i in range(PS)])
    for layer, (k, v) in enumerate(ref_kv):        # the new pages hold the right KV
        assert torch.allclose(pool.layers[0][layer][slots], k[:len(slots)], atol=1e-5)
        assert torch.allclose(pool.layers[1][layer][slots], v[:len(slots)], atol=1e-5)


def test_check_logits_measures_the_noise_of_a_split_recompute():
    """With the prefix length given, the check recomputes twice (whole, and split where the
    prefix ends) and reports how far those two differ; wrong logits still fail."""
    from transformers import DynamicCache
    model = DemoModel("tiny", page_size=PS, seed=3)
    pool = DeviceKVPool.empty(model.spec, 16)
    toks = _tokens(model, 90, seed=4)
    first = [9, 8, 7, 6, 5][:len(toks) // PS]
    model.prefill(toks[:3 * PS], pool, [], first[:3])
    logits = model.prefill(toks, pool, first[:3], first[3:len(toks) // PS])
    res = model.check_logits(toks, logits, 3 * PS)
    with torch.inference_mode():
        ref = model._chunks(toks, DynamicCache(), 0, explicit_positions=False,
                            chunk=model.max_forward_tokens)
        cache = DynamicCache()
        model._chunks(toks[:3 * PS], cache, 0, explicit_positions=True)
        split = model._chunks(toks, cache, 3 * PS, explicit_positions=True,
                              chunk=model.max_forward_tokens)
    assert res.passed
    if res.exact:
        assert res.noise_max_abs_diff == 0.0
    else:
        assert res.noise_max_abs_diff == float((split.double() - ref.double()).abs().max())
    bad = logits.clone()
    bad[1] += 0.5 + 4 * res.noise_max_abs_diff
    assert not model.check_logits(toks, bad, 3 * PS).passed


def test_check_logits_fails_on_wrong_logits(model):
    pool = DeviceKVPool.empty(model.spec, 8)
    toks = _tokens(model, 70, seed=5)
    logits = model.prefill(toks, pool, [], [0, 1, 2, 3])
    assert model.check_logits(toks, logits).passed
    bad = logits.clone()
    bad[3] += 0.5                                   # far above the tolerance
    assert not model.check_logits(toks, bad).passed
    other = logits.clone()                          # another first token
    other[int(logits.argmin())] = float(logits.max()) + 1e-3
    res = model.check_logits(toks, other)
    assert not res.same_token and not res.passed


def test_layer_i_runs_before_layer_i_plus_1_of_the_prefix_lands():
    """A slow fake load: layer i lands only when the model asks for it. The prefill asks for
    layer i just before running decoder layer i, and runs layer i before asking for i + 1."""
    model = DemoModel("small", page_size=PS, seed=2)
    pool = DeviceKVPool.empty(model.spec, 16)
    toks = _tokens(model, 100, seed=9)
    model.prefill(toks[:80], pool, [], list(range(5)))
    # the same prefill with the pages in place at once, for the reference logits
    ref = model.prefill(toks, pool, list(range(3)), [8, 9, 10])
    events: list[tuple[str, int]] = []
    landed: set[int] = set()
    hooks = []
    for i, layer in enumerate(model.model.model.layers):
        def probe(module, args, i=i):
            # the layer's past K/V must be in place by the time it runs
            assert i in landed, f"layer {i} ran before its prefix landed"
            events.append(("run", i))
        hooks.append(layer.register_forward_pre_hook(probe))

    def slow_wait_layer(i: int) -> None:
        time.sleep(0.02)                            # this layer's copy takes a while
        landed.add(i)
        events.append(("landed", i))

    try:
        got = model.prefill(toks, pool, list(range(3)), [8, 9, 10],
                            wait_layer=slow_wait_layer)
    finally:
        for h in hooks:
            h.remove()
    layers = model.size.layers
    assert events == [e for i in range(layers) for e in (("landed", i), ("run", i))]
    assert torch.equal(got, ref)


@pytest.mark.parametrize("how", ["blocks", "lower_right"])
@pytest.mark.parametrize("q_len, kv_len", [(40, 100), (16, 16), (1, 9), (33, 33 + 64)])
def test_attention_after_a_prefix_is_causal_sdpa(monkeypatch, how, q_len, kv_len):
    """Queries after a prefix, attended in blocks (the upper triangle skipped) or in one
    bottom-right causal SDPA (what accelerators run), with grouped KV heads: the same as one
    SDPA over all keys with the bottom-right causal mask as an explicit boolean mask."""
    from kvtier_tools.demo import model as mod
    monkeypatch.setattr(mod, "ATTENTION_BLOCK_CPU", 16)
    monkeypatch.setattr(mod, "PREFIX_ATTENTION", how)
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(1, 4, q_len, 8, generator=g)
    k = torch.randn(1, 2, kv_len, 8, generator=g)
    v = torch.randn(1, 2, kv_len, 8, generator=g)

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2
        scaling = 8 ** -0.5
    out, _ = mod._attention(Layer(), q, k, v, None, scaling=8 ** -0.5, dropout=0.0)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask,
        scale=8 ** -0.5)
    assert out.shape == (1, q_len, 4, 8)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
