"""The demo's model: a Llama-architecture transformer from ``transformers`` (or, for the
``mla-*`` sizes, its DeepSeek-V2 with multi-head latent attention: `kvtier_tools.demo.mla`), built
from a config with random weights (fixed seed, nothing downloaded), whose prefill runs on KV
pages held in the engine's device pool (`kvtier.DeviceKVPool`: token_major K and V for Llama,
the ``mla`` layout's latent rows for DeepSeek-V2).

Two prefills:

- ``fast`` (the default), as real engines prefill: the uncached suffix in one forward pass
  (chunked only at ``max_forward_tokens``). The restored prefix is not gathered up front: a
  forward pre-hook on decoder layer ``i`` waits for layer ``i`` of the prefix
  (``wait_layer(i)``, i.e. `FetchHandle.wait_layer`) and only then fills that layer's past
  K/V (MLA: latent) from the pool, so loads of later layers overlap the compute of earlier ones.
  `check_logits` compares the first token and the logits with a full recompute within
  `fast_tolerance`: GEMMs of other row counts round differently, so bits may differ.
- ``paged``: one page per forward pass, so the KV of page ``i`` is a function of the tokens
  up to the end of page ``i`` only, and a prefill on restored pages gives the same bits as a
  recompute from token 0 running the same chunks (`check_restored`: bitwise on CPU in
  float32, within a stated tolerance elsewhere). About 10x slower than ``fast``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError, InvalidArgumentError, KVTierError
from kvtier.spec import DTYPES, KVSpec, dtype_name
from .mla import MLA_SIZES, LatentKV, MLASize, build_config


@dataclass(frozen=True)
class ModelSize:
    """Shape of a Llama model (grouped-query attention: ``kv_heads`` < ``heads``)."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    about: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Built-in sizes: ``tiny`` for tests, ``small`` (the default) for a 2-core CPU, the larger
#: ones for accelerators; ``mla-*``: DeepSeek-V2 shapes (`kvtier_tools.demo.mla`).
_SIZES: tuple[ModelSize | MLASize, ...] = (
    ModelSize("tiny", hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=512,
              about="tests"),
    ModelSize("small", hidden=256, layers=4, intermediate=704, heads=4, kv_heads=2, vocab=4096,
              about="the default, for a 2-core CPU"),
    ModelSize("medium", hidden=512, layers=8, intermediate=1408, heads=8, kv_heads=2,
              vocab=8192, about="GPUs"),
    ModelSize("large", hidden=2048, layers=16, intermediate=5632, heads=16, kv_heads=4,
              vocab=32000, about="GPUs"),
    # Llama-3-8B's shape (random weights): 128 KiB of bf16 KV per token
    ModelSize("8b", hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8,
              vocab=128256, about="Llama-3-8B's shape, for GPUs"),
    *MLA_SIZES,
)
MODEL_SIZES: dict[str, ModelSize | MLASize] = {s.name: s for s in _SIZES}


def describe_sizes() -> str:
    """One line per size for ``--help``: its name, architecture, shape and use."""
    out = []
    for s in MODEL_SIZES.values():
        if isinstance(s, MLASize):
            shape = (f"DeepSeek-V2 MLA, {s.layers} layers, hidden {s.hidden}, latent "
                     f"{s.kv_lora_rank}+{s.rope_dim}")
        else:
            shape = f"Llama, {s.layers} layers, hidden {s.hidden}, {s.kv_heads} KV heads"
        out.append(f"{s.name} ({shape}: {s.about})")
    return "; ".join(out)


