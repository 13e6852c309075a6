"""The demo's model: a Llama-architecture transformer from ``transformers``, built from a
config with random weights (fixed seed, nothing downloaded), whose prefill runs on KV pages
held in the engine's device pool (`kvtier.DeviceKVPool`, layer_first).

Prefill is chunked by page: every forward pass computes exactly one page of tokens on top of
the KV of the pages before it. So the KV of page ``i`` is a function of the tokens up to the
end of page ``i`` only -- not of which earlier prefix happened to be cached -- and a prefill
on restored pages must give the same bits as a recompute from token 0 that runs the same
chunks. That is what `check_restored` verifies (bitwise on CPU in float32; within a stated
tolerance elsewhere). Without page chunking, GEMMs of different row counts may round
differently, and no bitwise comparison would be meaningful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..device_pool import DeviceKVPool
from ..errors import ConfigError, InvalidArgumentError, KVTierError
from ..spec import DTYPES, KVSpec, dtype_name


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Built-in sizes: ``tiny`` for tests, ``small`` (the default) for a 2-core CPU, the larger
#: ones for accelerators.
MODEL_SIZES: dict[str, ModelSize] = {s.name: s for s in (
    ModelSize("tiny", hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=512),
    ModelSize("small", hidden=256, layers=4, intermediate=704, heads=4, kv_heads=2, vocab=4096),
    ModelSize("medium", hidden=512, layers=8, intermediate=1408, heads=8, kv_heads=2,
              vocab=8192),
    ModelSize("large", hidden=2048, layers=16, intermediate=5632, heads=16, kv_heads=4,
              vocab=32000),
)}


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


def default_tolerance(device: torch.device, dtype: torch.dtype) -> float:
    """0 (bitwise) on CPU in float32; otherwise a relative tolerance on the logits and KV
    (accelerator kernels may pick other reduction orders between otherwise equal calls)."""
    if device.type == "cpu" and dtype == torch.float32:
        return 0.0
    return 1e-3 if dtype == torch.float32 else 2e-2


#: The transformers releases the demo was tested with (kvtier-core[demo] asks for them). Older
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
                          f"'kvtier-core[demo]')", key="transformers", value=version)


class DemoModel:
    """A random-weight Llama and its paged, page-chunked prefill."""

    def __init__(self, size: str | ModelSize = "small", *, page_size: int = 64,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 seed: int = 0):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except (ImportError, OSError, RuntimeError) as exc:
            raise ConfigError(f"the demo needs transformers: {exc} (pip install "
                              f"'kvtier-core[demo]')", key="model") from None
        check_transformers()
        if isinstance(size, str):
            if size not in MODEL_SIZES:
                raise ConfigError(f"unknown model size {size!r}; expected one of "
                                  f"{sorted(MODEL_SIZES)}", key="model_size", value=size)
            size = MODEL_SIZES[size]
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page_size must be an int >= 1, got {page_size!r}",
                              key="page_size", value=page_size)
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype_name(dtype)]
        cfg = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden,
                          intermediate_size=size.intermediate, num_hidden_layers=size.layers,
                          num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                          max_position_embeddings=1 << 17, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        # Initialise on the target device (fast for the large sizes); the seed fixes the
        # weights per device type (CPU and CUDA generators differ).
        forked = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), self.device:
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.config = cfg
        self.spec = KVSpec.mha(size.layers, size.kv_heads, size.head_dim, page_size,
                               dtype_name(self.dtype))
        self.tolerance = default_tolerance(self.device, self.dtype)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

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
                wait_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Prefill ``tokens`` whose first ``len(prefix_pages)`` pages are already in ``pool``.

        The prefix KV is gathered from the pool (layer ``i`` after ``wait_layer(i)``), the rest
        is computed one page per forward pass with positions offset by the prefix length, and
        the KV of every newly computed full page is written into ``new_pages``. Returns the
        logits of the last token (what the first output token is sampled from).
        """
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
        layers = []
        if prefix_pages:
            slots = _slots(prefix_pages, ps, pool.device)
            for i in range(self.size.layers):
                if wait_layer is not None:
                    wait_layer(i)
                k = pool.layers[0][i].index_select(0, slots).transpose(0, 1).unsqueeze(0)
                v = pool.layers[1][i].index_select(0, slots).transpose(0, 1).unsqueeze(0)
                layers.append((k, v))
        cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
        logits = self._chunks(tokens, cache, start, explicit_positions=True)
        for j, page in enumerate(new_pages):
            s = start + j * ps
            lo = page * ps
            for i, layer in enumerate(cache.layers):
                pool.layers[0][i][lo:lo + ps].copy_(layer.keys[0, :, s:s + ps].transpose(0, 1))
                pool.layers[1][i][lo:lo + ps].copy_(layer.values[0, :, s:s + ps].transpose(0, 1))
        return logits

    def _chunks(self, tokens: torch.Tensor, cache, start: int, *,
                explicit_positions: bool) -> torch.Tensor:
        ps = self.page_size
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
    def recompute(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor,
                                                                                 torch.Tensor]]]:
        """Full recompute from token 0 with no cache (positions left to the model): the last
        token's logits and, per layer, K and V of every full page as ``[tokens, heads, dim]``."""
        from transformers import DynamicCache
        cache = DynamicCache()
        logits = self._chunks(tokens, cache, 0, explicit_positions=False)
        full = (int(tokens.shape[0]) // self.page_size) * self.page_size
        kv = [(layer.keys[0, :, :full].transpose(0, 1), layer.values[0, :, :full].transpose(0, 1))
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
        kv_diff, bad_pages = 0.0, set()
        for i, (rk, rv) in enumerate(ref_kv):
            for comp, ref in ((0, rk), (1, rv)):
                got = pool.layers[comp][i].index_select(0, slots)
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
