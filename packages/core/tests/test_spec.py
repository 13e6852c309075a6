import pytest
import torch

from kvtier import KVSpec, SpecError
from kvtier.config import build_config
from kvtier.errors import ConfigError


def test_mha_sizes():
    s = KVSpec.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64, dtype="bf16")
    assert s.dtype == "bfloat16" and s.torch_dtype == torch.bfloat16
    assert s.num_components == 2 and s.row_shape == (8, 128)
    assert s.row_bytes == 8 * 128 * 2
    assert s.chunk_bytes == 64 * 2048
    assert s.page_bytes == 32 * 2 * 64 * 2048


def test_mla_sizes():
    s = KVSpec.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=1, dtype="bfloat16")
    assert s.num_components == 1 and s.row_shape == (1, 576)
    assert s.row_bytes == 1152            # the DeepSeek MLA row
    assert s.page_bytes == 61 * 1152


def test_fingerprint_stable_and_distinct():
    a = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    b = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16,
                   dtype=torch.bfloat16)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16
    others = [KVSpec.mha(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16),
              KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=32),
              KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16,
                         dtype="float16"),
              KVSpec.mla(num_layers=2, kv_lora_rank=128, rope_dim=0, page_size=16)]
    fps = {o.fingerprint for o in others}
    assert len(fps) == len(others) and a.fingerprint not in fps
    # the fingerprint is a pure function of the geometry (golden value: changing it
    # silently would orphan every stored object)
    assert a.fingerprint == KVSpec.from_dict(a.to_dict()).fingerprint


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_layers=0, page_size=16, num_kv_heads=1, head_dim=8), "num_layers"),
    (dict(num_layers=-2, page_size=16, num_kv_heads=1, head_dim=8), "num_layers"),
    (dict(num_layers=2, page_size=0, num_kv_heads=1, head_dim=8), "page_size"),
    (dict(num_layers=2, page_size=16, num_kv_heads=0, head_dim=8), "num_kv_heads"),
    (dict(num_layers=2, page_size=16, num_kv_heads=1, head_dim=8.0), "head_dim"),
    (dict(num_layers=True, page_size=16, num_kv_heads=1, head_dim=8), "num_layers"),
    (dict(num_layers=2, page_size=16, num_kv_heads=1, head_dim=8, dtype="float13"), "dtype"),
    (dict(num_layers=2, page_size=16, kind="gqa", num_kv_heads=1, head_dim=8), "kind"),
    (dict(num_layers=2, page_size=16, kind="mla", kv_lora_rank=0), "kv_lora_rank"),
    (dict(num_layers=2, page_size=16, kind="mla", kv_lora_rank=8, rope_dim=-1), "rope_dim"),
    (dict(num_layers=2, page_size=16, kind="mla", kv_lora_rank=8, head_dim=4), "head_dim"),
    (dict(num_layers=2, page_size=16, num_kv_heads=1, head_dim=8, rope_dim=2), "rope_dim"),
])
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(SpecError) as ei:
        KVSpec(**kwargs)
    assert ei.value.field == field
    assert field in str(ei.value) or repr(ei.value.value) in str(ei.value)


def test_from_dict_rejects_unknown_key():
    with pytest.raises(ConfigError) as ei:
        KVSpec.from_dict({"num_layers": 2, "page_size": 4, "num_kv_heads": 1, "head_dim": 8,
                          "heads": 3})
    assert "heads" in str(ei.value) and ei.value.key == "spec.heads"


def test_from_dict_rejects_wrong_type():
    with pytest.raises(ConfigError):
        build_config(KVSpec, {"num_layers": "2", "page_size": 4, "num_kv_heads": 1,
                              "head_dim": 8}, section="spec")
