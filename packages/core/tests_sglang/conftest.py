"""Fixtures for the SGLang adapter tests: SGLang's own pools, storage config and factory, on CPU.

These tests need SGLang's package (``sglang==0.5.23`` installed with ``--no-deps`` plus the few
modules ``sglang.srt.mem_cache`` imports; ``nox -s tests-sglang`` builds that environment) and
are skipped without it. Everything here is SGLang's real code: its device pools
(``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``device="cpu"``), its host pools built the way
its pool assembler builds them (only ``pin_memory=False``: pinning calls cudaHostRegister), its
``HiCacheStorageConfig`` and its ``StorageBackendFactory``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed (nox -s tests-sglang installs it)")

from kvtier.testing.data import fill_random  # noqa: E402

MODEL = "test-org/tiny-model"


@dataclass(frozen=True)
class PoolCase:
    """One SGLang host pool geometry (odd sizes on purpose)."""

    kind: str                   # "mha" | "mla"
    layout: str                 # SGLang's --hicache-mem-layout
    dtype: torch.dtype
    page_size: int
    layers: int
    heads: int = 0              # MHA
    head_dim: int = 0           # MHA
    kv_lora_rank: int = 0       # MLA
    rope: int = 0               # MLA
    device_tokens: int = 60

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.kind}-{self.layout}-{dt}-p{self.page_size}-L{self.layers}"


CASES = [
    PoolCase("mha", "page_first", torch.bfloat16, 5, 3, heads=2, head_dim=24),
    PoolCase("mha", "page_first", torch.float8_e4m3fn, 1, 2, heads=1, head_dim=40),
    PoolCase("mha", "layer_first", torch.float16, 3, 3, heads=3, head_dim=8),
    PoolCase("mha", "page_first_direct", torch.float32, 4, 2, heads=1, head_dim=12),
    PoolCase("mha", "page_head", torch.bfloat16, 2, 2, heads=2, head_dim=16),
    PoolCase("mla", "page_first", torch.bfloat16, 7, 3, kv_lora_rank=48, rope=8),
    PoolCase("mla", "layer_first", torch.float16, 3, 2, kv_lora_rank=20, rope=4),
    PoolCase("mla", "page_first_direct", torch.bfloat16, 2, 1, kv_lora_rank=32, rope=0),
]


def make_pools(case: PoolCase) -> tuple[Any, Any]:
    """(device pool, host pool) as SGLang builds them (hybrid_pool_assembler), on the CPU."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if case.kind == "mha":
        dev = MHATokenToKVPool(size=case.device_tokens, page_size=case.page_size,
                               dtype=case.dtype, head_num=case.heads, head_dim=case.head_dim,
                               layer_num=case.layers, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                    case.page_size, case.layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer)
    else:
        dev = MLATokenToKVPool(size=case.device_tokens, page_size=case.page_size,
                               dtype=case.dtype, kv_lora_rank=case.kv_lora_rank,
                               qk_rope_head_dim=case.rope, layer_num=case.layers, device="cpu",
                               enable_memory_saver=False)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                    case.page_size, case.layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    target_layer_num=dev.layer_num,
                                    override_kv_cache_dim=dev.kv_cache_dim)
    fill_random(host.kv_buffer)
    return dev, host


def storage_config(extra: dict, *, mla: bool = False, layout: str = "page_first",
                   **kw: Any) -> Any:
    """SGLang's HiCacheStorageConfig for one rank (tp 0 of 1 unless told)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    args = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=mla, enable_storage_metrics=True,
                is_page_first_layout=layout == "page_first", model_name=MODEL,
                extra_config=dict(extra))
    args.update(kw)
    return HiCacheStorageConfig(**args)


def extra_config(store: str, store_config: dict, **kw: Any) -> dict:
    cfg = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
           "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "store": store,
           "store_config": store_config}
    cfg.update(kw)
    return cfg


def attach(host: Any, cfg: Any) -> Any:
    """What SGLang's attach_storage_backend does: the factory, then register the host pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    return backend


def store_config_for(store: str, tmp_path) -> dict:
    if store == "file":
        return {"root": str(tmp_path / "l3"), "io_threads": 2}
    return {"capacity_bytes": 64 << 20}


@pytest.fixture(params=["file", "memory"])
def store_name(request) -> str:
    return request.param


@pytest.fixture(params=CASES, ids=lambda c: c.id)
def case(request) -> PoolCase:
    return request.param


@pytest.fixture
def pools(case):
    dev, host = make_pools(case)
    yield dev, host


@pytest.fixture
def backend(pools, case, store_name, tmp_path):
    _, host = pools
    cfg = storage_config(extra_config(store_name, store_config_for(store_name, tmp_path)),
                         mla=case.kind == "mla", layout=case.layout)
    b = attach(host, cfg)
    yield b
    b.close()


def page_indices(host: Any, pages: list[int]) -> torch.Tensor:
    """SGLang host indices (token slots) of whole pages."""
    s = host.page_size
    return torch.cat([torch.arange(p * s, (p + 1) * s, dtype=torch.int64) for p in pages])


def page_bytes(host: Any, page: int) -> torch.Tensor:
    """A copy of one page's bytes, read by SGLang's own get_data_page."""
    return host.get_data_page(page * host.page_size, flat=True).contiguous().view(
        -1).view(torch.uint8).clone()


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 152_000) for _ in range(n)]
