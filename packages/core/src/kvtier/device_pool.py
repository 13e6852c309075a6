"""`DeviceKVPool`: a view of the engine's own L1 KV buffers (layer_first), validated once."""

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
                if t.dtype != spec.torch_dtype:
                    raise LayoutError(f"{where} has dtype {t.dtype}, spec says {spec.torch_dtype}")
                if t.dim() != 3 or tuple(t.shape[1:]) != spec.row_shape:
                    raise LayoutError(f"{where} has shape {tuple(t.shape)}, expected "
                                      f"[num_slots, {spec.row_shape[0]}, {spec.row_shape[1]}]")
                if t.shape[0] != self.num_slots:
                    raise LayoutError(f"{where} has {t.shape[0]} slots, layer 0 has "
                                      f"{self.num_slots}")
                if t.device != self.device:
                    raise LayoutError(f"{where} is on {t.device}, layer 0 on {self.device}")
                if not t.is_contiguous():
                    raise LayoutError(f"{where} is not contiguous")
        if self.num_slots == 0 or self.num_slots % spec.page_size:
            raise LayoutError(f"device pool has {self.num_slots} slots, not a positive multiple "
                              f"of page_size {spec.page_size}")
        self.layers = comps                 # [component][layer] -> [num_slots, heads, dim]
        self.num_pages = self.num_slots // spec.page_size

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
        return device_page_view(self.layers[comp][layer], self.spec.page_size)[page]

    def pages_view(self, comp: int, layer: int) -> torch.Tensor:
        return device_page_view(self.layers[comp][layer], self.spec.page_size)

    def check_pages(self, pages: Sequence[int] | torch.Tensor, what: str = "device page"
                    ) -> torch.Tensor:
        """Validate page indices (range, type) and return them as an int64 tensor.

        Tensors already on an accelerator are checked there (one reduction, no copy of the
        indices to the host); use ``kvtier.layout.as_index_tensor`` to skip the check.
        """
        return check_page_indices(pages, self.num_pages, what)


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
        idx = as_index_tensor([int(p) for p in items])
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise PageIndexError(f"{what} index {bad} out of range [0, {limit})", index=bad,
                                 limit=limit)
    return idx
