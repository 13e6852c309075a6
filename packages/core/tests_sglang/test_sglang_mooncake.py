"""The adapter over kvtier's ``mooncake`` store: a real mooncake_master on loopback (the core
tests' fixtures), SGLang's host pools and page keys. Skipped where the Mooncake client cannot
load (its probe's reason)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import (PoolCase, attach, extra_config, make_pools, page_bytes, page_indices,
                      random_tokens, storage_config)

from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import fill_random

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
from mooncake_fixtures import mooncake_master, mooncake_netns  # noqa: E402,F401  (fixtures)

CASES = [
    PoolCase("mha", "page_first", torch.bfloat16, 5, 3, heads=2, head_dim=24),   # K, V runs
    PoolCase("mla", "page_first", torch.bfloat16, 7, 3, kv_lora_rank=48, rope=8),  # one run
    PoolCase("mha", "layer_first", torch.float16, 3, 2, heads=1, head_dim=16),
]


@pytest.mark.usefixtures("mooncake_master")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_mooncake_roundtrip_through_the_adapter(case, tmp_path):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvtier.l3_stores.mooncake import MooncakeStore
    _, host = make_pools(case)
    cfg = storage_config(extra_config("mooncake", MooncakeStore.example_config(str(tmp_path))),
                         mla=case.kind == "mla", layout=case.layout)
    b = attach(host, cfg)
    try:
        rng = random.Random(21)
        n = 4
        src = rng.sample(range(host.page_num), n)
        dst = rng.sample([p for p in range(host.page_num) if p not in src], n)
        keys = get_storage_hash_str(random_tokens(n * host.page_size, 22), None,
                                    page_size=host.page_size)
        want = [page_bytes(host, p) for p in src]
        assert b.batch_set_v1(keys, page_indices(host, src)) == [True] * n
        fill_random(host.kv_buffer)
        assert b.batch_exists(keys) == n
        assert b.batch_get_v1(keys, page_indices(host, dst)) == [True] * n
        for i, p in enumerate(dst):
            assert_bitwise_equal(page_bytes(host, p), want[i], f"key {i} in host page {p}")
        assert b.stats()["errors"] == 0
        assert b.clear() is True
        assert b.batch_exists(keys) == 0
    finally:
        b.close()
