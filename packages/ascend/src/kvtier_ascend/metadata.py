"""The int64 metadata of Memfabric's fused ``kv_exchange_copy`` kernel, built from kvtier's layouts.

Pure logic: no vendor import, no device. Layout, as read by the kernel of memfabric-hybrid 1.3.0
(``_kernel/acc_offload/operators/acc_offload_kv_exchange.h``)::

    header  [num_components (<= 4), num_pages, page_size, direction (1 H2D, 2 D2H),
             device_indices_ptr, host_indices_ptr, host_layout_mode (0 page_first,
             1 layer_first), 0]
    then per component c, 9 values at 8 + 9*c:
            [device_base, host_base (a DVA), device_layer_pitch, device_page_pitch,
             host_page_pitch, host_layer_pitch, width (bytes of one (page, layer) row),
             layer_lo, layer_hi]

For page ``p`` of the call and layer ``l`` in ``[layer_lo, layer_hi)`` the kernel moves ``width``
bytes between ``device_base + l*device_layer_pitch + dpage*device_page_pitch`` and
``host_base + hpage*host_page_pitch + l*host_layer_pitch``, where ``dpage``/``hpage`` are the
int64 *token* indices at position ``p*page_size`` of the two index arrays, divided by
``page_size``. In layer_first mode it also merges runs of pages whose host and device pages are
both consecutive into one copy, which is only right when both page pitches equal ``width``.

kvtier's device pool holds one tensor per (component, layer); they need not sit at one pitch.
The layers are therefore cut into *segments* over which every component's layer addresses are
evenly spaced; one launch covers layers of one segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvtier.device_pool import DeviceKVPool
from kvtier.errors import InvalidArgumentError, LayoutError
from kvtier.host_pool import HostKVPool
from kvtier.layout import LAYER_FIRST, PAGE_FIRST, check_layout, host_strides

META_HEADER = 8
META_STRIDE = 9
MAX_COMPONENTS = 4
#: int64 values one launch's metadata occupies (the kernel declares a buffer of this size).
META_SIZE = META_HEADER + META_STRIDE * MAX_COMPONENTS
H2D = 1
D2H = 2
DIRECTIONS = (H2D, D2H)
HOST_LAYOUT_MODES = {PAGE_FIRST: 0, LAYER_FIRST: 1}
#: The kernel sizes its index buffers as uint32 element counts.
MAX_INDEX_ELEMENTS = (1 << 32) - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class ComponentMeta:
    """The 9 per-component values, in the kernel's order."""

    device_base: int
    host_base: int
    device_layer_pitch: int
    device_page_pitch: int
    host_page_pitch: int
    host_layer_pitch: int
    width: int
    layer_lo: int
    layer_hi: int

    def values(self) -> tuple[int, ...]:
        return (self.device_base, self.host_base, self.device_layer_pitch,
                self.device_page_pitch, self.host_page_pitch, self.host_layer_pitch,
                self.width, self.layer_lo, self.layer_hi)

    def with_layers(self, lo: int, hi: int) -> "ComponentMeta":
        return ComponentMeta(self.device_base, self.host_base, self.device_layer_pitch,
                             self.device_page_pitch, self.host_page_pitch, self.host_layer_pitch,
                             self.width, lo, hi)


@dataclass(frozen=True)
class Segment:
    """Layers ``[lo, hi)`` that one launch can cover: every component's device layer addresses
    are evenly spaced over them. ``components`` carry ``layer_lo/hi = lo/hi``."""

    lo: int
    hi: int
    components: tuple[ComponentMeta, ...]


def header(num_components: int, num_pages: int, page_size: int, direction: int,
           device_indices_ptr: int, host_indices_ptr: int, host_layout: str) -> list[int]:
    """The 8 header values; validates what the kernel would silently misread."""
    if not 1 <= num_components <= MAX_COMPONENTS:
        raise LayoutError(f"kv_exchange_copy takes 1..{MAX_COMPONENTS} components, got "
                          f"{num_components}")
    if direction not in DIRECTIONS:
        raise InvalidArgumentError(f"direction must be {H2D} (H2D) or {D2H} (D2H), got "
                                   f"{direction!r}", argument="direction", value=direction)
    if num_pages < 0 or page_size <= 0:
        raise InvalidArgumentError(f"bad page count {num_pages} / page size {page_size}",
                                   argument="num_pages", value=num_pages)
    if num_pages * page_size > MAX_INDEX_ELEMENTS:
        raise InvalidArgumentError(f"{num_pages} pages of {page_size} tokens exceed the "
                                   f"kernel's {MAX_INDEX_ELEMENTS} index elements",
                                   argument="num_pages", value=num_pages)
    return [num_components, num_pages, page_size, direction, device_indices_ptr,
            host_indices_ptr, HOST_LAYOUT_MODES[check_layout(host_layout)], 0]