class _HeadsKV:
    """Llama's cache <-> a token_major pool: per layer K and V ``[slots, kv_heads,
    head_dim]`` (the cache's ``[1, kv_heads, tokens, head_dim]`` transposed)."""

    def __init__(self, size: ModelSize):
        self.kv_heads, self.head_dim = size.kv_heads, size.head_dim

    def spec(self, layers: int, page_size: int, dtype: str) -> KVSpec:
        return KVSpec.mha(layers, self.kv_heads, self.head_dim, page_size, dtype)

    def new_pool(self, spec: KVSpec, num_pages: int, device: torch.device) -> DeviceKVPool:
        return DeviceKVPool.empty(spec, num_pages, device=device)

    def pool_rows(self, pool: DeviceKVPool, layer: int) -> list[torch.Tensor]:
        k, v = pool.require_layers("the demo's Llama")
        return [k[layer], v[layer]]

    def to_cache(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = rows
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def cache_rows(self, keys: torch.Tensor, values: torch.Tensor, s: int, e: int
                   ) -> list[torch.Tensor]:
        return [keys[0, :, s:e].transpose(0, 1), values[0, :, s:e].transpose(0, 1)]

    def stubs(self, n: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        stub = torch.empty((1, self.kv_heads, 1, self.head_dim), dtype=dtype,
                           device=device).expand((1, self.kv_heads, n, self.head_dim))
        return stub, stub

#: Prefill modes: ``fast`` (the suffix in one forward) and ``paged`` (one page per forward).
PREFILL_MODES = ("fast", "paged")


#: Query rows per attention block when queries follow a cached prefix on CPU (see
#: `_attention`: a masked SDPA runs slower per element than the causal one there, so smaller
#: blocks, each wasting less of its diagonal square, come out ahead).
ATTENTION_BLOCK_CPU = 256
ATTENTION = "kvtier_sdpa"
#: How queries that follow a prefix may attend (see `_attention`).
PREFIX_ATTENTIONS = ("blocks", "lower_right")
#: How they do: ``"auto"`` (one bottom-right causal SDPA on accelerators, query blocks on
#: CPU) or one of `PREFIX_ATTENTIONS`.
PREFIX_ATTENTION = "auto"


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA as engines' prefill kernels do it. With no prefix (as many queries as keys):
    plain causal SDPA. When the queries follow a prefix (fewer queries than keys), a causal
    mask aligned to the bottom right: on accelerators one SDPA call with
    `torch.nn.attention.bias.causal_lower_right` (flash attention runs it without
    materialising a mask, as engines' varlen prefill kernels do); on CPU blocks of
    ``ATTENTION_BLOCK_CPU`` query rows, each over the keys up to its last row with an explicit
    mask, so the masked upper triangle is skipped rather than computed.

    MLA's values are narrower than its queries and keys (``v_head_dim`` < ``qk_nope_head_dim
    + qk_rope_head_dim``); SDPA's fused kernels want one head dim (on CPU a mismatch falls
    back to the unfused math path, ~10x slower), so V is zero-padded and the output cut back,
    as MLA engines' prefill does for flash attention."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    dv = value.shape[-1]
    if dv < query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
        out, weights = _attention(module, query, key, value, attention_mask, **kwargs)
        return out[..., :dv].contiguous(), weights
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len == kv_len or q_len == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    how = PREFIX_ATTENTION
    if how == "auto":
        how = "blocks" if query.device.type == "cpu" else "lower_right"
    if how == "lower_right":
        from torch.nn.attention.bias import causal_lower_right
        groups = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups),
            attn_mask=causal_lower_right(q_len, kv_len), scale=module.scaling)
        return out.transpose(1, 2).contiguous(), None
    outs = []
    block = ATTENTION_BLOCK_CPU
    for b in range(0, q_len, block):
        e = min(b + block, q_len)
        end = kv_len - q_len + e
        rows = torch.arange(e - b, device=query.device).unsqueeze(1)
        mask = torch.arange(end, device=query.device).unsqueeze(0) <= rows + (end - (e - b))
        out, _ = sdpa_attention_forward(module, query[:, :, b:e], key[:, :, :end],
                                        value[:, :, :end], mask[None, None], **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, _attention)


