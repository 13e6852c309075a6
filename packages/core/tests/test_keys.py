import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import ConfigError, KVSpec, PageKeyer, TokensError
from kvtier.keys import reference_keys, tokens_to_array

SPEC = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), page=st.integers(1, 7))
def test_keys_match_the_plain_reference(tokens, page):
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=page)
    k = PageKeyer(model_id="m", spec=spec)
    assert k.keys(tokens) == reference_keys(k.namespace, tokens, page)
    assert len(k.keys(tokens)) == len(tokens) // page


def test_chain_is_prefix_stable_and_continuable():
    k = PageKeyer(model_id="m", spec=SPEC)
    toks = list(np.random.default_rng(0).integers(0, 50000, 37))
    full = k.keys(toks)
    assert k.keys(toks[:20]) == full[:5]
    assert k.keys(toks[20:36], prev=full[4]) == full[5:9]
    other = toks.copy()
    other[9] += 1                       # change a token in page 2
    diverged = k.keys(other)
    assert diverged[:2] == full[:2] and all(a != b for a, b in zip(diverged[2:], full[2:]))


def test_input_types_agree():
    k = PageKeyer(model_id="m", spec=SPEC)
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    want = k.keys(toks)
    assert k.keys(tuple(toks)) == want
    assert k.keys(np.array(toks, dtype=np.int32)) == want
    assert k.keys(np.array(toks, dtype=np.uint64)) == want
    assert k.keys(torch.tensor(toks)) == want


@pytest.mark.parametrize("field, a, b", [
    ("model_id", "llama-8b", "llama-70b"), ("tp_rank", 0, 1), ("salt", "", "lora-a"),
])
def test_namespace_separates(field, a, b):
    base = dict(model_id="m", spec=SPEC, tp_rank=0, tp_size=2, salt="")
    ka = PageKeyer(**{**base, field: a})
    kb = PageKeyer(**{**base, field: b})
    toks = list(range(16))
    assert set(ka.keys(toks)).isdisjoint(kb.keys(toks))


def test_namespace_separates_spec_and_tp_size():
    toks = list(range(16))
    a = PageKeyer(model_id="m", spec=SPEC).keys(toks)
    other_spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4,
                            dtype="float16")
    assert set(a).isdisjoint(PageKeyer(model_id="m", spec=other_spec).keys(toks))
    assert set(a).isdisjoint(PageKeyer(model_id="m", spec=SPEC, tp_size=2).keys(toks))


@pytest.mark.parametrize("bad", [
    "hello", b"\x01\x02", None, [1.5, 2.0], [[1, 2], [3, 4]], [-1, 2], [2**32],
    torch.tensor([1.0, 2.0]), np.array([True, False]), [1, "2"],
])
def test_bad_tokens_are_typed_errors(bad):
    k = PageKeyer(model_id="m", spec=SPEC)
    with pytest.raises(TokensError):
        k.keys(bad)


@pytest.mark.parametrize("kwargs", [
    dict(model_id=""), dict(model_id=3), dict(tp_rank=2, tp_size=2), dict(tp_size=0),
    dict(tp_rank=-1), dict(salt=5), dict(tp_rank=True),
])
def test_bad_namespace_is_config_error(kwargs):
    base = dict(model_id="m", spec=SPEC)
    with pytest.raises(ConfigError):
        PageKeyer(**{**base, **kwargs})


def test_bad_prev_and_short_inputs():
    k = PageKeyer(model_id="m", spec=SPEC)
    assert k.keys([1, 2, 3]) == []
    assert k.keys([]) == []
    with pytest.raises(TokensError):
        k.keys([1, 2, 3, 4], prev=b"short")
    assert tokens_to_array([]).dtype == np.dtype("<u4")


def _native():
    try:
        import kvtier_native_keys
    except ImportError:
        return None
    return kvtier_native_keys


needs_native = pytest.mark.skipif(_native() is None, reason="kvtier-native-keys is not installed "
                                  "(pip install 'kvtier-core[native-keys]'): only the Python "
                                  "loop is tested")


def test_implementation_follows_the_package_and_the_switch(monkeypatch):
    from kvtier.keys import NATIVE_KEYS_ENV
    native = _native()
    expect = "native" if native is not None and "sha256" in native.CHAINS else "python"
    assert PageKeyer(model_id="m", spec=SPEC).implementation == expect
    assert PageKeyer(model_id="m", spec=SPEC, hash="blake2b").implementation == "python"
    monkeypatch.setenv(NATIVE_KEYS_ENV, "0")
    assert PageKeyer(model_id="m", spec=SPEC).implementation == "python"


@needs_native
@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(1, 2**32 - 1), max_size=60), page=st.sampled_from(
    [1, 2, 3, 5, 17, 64]), model_id=st.text(min_size=1, max_size=12),
    cut=st.integers(0, 10))
def test_native_and_python_loop_give_the_same_keys(tokens, page, model_id, cut):
    import os
    from kvtier.keys import NATIVE_KEYS_ENV
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=page)
    for name in _native().CHAINS:
        native = PageKeyer(model_id=model_id, spec=spec, hash=name)
        os.environ[NATIVE_KEYS_ENV] = "0"
        try:
            python = PageKeyer(model_id=model_id, spec=spec, hash=name)
        finally:
            del os.environ[NATIVE_KEYS_ENV]
        assert (native.implementation, python.implementation) == ("native", "python")
        keys = native.keys(tokens)
        assert keys == python.keys(tokens) == reference_keys(native.namespace, tokens, page,
                                                             name)
        if 0 < cut <= len(keys):
            rest = tokens[cut * page:]
            assert native.keys(rest, prev=keys[cut - 1]) == keys[cut:] \
                == python.keys(rest, prev=keys[cut - 1])
