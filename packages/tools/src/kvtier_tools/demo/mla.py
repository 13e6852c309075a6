"""The demo's MLA models: transformers' own DeepSeek-V2 (``DeepseekV2ForCausalLM``) with random
weights and dense MLP layers, and how its cache maps onto kvtier's ``mla`` pages.

transformers (5.24) caches MLA's latent, not per-head K/V: layer ``i`` of the cache holds as
"keys" the normalised ``kv_a_proj_with_mqa`` output (``[1, 1, tokens, kv_lora_rank]``) and as
"values" the rope'd shared ``k_pe`` (``[1, 1, tokens, qk_rope_head_dim]``); every forward
expands the whole cached latent into per-head K/V with the layer's ``kv_b_proj``. That latent
is what kvtier tiers: one row of ``kv_lora_rank + qk_rope_head_dim`` per token per layer
(`KVSpec.mla`), pages in the ``mla`` device layout ``[blocks, page_size, latent]`` as MLA
engines keep them. A restored prefix is the latent bit for bit; its K/V are recomputed from it
by the model, as MLA engines do.

Every layer is dense (``first_k_dense_replace`` = the layer count: no MoE router, so a
prefill is fast and deterministic); ``intermediate`` stands in for the active experts' width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class MLASize:
    """Shape of a DeepSeek-V2 model (multi-head latent attention, dense MLP layers)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_lora_rank: int
    rope_dim: int       # qk_rope_head_dim: the shared rope'd key part, cached with the latent
    nope_dim: int       # qk_nope_head_dim: per-head key part expanded from the latent
    v_dim: int          # v_head_dim
    vocab: int
    about: str = ""

    @property
    def latent(self) -> int:
        """Width of one cached row: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim


#: Built-in MLA sizes: ``mla-tiny`` for tests and CI, ``mla-small`` for a 2-core CPU,
#: ``mla-lite`` for accelerators.
MLA_SIZES: tuple[MLASize, ...] = (
    MLASize("mla-tiny", hidden=64, layers=2, intermediate=128, heads=4, kv_lora_rank=32,
            rope_dim=16, nope_dim=16, v_dim=16, vocab=512, about="tests and CI"),
    MLASize("mla-small", hidden=256, layers=4, intermediate=704, heads=4, kv_lora_rank=128,
            rope_dim=32, nope_dim=64, v_dim=64, vocab=4096, about="a 2-core CPU"),
    # DeepSeek-V2-Lite's attention and KV (27 layers, latent 512 + 64: 31 KB of bf16 KV per
    # token); its MoE (2 shared + 6 of 64 routed experts of 1408) as one dense MLP of the
    # active width of its dense first layer
    MLASize("mla-lite", hidden=2048, layers=27, intermediate=10944, heads=16,
            kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, vocab=102400,
            about="DeepSeek-V2-Lite's shape, dense, for GPUs"),
)


def build_config(size: MLASize) -> Any:
    """The ``DeepseekV2Config`` of ``size``: no q LoRA (as in V2-Lite), every layer dense."""
    from transformers import DeepseekV2Config
    return DeepseekV2Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        kv_lora_rank=size.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=size.rope_dim,
        qk_nope_head_dim=size.nope_dim, v_head_dim=size.v_dim,
        first_k_dense_replace=size.layers, max_position_embeddings=1 << 17,
        tie_word_embeddings=False)


class LatentKV:
    """DeepSeek-V2's cache <-> an ``mla`` device pool: one ``[slots, latent]`` row per token
    and layer, the latent (``kv_lora_rank``) then the rope'd key (``rope_dim``)."""

    def __init__(self, size: MLASize):
        self.rank = size.kv_lora_rank
        self.latent = size.latent

    def spec(self, layers: int, page_size: int, dtype: str) -> KVSpec:
        return KVSpec.mla(layers, self.rank, self.latent - self.rank, page_size, dtype)

    def new_pool(self, spec: KVSpec, num_pages: int, device: torch.device) -> DeviceKVPool:
        """A pool in the ``mla`` device layout: per layer ``[blocks, page_size, latent]``."""
        block = torch.empty((spec.num_layers, num_pages, spec.page_size, self.latent),
                            dtype=spec.torch_dtype, device=device)
        return DeviceKVPool.from_blocks(spec, list(block), "mla")

    def pool_rows(self, pool: DeviceKVPool, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s pages as one ``[slots, latent]`` view (any mla pool: its one
        contiguous chunk per page is ``page_size`` latent rows)."""
        return [pool.chunks[layer][0].view(pool.spec.torch_dtype).view(-1, self.latent)]

    def to_cache(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        (lat,) = rows
        return lat[:, :self.rank][None, None], lat[:, self.rank:][None, None]

    def cache_rows(self, keys: torch.Tensor, values: torch.Tensor, s: int, e: int
                   ) -> list[torch.Tensor]:
        return [torch.cat((keys[0, 0, s:e], values[0, 0, s:e]), dim=-1)]

    def stubs(self, n: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Placeholders of an ``n``-token prefix's cache shape that hold no memory."""
        k = torch.empty((1, 1, 1, self.rank), dtype=dtype, device=device)
        v = torch.empty((1, 1, 1, self.latent - self.rank), dtype=dtype, device=device)
        return k.expand(1, 1, n, self.rank), v.expand(1, 1, n, self.latent - self.rank)