class CheckFailedError(KVTierError, AssertionError):
    """A prefill on restored KV did not match the full recompute."""

    def __init__(self, message: str, *, request: int | None = None,
                 max_abs_diff: float | None = None):
        super().__init__(message)
        self.request = request
        self.max_abs_diff = max_abs_diff


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one comparison against a full recompute."""

    exact: bool              # logits and every KV page identical bit for bit
    passed: bool             # exact, or within the tolerance where exactness is not asked
    logits_max_abs_diff: float
    kv_max_abs_diff: float
    kv_pages_differing: int
    tolerance: float         # 0.0: bitwise equality required
    same_token: bool = True  # the first output token (argmax) is the recompute's
    #: how far two recomputes of the same tokens differ (one forward vs split where the
    #: checked prefill's prefix ends): the rounding noise the comparison allows twice over
    noise_max_abs_diff: float = 0.0


def fast_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance on the logits of a ``fast`` prefill on restored KV against a full
    recompute (the scale is max(1, max |logit|)): other GEMM shapes round differently."""
    return 1e-4 if dtype == torch.float32 else 5e-2


def default_tolerance(device: torch.device, dtype: torch.dtype) -> float:
    """0 (bitwise) on CPU in float32; otherwise a relative tolerance on the logits and KV
    (accelerator kernels may pick other reduction orders between otherwise equal calls)."""
    if device.type == "cpu" and dtype == torch.float32:
        return 0.0
    return 1e-3 if dtype == torch.float32 else 2e-2


#: The transformers releases the demo was tested with (kvtier-tools[demo] asks for them). Older
#: 5.x releases ran it but their prefill on restored pages differed from a full recompute in
#: the last bit of the logits (6e-8), so the bitwise check failed; 5.17 also crashed on GPUs.
TESTED_TRANSFORMERS = ((5, 24), (5, 25))


def check_transformers(version: str | None = None) -> None:
    """A ConfigError unless transformers is a release the demo was tested with."""
    import re
    if version is None:
        import transformers
        version = transformers.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED_TRANSFORMERS
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) < hi:
        raise ConfigError(f"the demo was tested with transformers >={lo[0]}.{lo[1]},"
                          f"<{hi[0]}.{hi[1]}; this is {version} (pip install "
                          f"'kvtier-tools[demo]')", key="transformers", value=version)


