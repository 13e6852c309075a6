"""Layout math: where every (page, layer, component, token) lives, in one place.

Logical index order everywhere is ``[page, layer, component, token, head, dim]``
(``component`` is 0 = K, 1 = V for MHA; MLA has the single component 0).

* Host ``page_first`` (default): ``[num_pages][num_layers][C][page_size][heads][dim]`` --
  one page is one contiguous byte range and every (page, layer, component) chunk is contiguous.
* Host ``layer_first`` (same as the device): ``[num_layers][C][num_pages*page_size][heads][dim]``.
* Device (engine-owned) ``layer_first``: per layer and component a ``[num_slots, heads, dim]``
  tensor; page p is slots ``[p*page_size, (p+1)*page_size)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import LayoutError
from .spec import KVSpec

PAGE_FIRST = "page_first"
LAYER_FIRST = "layer_first"
HOST_LAYOUTS = (PAGE_FIRST, LAYER_FIRST)


def check_layout(layout: str) -> str:
    if layout not in HOST_LAYOUTS:
        raise LayoutError(f"unknown host layout {layout!r}; expected one of {list(HOST_LAYOUTS)}")
    return layout


def host_shape(spec: KVSpec, num_pages: int, layout: str) -> tuple[int, ...]:
    """Physical shape of a host buffer, in elements of ``spec.dtype``."""
    check_layout(layout)
    L, C, S, (H, D) = spec.num_layers, spec.num_components, spec.page_size, spec.row_shape
    if layout == PAGE_FIRST:
        return (num_pages, L, C, S, H, D)
    return (L, C, num_pages * S, H, D)


def host_strides(spec: KVSpec, num_pages: int, layout: str) -> tuple[int, ...]:
    """Element strides of the logical ``[page, layer, comp, token, head, dim]`` index."""
    check_layout(layout)
    L, C, S, (H, D) = spec.num_layers, spec.num_components, spec.page_size, spec.row_shape
    row = H * D
    if layout == PAGE_FIRST:
        return (L * C * S * row, C * S * row, S * row, row, D, 1)
    slots = num_pages * S
    return (S * row, C * slots * row, slots * row, row, D, 1)


def host_nbytes(spec: KVSpec, num_pages: int) -> int:
    return num_pages * spec.page_bytes


def chunk_offset(spec: KVSpec, num_pages: int, layout: str, page: int, layer: int,
                 comp: int) -> int:
    """Byte offset of the (page, layer, comp) chunk of ``page_size`` rows."""
    st = host_strides(spec, num_pages, layout)
    return (page * st[0] + layer * st[1] + comp * st[2]) * spec.itemsize


def page_ranges(spec: KVSpec, num_pages: int, layout: str, page: int) -> list[tuple[int, int]]:
    """The contiguous (byte offset, nbytes) ranges holding one page, in logical order.

    One range for ``page_first``; ``num_layers * C`` chunks for ``layer_first``.
    """
    if layout == PAGE_FIRST:
        check_layout(layout)
        return [(page * spec.page_bytes, spec.page_bytes)]
    return [(chunk_offset(spec, num_pages, layout, page, l, c), spec.chunk_bytes)
            for l in range(spec.num_layers) for c in range(spec.num_components)]


def logical_view(raw: torch.Tensor, spec: KVSpec, num_pages: int, layout: str) -> torch.Tensor:
    """View a flat uint8 host buffer as ``[page, layer, comp, token, head, dim]``."""
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise LayoutError(f"host buffer must be a 1-D uint8 tensor, got {raw.dtype} "
                          f"{tuple(raw.shape)}")
    need = host_nbytes(spec, num_pages)
    if raw.numel() < need:
        raise LayoutError(f"host buffer holds {raw.numel()} bytes, layout needs {need}")
    typed = raw[:need].view(spec.torch_dtype).view(host_shape(spec, num_pages, layout))
    if layout == PAGE_FIRST:
        return typed
    L, C, S, (H, D) = spec.num_layers, spec.num_components, spec.page_size, spec.row_shape
    return typed.view(L, C, num_pages, S, H, D).permute(2, 0, 1, 3, 4, 5)


def device_page_view(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[num_slots, heads, dim]`` -> ``[num_pages, page_size, heads, dim]`` (a view)."""
    n = slots.shape[0]
    if n % page_size:
        raise LayoutError(f"{n} slots do not divide into pages of {page_size} tokens")
    return slots.view(n // page_size, page_size, *slots.shape[1:])


def as_index_tensor(pages: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """Page indices as an int64 tensor (kept on its device if already a tensor)."""
    if isinstance(pages, torch.Tensor):
        t = pages.to(torch.int64) if pages.dtype != torch.int64 else pages
        return t if device is None else t.to(device, non_blocking=True)
    return torch.as_tensor(list(pages), dtype=torch.int64, device=device)


def gather_device(device_layers: Sequence[Sequence[torch.Tensor]], spec: KVSpec,
                  pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Reference: copy device pages out as ``[n, layer, comp, token, head, dim]``."""
    idx = as_index_tensor(pages, device_layers[0][0].device)
    out = []
    for layer in range(spec.num_layers):
        comps = [device_page_view(device_layers[c][layer], spec.page_size).index_select(0, idx)
                 for c in range(spec.num_components)]
        out.append(torch.stack(comps, dim=1))
    return torch.stack(out, dim=1)


def convert_host(src: torch.Tensor, spec: KVSpec, num_pages: int, src_layout: str,
                 dst_layout: str) -> torch.Tensor:
    """Copy a flat uint8 host buffer from one layout into a new buffer of another."""
    dst = torch.empty_like(src[:host_nbytes(spec, num_pages)])
    logical_view(dst, spec, num_pages, dst_layout).copy_(
        logical_view(src, spec, num_pages, src_layout))
    return dst