def pack(head: Sequence[int], components: Sequence[ComponentMeta]) -> list[int]:
    """One launch's metadata, zero-padded to ``META_SIZE`` int64 values."""
    vals = list(head)
    for comp in components:
        vals.extend(comp.values())
    if len(vals) > META_SIZE:
        raise LayoutError(f"metadata of {len(vals)} values exceeds {META_SIZE}")
    for v in vals:
        if not _INT64[0] <= v <= _INT64[1]:
            raise LayoutError(f"metadata value {v:#x} does not fit in int64")
    return vals + [0] * (META_SIZE - len(vals))


def layer_runs(addresses: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(lo, hi, pitch)`` of evenly spaced addresses (greedy, left to right);
    a run of one layer has pitch 0."""
    runs = []
    lo, n = 0, len(addresses)
    while lo < n:
        hi = lo + 1
        pitch = addresses[hi] - addresses[lo] if hi < n else 0
        while hi < n and addresses[hi] - addresses[hi - 1] == pitch:
            hi += 1
        runs.append((lo, hi, pitch if hi - lo > 1 else 0))
        lo = hi
    return runs


class ExchangePlan:
    """Everything about a (device pool, host pool) pair the metadata needs, computed once.

    ``host_dva`` is the device virtual address of the host pool's first byte
    (``host_pool.raw``): the kernel addresses host memory only through DVAs.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, host_dva: int):
        spec = device_pool.spec
        if host_pool.spec.fingerprint != spec.fingerprint:
            raise LayoutError(f"device pool spec {spec} differs from host pool spec "
                              f"{host_pool.spec}")
        if isinstance(host_dva, bool) or not isinstance(host_dva, int) or host_dva <= 0:
            raise InvalidArgumentError(f"host_dva must be a positive int, got {host_dva!r}",
                                       argument="host_dva", value=host_dva)
        self.spec = spec
        self.page_size = spec.page_size
        self.num_layers = spec.num_layers
        self.num_components = spec.num_components
        self.host_layout = host_pool.layout
        self.host_mode = HOST_LAYOUT_MODES[host_pool.layout]
        if self.num_components > MAX_COMPONENTS:
            raise LayoutError(f"{self.num_components} components exceed the kernel's "
                              f"{MAX_COMPONENTS}")
        isz = spec.itemsize
        width = spec.chunk_bytes

        # Host side: pitches straight from kvtier's layout math.
        st = host_strides(spec, host_pool.num_pages, host_pool.layout)
        if st[3] != spec.heads * spec.dim or st[4] != spec.dim or st[5] != 1:
            raise LayoutError(f"host layout {host_pool.layout} rows are not contiguous")
        host_page_pitch, host_layer_pitch = st[0] * isz, st[1] * isz

        comps: list[list[ComponentMeta]] = []     # [comp] -> per-layer metadata
        runs = []
        device_layers = device_pool.require_layers("ascendc")
        for c in range(self.num_components):
            tensors = device_layers[c]
            ptrs = [t.data_ptr() for t in tensors]
            per_layer = []
            for layer, t in enumerate(tensors):
                page_stride = t.stride(0) * spec.page_size * isz
                if t.stride(0) * isz != spec.row_bytes or t.stride(1) != spec.dim \
                        or t.stride(2) != 1:
                    raise LayoutError(f"device buffer [comp {c}][layer {layer}] has strides "
                                      f"{t.stride()}; kv_exchange_copy needs contiguous rows")
                per_layer.append(ComponentMeta(
                    device_base=ptrs[layer], host_base=host_dva + c * st[2] * isz,
                    device_layer_pitch=0, device_page_pitch=page_stride,
                    host_page_pitch=host_page_pitch, host_layer_pitch=host_layer_pitch,
                    width=width, layer_lo=layer, layer_hi=layer + 1))
            comps.append(per_layer)
            runs.append(layer_runs(ptrs))
        if self.host_mode == HOST_LAYOUT_MODES[LAYER_FIRST]:
            # The layer_first walker merges consecutive pages into one copy.
            pitches = {host_page_pitch} | {m.device_page_pitch for pl in comps for m in pl}
            if pitches != {width}:
                raise LayoutError("layer_first exchange needs page pitches equal to the row "
                                  f"width {width}, got {sorted(pitches)}")

        cuts = sorted({b for rs in runs for (lo, hi, _) in rs for b in (lo, hi)})
        segments = []
        for lo, hi in zip(cuts, cuts[1:]):
            seg_comps = []
            for c in range(self.num_components):
                pitch = next(p for (a, b, p) in runs[c] if a <= lo < b)
                m = comps[c][lo]
                seg_comps.append(ComponentMeta(
                    device_base=m.device_base - lo * pitch, host_base=m.host_base,
                    device_layer_pitch=pitch, device_page_pitch=m.device_page_pitch,
                    host_page_pitch=m.host_page_pitch, host_layer_pitch=m.host_layer_pitch,
                    width=m.width, layer_lo=lo, layer_hi=hi))
            segments.append(Segment(lo, hi, tuple(seg_comps)))
        self.segments: tuple[Segment, ...] = tuple(segments)
        self._segment_of = [s for s in self.segments for _ in range(s.lo, s.hi)]

    def segment_for_layer(self, layer: int) -> Segment:
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} out of range [0, {self.num_layers})")
        return self._segment_of[layer]

    def launches(self, direction: int, per_layer: bool) -> list[tuple[int, int]]:
        """Layer ranges of the launches of one call: one per layer (``per_layer``, used for
        layer-wise H2D), else one per segment (a single launch when the device pool's layers
        sit at one pitch)."""
        if direction not in DIRECTIONS:
            raise InvalidArgumentError(f"direction must be {H2D} or {D2H}, got {direction!r}",
                                       argument="direction", value=direction)
        if per_layer:
            return [(layer, layer + 1) for layer in range(self.num_layers)]
        return [(s.lo, s.hi) for s in self.segments]

    def rows(self, direction: int, num_pages: int, device_indices_ptr: int,
             host_indices_ptr: int, launches: Sequence[tuple[int, int]]) -> list[list[int]]:
        """The metadata of each launch: ``META_SIZE`` int64 values per ``(lo, hi)`` range
        (each range must lie inside one segment)."""
        head = header(self.num_components, num_pages, self.page_size, direction,
                      device_indices_ptr, host_indices_ptr, self.host_layout)
        out = []
        for lo, hi in launches:
            seg = self.segment_for_layer(lo)
            if not seg.lo <= lo < hi <= seg.hi:
                raise LayoutError(f"layers [{lo}, {hi}) do not lie inside one segment "
                                  f"[{seg.lo}, {seg.hi})")
            out.append(pack(head, [m.with_layers(lo, hi) for m in seg.components]))
        return out

    def rows_tensor(self, direction: int, num_pages: int, device_indices_ptr: int,
                    host_indices_ptr: int, launches: Sequence[tuple[int, int]],
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` as an int64 ``[len(launches), META_SIZE]`` CPU tensor (``out`` if given)."""
        vals = self.rows(direction, num_pages, device_indices_ptr, host_indices_ptr, launches)
        t = torch.tensor(vals, dtype=torch.int64).view(len(vals), META_SIZE)
        if out is None:
            return t
        out.view(len(vals), META_SIZE).copy_(t)
        return out


def token_indices(pages: torch.Tensor, page_size: int, arange: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Page indices -> the kernel's token indices ``p*page_size + t`` (on ``pages``' device).

    The kernel only reads the entry at ``i*page_size`` of each array, but documents them as
    token indices and sizes its buffers as ``num_pages*page_size``; we pass full arrays.
    """
    if arange is None:
        arange = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.to(torch.int64).unsqueeze(1) * page_size + arange).reshape(-1)