class DemoModel:
    """A random-weight Llama (or DeepSeek-V2 for the ``mla-*`` sizes) and its prefills on
    pages of a device pool."""

    def __init__(self, size: str | ModelSize | MLASize = "small", *, page_size: int = 64,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 seed: int = 0, max_forward_tokens: int = 8192):
        try:
            from transformers import DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM
        except (ImportError, OSError, RuntimeError) as exc:
            raise ConfigError(f"the demo needs transformers: {exc} (pip install "
                              f"'kvtier-tools[demo]')", key="model") from None
        check_transformers()
        if isinstance(size, str):
            if size not in MODEL_SIZES:
                raise ConfigError(f"unknown model size {size!r}; expected one of "
                                  f"{sorted(MODEL_SIZES)}", key="model_size", value=size)
            size = MODEL_SIZES[size]
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {page_size!r}",
                              key="page_size", value=page_size)
        if isinstance(max_forward_tokens, bool) or not isinstance(max_forward_tokens, int) \
                or max_forward_tokens < 1:
            raise ConfigError(f"max_forward_tokens must be an int >= 1, got "
                              f"{max_forward_tokens!r}", key="max_forward_tokens",
                              value=max_forward_tokens)
        self.size = size
        self.page_size = page_size
        self.max_forward_tokens = max_forward_tokens
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype_name(dtype)]
        self.kv: _HeadsKV | LatentKV
        build: type[torch.nn.Module]
        if isinstance(size, MLASize):
            cfg = build_config(size)
            build = DeepseekV2ForCausalLM
            self.kv = LatentKV(size)
        else:
            cfg = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden,
                              intermediate_size=size.intermediate,
                              num_hidden_layers=size.layers, num_attention_heads=size.heads,
                              num_key_value_heads=size.kv_heads,
                              max_position_embeddings=1 << 17, tie_word_embeddings=False)
            build = LlamaForCausalLM
            self.kv = _HeadsKV(size)
        _register_attention()
        cfg._attn_implementation = ATTENTION
        # Initialise on the target device (fast for the large sizes); the seed fixes the
        # weights per device type (CPU and CUDA generators differ).
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), self.device:
            torch.manual_seed(seed)
            model = build(cfg)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.config = cfg
        self.spec = self.kv.spec(size.layers, page_size, dtype_name(self.dtype))
        self.tolerance = default_tolerance(self.device, self.dtype)
        self.fast_tolerance = fast_tolerance(self.dtype)
        # layer i's pre-hook: fill its past K/V from the pool once layer i has landed
        self._restore: Callable[[int], None] | None = None
        layers: Any = self.model.model.layers        # transformers' decoder layers
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre_hook(i))

    def _pre_hook(self, i: int):
        def hook(module, args):
            if self._restore is not None:
                self._restore(i)
        return hook

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2): the KV is one latent row per token."""
        return isinstance(self.size, MLASize)

    @property
    def family(self) -> str:
        """The architecture in a page key's model id: ``llama`` or ``deepseek-v2``."""
        return "deepseek-v2" if self.mla else "llama"

    @property
    def label(self) -> str:
        """How reports name the model: ``Llama-small``, ``DeepSeek-V2-mla-lite``."""
        return f"{'DeepSeek-V2' if self.mla else 'Llama'}-{self.size.name}"

    def describe(self) -> dict:
        """The model's shape for reports (results.json's ``model``)."""
        s = self.size
        info = {"size": s.name, "label": self.label,
                "params_m": round(self.num_params / 1e6, 2), "layers": s.layers,
                "hidden": s.hidden, "heads": s.heads}
        if isinstance(s, MLASize):
            info.update(kv_lora_rank=s.kv_lora_rank, rope_dim=s.rope_dim)
        else:
            info["kv_heads"] = s.kv_heads
        return info

    def new_pool(self, num_pages: int) -> DeviceKVPool:
        """A device pool of ``num_pages`` pages in the layout this model's engine keeps
        (Llama: token_major K and V; MLA: the ``mla`` layout)."""
        return self.kv.new_pool(self.spec, num_pages, self.device)

    @property
    def vocab_size(self) -> int:
        return self.size.vocab

    def as_tokens(self, tokens) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the model's device."""
        t = torch.tensor(tokens, dtype=torch.int64) if not isinstance(tokens, torch.Tensor) \
            else tokens.to(torch.int64)
        if t.dim() != 1 or t.numel() == 0:
            raise InvalidArgumentError(f"tokens must be a non-empty 1-D sequence, got shape "
                                       f"{tuple(t.shape)}", argument="tokens")
        return t.to(self.device)

    # ----- the engine's prefill -----------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, pool: DeviceKVPool, prefix_pages: Sequence[int],
                new_pages: Sequence[int], *,
                wait_layer: Callable[[int], None] | None = None,
                mode: str = "fast") -> torch.Tensor:
        """Prefill ``tokens`` whose first ``len(prefix_pages)`` pages are already in ``pool``.

        The prefix KV of layer ``i`` is read from the pool after ``wait_layer(i)``; the rest
        is computed with positions offset by the prefix length (``fast``: in forwards of up to
        ``max_forward_tokens``, layer ``i`` of the first one waiting only for layer ``i`` of
        the prefix; ``paged``: one page per forward, after the whole prefix is gathered), and
        the KV of every newly computed full page is written into ``new_pages``. Returns the
        logits of the last token (what the first output token is sampled from).
        """
        if mode not in PREFILL_MODES:
            raise InvalidArgumentError(f"mode must be one of {PREFILL_MODES}, got {mode!r}",
                                       argument="mode", value=mode)
        from transformers import DynamicCache
        ps = self.page_size
        n = int(tokens.shape[0])
        start = len(prefix_pages) * ps
        if start >= n:
            raise InvalidArgumentError(f"a prefix of {len(prefix_pages)} pages ({start} tokens) "
                                       f"leaves nothing of {n} tokens to compute",
                                       argument="prefix_pages")
        if len(prefix_pages) + len(new_pages) != n // ps:
            raise InvalidArgumentError(f"{n} tokens have {n // ps} full pages; got "
                                       f"{len(prefix_pages)} prefix + {len(new_pages)} new",
                                       argument="new_pages")
        if mode == "fast":
            return self._prefill_fast(tokens, pool, prefix_pages, new_pages, wait_layer)
        layers = []
        if prefix_pages:
            slots = _slots(prefix_pages, ps, pool.device)
            for i in range(self.size.layers):
                if wait_layer is not None:
                    wait_layer(i)
                layers.append(self.kv.to_cache([r.index_select(0, slots)
                                                for r in self.kv.pool_rows(pool, i)]))
        cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
        logits = self._chunks(tokens, cache, start, explicit_positions=True)
        self._store(pool, cache, start, new_pages)
        return logits

    def _store(self, pool: DeviceKVPool, cache, start: int, new_pages: Sequence[int]) -> None:
        """Write the KV of tokens ``start..`` in ``cache`` into ``new_pages``, a page each."""
        if not new_pages:
            return
        e = start + len(new_pages) * self.page_size
        dst = _slots(new_pages, self.page_size, pool.device)
        for i, layer in enumerate(cache.layers):
            for rows, new in zip(self.kv.pool_rows(pool, i),
                                 self.kv.cache_rows(layer.keys, layer.values, start, e)):
                rows.index_copy_(0, dst, new)

    def _prefill_fast(self, tokens: torch.Tensor, pool: DeviceKVPool,
                      prefix_pages: Sequence[int], new_pages: Sequence[int],
                      wait_layer: Callable[[int], None] | None) -> torch.Tensor:
        from transformers import DynamicCache
        ps = self.page_size
        start = len(prefix_pages) * ps
        n_layers = self.size.layers
        cache = DynamicCache(ddp_cache_data=[(None, None)] * n_layers)
        if prefix_pages:
            slots = _slots(prefix_pages, ps, pool.device)
            # a placeholder of the prefix's shape (no memory) until layer i is restored:
            # the mask is built from layer 0's length before any layer runs
            stub_k, stub_v = self.kv.stubs(start, self.dtype, self.device)
            for layer in cache.layers:
                layer.keys, layer.values = stub_k, stub_v
                layer.device, layer.is_initialized = self.device, True
            pending = set(range(n_layers))

            def restore(i: int) -> None:
                if i not in pending:
                    return
                pending.discard(i)
                if wait_layer is not None:
                    wait_layer(i)
                layer = cache.layers[i]
                layer.keys, layer.values = self.kv.to_cache(
                    [r.index_select(0, slots) for r in self.kv.pool_rows(pool, i)])
            self._restore = restore
        try:
            logits = self._chunks(tokens, cache, start, explicit_positions=True,
                                  chunk=self.max_forward_tokens)
        finally:
            self._restore = None
        self._store(pool, cache, start, new_pages)
        return logits

    def _chunks(self, tokens: torch.Tensor, cache, start: int, *,
                explicit_positions: bool, chunk: int | None = None) -> torch.Tensor:
        ps = chunk or self.page_size
        n = int(tokens.shape[0])
        out = None
        for s in range(start, n, ps):
            e = min(s + ps, n)
            kw = {}
            if explicit_positions:      # RoPE positions continue after the restored prefix
                kw["position_ids"] = torch.arange(s, e, device=self.device).unsqueeze(0)
            out = self.model(input_ids=tokens[s:e].unsqueeze(0), cache=cache, use_cache=True,
                             logits_to_keep=1, **kw)
        assert out is not None
        return out.logits[0, -1]

    # ----- the check ----------------------------------------------------------------------
    @torch.inference_mode()
    def check_logits(self, tokens: torch.Tensor, logits: torch.Tensor,
                     start: int = 0) -> CheckResult:
        """Compare the logits of a ``fast`` prefill on restored KV (its prefix: the first
        ``start`` tokens) with a full recompute (one ``fast`` prefill from token 0).

        GEMMs of other row counts round differently, so a prefill after a prefix differs from
        one over all tokens even when its KV is exact (every restored page is checked bitwise
        by its digest, `kvtier_tools.demo.digest`). The check measures that rounding on the spot: a
        second recompute split where the prefix ends (the prefix in one forward, then the
        suffix on it, no kvtier involved) gives ``noise`` = its distance from the first. It
        passes if the logits are within ``max(fast_tolerance x max(1, max |logit|), 2 x
        noise)`` of the recompute (the restored prefix was itself computed in other chunks,
        hence twice the noise) and the first token (argmax) is the same, unless the
        recompute's own top logits tie within that bound, in which case any of the tied
        tokens passes."""
        from transformers import DynamicCache
        mft = self.max_forward_tokens
        ref = self._chunks(tokens, DynamicCache(), 0, explicit_positions=False, chunk=mft)
        exact = _same_bits(logits, ref)
        noise = 0.0
        if 0 < start < int(tokens.shape[0]) and not exact:
            cache = DynamicCache()
            self._chunks(tokens[:start], cache, 0, explicit_positions=True, chunk=mft)
            split = self._chunks(tokens, cache, start, explicit_positions=True, chunk=mft)
            noise = _max_abs_diff(split, ref)
        tol = self.fast_tolerance
        diff = _max_abs_diff(logits, ref)
        scale = max(1.0, float(ref.abs().max()))
        bound = max(tol * scale, 2.0 * noise)
        got_tok = int(logits.argmax())
        same_token = got_tok == int(ref.argmax()) or \
            float(ref[got_tok]) >= float(ref.max()) - bound
        passed = exact or (diff <= bound and same_token)
        return CheckResult(exact, passed, diff, 0.0, 0, tol, same_token, noise)

    @torch.inference_mode()
    def recompute(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Full recompute from token 0 with no cache (positions left to the model): the last
        token's logits and, per layer, the KV of every full page as the pool holds it (K and
        V ``[tokens, heads, dim]``; MLA: the latent ``[tokens, latent]``)."""
        from transformers import DynamicCache
        cache = DynamicCache()
        logits = self._chunks(tokens, cache, 0, explicit_positions=False)
        full = (int(tokens.shape[0]) // self.page_size) * self.page_size
        kv = [self.kv.cache_rows(layer.keys, layer.values, 0, full)  # type: ignore[arg-type]
              for layer in cache.layers]
        return logits, kv

    @torch.inference_mode()
    def check_restored(self, tokens: torch.Tensor, logits: torch.Tensor, pool: DeviceKVPool,
                       pages: Sequence[int]) -> CheckResult:
        """Compare a restored-prefix prefill (its ``logits`` and the KV now in ``pages``, one
        per full page, prefix included) with a full recompute."""
        ref_logits, ref_kv = self.recompute(tokens)
        tol = self.tolerance
        exact = _same_bits(logits, ref_logits)
        l_diff = _max_abs_diff(logits, ref_logits)
        ps = self.page_size
        slots = _slots(pages, ps, pool.device)
        kv_diff, bad_pages = 0.0, set[int]()
        for i, refs in enumerate(ref_kv):
            for rows, ref in zip(self.kv.pool_rows(pool, i), refs):
                got = rows.index_select(0, slots)
                if _same_bits(got, ref):
                    continue
                exact = False
                kv_diff = max(kv_diff, _max_abs_diff(got, ref))
                per_token = (got.contiguous().view(torch.uint8).flatten(1)
                             != ref.contiguous().view(torch.uint8).flatten(1)).any(dim=1)
                bad_pages.update((per_token.nonzero().flatten() // ps).tolist())
        if exact:
            passed = True
        elif tol == 0.0:
            passed = False
        else:
            scale = max(1.0, float(ref_logits.abs().max()))
            kv_scale = max([1.0] + [float(t.abs().max()) for pair in ref_kv for t in pair])
            passed = l_diff <= tol * scale and kv_diff <= tol * kv_scale
        return CheckResult(exact, passed, l_diff, kv_diff, len(bad_pages), tol)


def _slots(pages: Sequence[int], page_size: int, device: torch.device) -> torch.Tensor:
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    return (p.unsqueeze(1) * page_size + torch.arange(page_size)).flatten().to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    d = (a.double() - b.double()).abs()
    return float(d.max()) if d.numel() else 0.0
