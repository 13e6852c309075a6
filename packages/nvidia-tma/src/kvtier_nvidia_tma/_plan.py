"""Launch plans: how a transfer is cut into kernel work, as plain arithmetic (no CUDA needed).

The kernels under ``kernels/`` decode the same fields; :func:`simulate` replays a plan on
NumPy buffers exactly as the TMA kernel's pipelines would, so the plan math is tested on CPU.

Vocabulary (see ``kernels/kvt_common.cuh``): a *chunk* is the ``page_size`` rows of one
(page, layer, component), contiguous on both sides; a *segment* is a run of chunks of one pair
that is contiguous in host memory (all the launch's layers of a page_first page, or one chunk
of a layer_first pool); a *piece* is what one shared-memory stage holds.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from kvtier.errors import ConfigError, InvalidArgumentError, LayoutError

#: The tensor map moves 8-byte elements; a box row holds at most 256 of them.
TMAP_ELEM = 8
TMAP_MAX_BOX = 256
SMEM_ALIGN = 128
#: Register-kernel vector index space is 32-bit; launches are split to stay under this.
MAX_VECTORS = 1 << 30
#: Pieces one TMA launch may hold (the kernel deals them with 32-bit counters).
MAX_PIECES = 1 << 31


class KvtParams(ctypes.Structure):
    """ctypes mirror of ``struct KvtParams`` (all fields 8 bytes, same order)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "host_base", "dev_table", "host_idx", "dev_idx", "err",
        "host_page_stride", "host_chunk_stride", "chunk_bytes", "host_pages", "dev_pages",
        "n", "comps", "layer0", "layers", "d2h",
        "seg_chunks", "mode", "per_piece", "pieces_per_seg", "num_pieces",
        "slot_bytes", "stages", "stage_bytes", "use_tmap", "box_layers",
        "layer_flags", "loops")]


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Geometry:
    """What a launch needs to know about the two pools (byte units)."""

    chunk_bytes: int
    comps: int
    num_layers: int
    host_page_stride: int
    host_chunk_stride: int
    host_pages: int
    dev_pages: int

    @property
    def host_contiguous(self) -> bool:
        """True when a host page's (layer, comp) chunks follow each other (page_first)."""
        return self.host_chunk_stride == self.chunk_bytes


def host_strides(chunk_bytes: int, comps: int, num_layers: int, host_pages: int,
                 layout: str) -> tuple[int, int]:
    """(page stride, chunk stride) in bytes of a host pool, for the kernels' addressing."""
    if layout == "page_first":
        return chunk_bytes * comps * num_layers, chunk_bytes
    if layout == "layer_first":
        return chunk_bytes, host_pages * chunk_bytes
    raise LayoutError(f"unknown host layout {layout!r}")


def check_alignment(chunk_bytes: int, row_bytes: int, what: str = "") -> None:
    """Kernel engines move 16-byte vectors / bulk operations: rows must be 16-byte multiples."""
    if row_bytes % 16 or chunk_bytes % 16:
        raise LayoutError(f"{what}rows of {row_bytes} B are not a multiple of 16 B; the "
                          "NVIDIA kernel engines move 16-byte units (use nvidia-copy-engine "
                          "or pad the head dimension)")


# ----------------------------------------------------------------------------------------------
# Tensor map (device side of the TMA kernel)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMapGeometry:
    """Arguments of ``cuTensorMapEncodeTiled`` for the device pool, dims innermost first:
    (8-byte element of a chunk, device page, component, layer)."""

    base: int
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]      # bytes, for dims 1..3
    box: tuple[int, int, int, int]

    @property
    def box_bytes(self) -> int:
        b = TMAP_ELEM
        for d in self.box:
            b *= d
        return b


def uniform_strides(table: Sequence[int], comps: int, num_layers: int
                    ) -> tuple[int, int] | None:
    """(comp stride, layer stride) if every (layer, comp) buffer sits at
    ``base + comp * cs + layer * ls``, else None. Strides of a size-1 dimension are free."""
    base = table[0]
    cs = table[1] - base if comps > 1 else 0
    ls = table[comps] - base if num_layers > 1 else 0
    for layer in range(num_layers):
        for c in range(comps):
            if table[layer * comps + c] != base + c * cs + layer * ls:
                return None
    return cs, ls


def tensor_map_geometry(table: Sequence[int], geo: Geometry, layer0: int, layers: int,
                        box_layers: int) -> TensorMapGeometry | None:
    """Tensor map over layers ``[layer0, layer0 + layers)`` of the device pool, or None when
    the pool's geometry does not allow one (non-uniform or negative strides, chunks over
    2 KiB, a box over 256 rows)."""
    cb = geo.chunk_bytes
    if cb % 16 or cb // TMAP_ELEM > TMAP_MAX_BOX or geo.comps > TMAP_MAX_BOX \
            or not 0 < box_layers <= TMAP_MAX_BOX:
        return None
    st = uniform_strides(table, geo.comps, geo.num_layers)
    if st is None:
        return None
    cs, ls = st
    span = geo.dev_pages * cb
    # strides of size-1 dimensions are free: pick a legal value
    cs = cs if geo.comps > 1 else span
    ls = ls if layers > 1 else span
    strides = (cb, cs, ls)
    if any(s <= 0 or s % 16 or s >= 1 << 40 for s in strides):
        return None
    base = table[layer0 * geo.comps]
    if base % 16:
        return None
    return TensorMapGeometry(base=base, dims=(cb // TMAP_ELEM, geo.dev_pages, geo.comps, layers),
                             strides=strides, box=(cb // TMAP_ELEM, 1, geo.comps, box_layers))


# ----------------------------------------------------------------------------------------------
# TMA plan
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TmaPlan:
    seg_chunks: int
    mode: int
    per_piece: int
    pieces_per_seg: int
    num_pieces: int
    slot_bytes: int
    stages: int
    stage_bytes: int
    use_tmap: bool
    box_layers: int
    grid: int
    threads: int
    smem_bytes: int
    #: Copy pipelines (warps) per CTA; a launch with per-layer signals has one more warp, which
    #: publishes each finished layer group (``threads`` counts it).
    warps: int = 0
    signals: bool = False

    @property
    def pipes(self) -> int:
        """Copy pipelines in the launch."""
        return self.grid * self.warps

    def fill(self, p: KvtParams) -> KvtParams:
        for name in ("seg_chunks", "mode", "per_piece", "pieces_per_seg", "num_pieces",
                     "slot_bytes", "stages", "stage_bytes", "box_layers"):
            setattr(p, name, int(getattr(self, name)))
        p.use_tmap = int(self.use_tmap)
        return p


def tma_smem_bytes(warps: int, stages: int, stage_bytes: int, groups: int = 0) -> int:
    """Shared memory of a TMA launch: each pipeline's stage barriers (padded to 128 bytes),
    its stages, and with per-layer signals one 32-bit arrival counter per layer group."""
    counters = round_up(4 * groups, 16) if groups else 0
    return round_up(warps * stages * 8, SMEM_ALIGN) + warps * stages * stage_bytes + counters


def plan_tma(geo: Geometry, n: int, layers: int, *, ctas: int, warps: int, stages: int,
             stage_bytes: int, tmap_ok: bool, max_smem: int = 227 * 1024,
             stores_in_flight: int = 1, small_ctas: int = 0, small_bytes: int = 0,
             loops: int = 1, signals: bool = False) -> TmaPlan:
    """Cut ``n`` pairs x ``layers`` layers into pieces for ``ctas`` x ``warps`` pipelines
    (``small_ctas`` x ``warps`` where host segments are at most ``small_bytes``: such launches
    issue two bulk operations per segment, more than the bulk-copy units of ``ctas`` SMs issue
    at the link's rate). ``loops``: groups of ``layers`` layers the launch moves in turn (per-layer
    signals); the kernel counts the launch's pieces in 32 bits. ``signals``: the launch counts
    each finished group (``layer_flags``): one more warp per CTA publishes the counts, and the
    CTA keeps an arrival counter per group in shared memory.

    ``tmap_ok`` says the device pool allows a tensor map (uniform strides); it is used when the
    host side is page_first (a segment spans whole layers) and chunks are <= 2 KiB.
    """
    if stage_bytes % SMEM_ALIGN or stage_bytes <= 0:
        raise ConfigError(f"stage_bytes must be a positive multiple of {SMEM_ALIGN}, got "
                          f"{stage_bytes}", key="stage_bytes", value=stage_bytes)
    if stores_in_flight not in (0, 1, 2):
        raise ConfigError(f"stores_in_flight must be 0, 1 or 2, got {stores_in_flight}",
                          key="stores_in_flight", value=stores_in_flight)
    if stages < max(2, stores_in_flight + 1):
        raise ConfigError(f"stages must be >= {max(2, stores_in_flight + 1)} (stores_in_flight "
                          f"{stores_in_flight}), got {stages}", key="stages", value=stages)
    top = 31 if signals else 32       # a signalled launch adds its publishing warp
    if not 1 <= warps <= top:
        raise ConfigError(f"warps must be in [1, {top}]" + (" with per-layer signals (one more "
                          "warp publishes them)" if signals else "") + f", got {warps}",
                          key="warps", value=warps)
    if ctas < 1:
        raise ConfigError(f"ctas must be >= 1, got {ctas}", key="ctas", value=ctas)
    for key, val in (("small_ctas", small_ctas), ("small_bytes", small_bytes)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ConfigError(f"{key} must be an int >= 0, got {val!r}", key=key, value=val)
    smem = tma_smem_bytes(warps, stages, stage_bytes, loops if signals else 0)
    if smem > max_smem:
        raise ConfigError(f"warps x stages x stage_bytes needs {smem} B of shared memory (with "
                          f"{loops if signals else 0} layer-group counters), the "
                          f"device allows {max_smem} B per block", key="stage_bytes",
                          value=stage_bytes)
    cb, C = geo.chunk_bytes, geo.comps
    K = C * layers if geo.host_contiguous else 1
    seg_bytes = K * cb
    nsegs = n * (C * layers // K)
    small = cb <= TMAP_ELEM * TMAP_MAX_BOX
    use_tmap = False
    box_layers = 0
    if seg_bytes <= stage_bytes:
        mode, slot = 0, round_up(seg_bytes, SMEM_ALIGN)
        per_piece = stage_bytes // slot
        pps = 1
        num_pieces = ceil_div(nsegs, per_piece)
        if tmap_ok and geo.host_contiguous and small and layers <= TMAP_MAX_BOX:
            use_tmap, box_layers = True, layers
    elif cb <= stage_bytes:
        mode, slot = 1, 0
        per_piece = stage_bytes // cb
        if tmap_ok and geo.host_contiguous and small and stage_bytes >= C * cb:
            use_tmap = True
            box_layers = min(stage_bytes // (C * cb), TMAP_MAX_BOX)
            per_piece = box_layers * C
        pps = ceil_div(K, per_piece)
        num_pieces = nsegs * pps
    else:
        mode, slot = 2, 0
        per_piece = stage_bytes
        pps = K * ceil_div(cb, stage_bytes)
        num_pieces = nsegs * pps
    if num_pieces * loops >= MAX_PIECES:
        raise InvalidArgumentError(
            f"a launch of {num_pieces * loops} pieces of at most {stage_bytes} B; the TMA kernel "
            f"counts at most {MAX_PIECES - 1}: move the pages in smaller transfers")
    grid = max(ctas, small_ctas) if seg_bytes <= small_bytes else ctas
    return TmaPlan(seg_chunks=K, mode=mode, per_piece=per_piece, pieces_per_seg=pps,
                   num_pieces=num_pieces, slot_bytes=slot, stages=stages,
                   stage_bytes=stage_bytes, use_tmap=use_tmap, box_layers=box_layers,
                   grid=grid, threads=32 * (warps + int(signals)), smem_bytes=smem,
                   warps=warps, signals=signals)


@dataclass(frozen=True)
class Piece:
    """Python mirror of the kernel's ``Piece`` (kvt_piece in tma_copy.cu)."""

    seg0: int
    nseg: int
    chunk0: int
    nchunk: int
    off: int
    bytes: int


def decode_piece(p: KvtParams, k: int) -> Piece:
    K = p.seg_chunks
    nsegs = p.n * (p.comps * p.layers // K)
    if p.mode == 0:
        seg0 = k * p.per_piece
        return Piece(seg0, min(p.per_piece, nsegs - seg0), 0, K, 0, p.chunk_bytes)
    seg0, r = divmod(k, p.pieces_per_seg)
    if p.mode == 1:
        chunk0 = r * p.per_piece
        return Piece(seg0, 1, chunk0, min(p.per_piece, K - chunk0), 0, p.chunk_bytes)
    ppc = p.pieces_per_seg // K
    chunk0, part = divmod(r, ppc)
    off = part * p.per_piece
    return Piece(seg0, 1, chunk0, 1, off, min(p.per_piece, p.chunk_bytes - off))


def segment(p: KvtParams, s: int, loop: int = 0) -> tuple[int, int]:
    """Segment -> (pair index, absolute first chunk g), in group ``loop`` of a launch with
    per-layer signals (the launch's layers shifted by ``loop`` groups of ``p.layers``)."""
    per_pair = p.comps * p.layers // p.seg_chunks
    i, r = divmod(s, per_pair)
    return i, (p.layer0 + loop * p.layers) * p.comps + r * p.seg_chunks


def layer_signal_target(p: KvtParams, pipes: int) -> int:
    """What each layer group's counter of a launch with ``layer_flags`` reaches: one count per
    pipeline that holds pieces of the group (its pieces are consecutive items of the
    round-robin, see ``pipeline_items``, so that many pipelines hold them). Each CTA's
    publishing warp adds its own holders at once (:func:`group_holders_in_cta`)."""
    return min(pipes, p.num_pieces)


def group_holders_in_cta(num_pieces: int, pipes: int, warps: int, cta: int, group: int) -> int:
    """How many of CTA ``cta``'s ``warps`` pipelines hold pieces of layer group ``group``
    (mirrors the kernel's publishing warp): group ``g``'s items ``g * P .. g * P + P - 1`` go
    round-robin to pipelines ``(g * P) % pipes`` onwards, so pipeline ``q`` holds some iff
    ``(q - g * P) mod pipes < P``."""
    first = (group * num_pieces) % pipes
    return sum(1 for w in range(warps)
               if (cta * warps + w - first) % pipes < num_pieces)


# ----------------------------------------------------------------------------------------------
# Register plan
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegisterPlan:
    grid: int
    threads: int
    unroll: int
    batches: tuple[tuple[int, int], ...]    # (first pair, pairs) per launch

    @property
    def kernel(self) -> str:
        return f"kvt_register_u{self.unroll}"


def plan_register(geo: Geometry, n: int, layers: int, *, ctas: int, threads: int,
                  unroll: int) -> RegisterPlan:
    if ctas < 1:
        raise ConfigError(f"ctas must be >= 1, got {ctas}", key="ctas", value=ctas)
    if unroll not in (2, 4, 8):
        raise ConfigError(f"unroll must be 2, 4 or 8, got {unroll}", key="unroll", value=unroll)
    if threads % 32 or not 32 <= threads <= 1024:
        raise ConfigError(f"threads must be a multiple of 32 in [32, 1024], got {threads}",
                          key="threads", value=threads)
    per_pair = geo.comps * layers * (geo.chunk_bytes // 16)
    step = max(1, (MAX_VECTORS - ctas * threads * unroll) // per_pair)
    batches = tuple((i, min(step, n - i)) for i in range(0, n, step))
    return RegisterPlan(grid=ctas, threads=threads, unroll=unroll, batches=batches)


# ----------------------------------------------------------------------------------------------
# CPU replay of a TMA plan (tests)
# ----------------------------------------------------------------------------------------------
def simulate(p: KvtParams, host: bytearray, dev: dict[int, bytearray], host_idx: Sequence[int],
             dev_idx: Sequence[int], table: Sequence[int],
             tmap: TensorMapGeometry | None = None, *, pipes: int = 3,
             signals: list[int] | None = None, warps: int = 1) -> int:
    """Run the TMA kernel's piece loop on byte buffers, as ``pipes`` pipelines would.

    With ``p.layer_flags`` set the launch loops over ``p.loops`` groups of ``p.layers`` layers
    as the kernel does: each pipeline counts itself in its CTA's arrival counter for a group
    after its last piece of that group (the bytes of which are all in place by then, as the
    kernel's wait for the bulk group ensures), and each CTA of ``warps`` pipelines adds the
    holders :func:`group_holders_in_cta` names to ``signals[group]`` -- checked to be exactly
    the pipelines that arrived.

    ``host`` stands for the host pool (address ``p.host_base`` = offset 0); ``dev`` maps each
    device buffer base address to its bytes (a single block keyed by its base works too: an
    address is resolved to the buffer containing it). The index arrays and the device table
    are given as lists (the kernel reads them through ``p.host_idx`` etc.). Returns the number
    of pieces replayed.
    """

    def valid(i: int) -> tuple[bool, int, int]:
        h, d = host_idx[i], dev_idx[i]
        return (0 <= h < p.host_pages and 0 <= d < p.dev_pages), h, d

    def dev_span(addr: int, n: int) -> tuple[bytearray, int]:
        for base, buf in dev.items():
            if base <= addr and addr + n <= base + len(buf):
                return buf, addr - base
        raise AssertionError(f"device access {addr:#x}+{n} outside every buffer")

    def host_span(addr: int, n: int) -> int:
        off = addr - p.host_base
        assert 0 <= off and off + n <= len(host), f"host access {off}+{n} out of bounds"
        return off

    done = 0
    slot = p.slot_bytes if p.mode == 0 else 0
    arrived: dict[tuple[int, int], int] = {}         # (CTA, group) -> pipelines counted
    for pipe in range(pipes):
        for lay, k in pipeline_items(p, pipe, pipes):
            pc = decode_piece(p, k)
            stage = bytearray(p.stage_bytes)
            written = bytearray(p.stage_bytes)       # which stage bytes a load filled
            load_host = p.d2h == 0
            for side_host, load in ((load_host, True), (not load_host, False)):
                for kk in range(pc.nseg):
                    i, g = segment(p, pc.seg0 + kk, lay)
                    ok, h, d = valid(i)
                    if not ok:
                        continue
                    base = kk * slot
                    if side_host:
                        nb = pc.bytes if pc.nchunk == 1 else pc.nchunk * p.chunk_bytes
                        a = host_span(p.host_base + h * p.host_page_stride
                                      + (g + pc.chunk0) * p.host_chunk_stride + pc.off, nb)
                        assert base + nb <= p.stage_bytes
                        if load:
                            stage[base:base + nb] = host[a:a + nb]
                            written[base:base + nb] = b"\x01" * nb
                        else:
                            assert all(written[base:base + nb]), "store of unloaded bytes"
                            host[a:a + nb] = stage[base:base + nb]
                    elif p.use_tmap:
                        assert tmap is not None
                        layer = (g + pc.chunk0) // p.comps - p.layer0
                        _tmap_box(tmap, d, layer, stage, written, base, load, dev_span)
                    else:
                        for j in range(pc.nchunk):
                            a = table[g + pc.chunk0 + j] + d * p.chunk_bytes + pc.off
                            buf, o = dev_span(a, pc.bytes)
                            s0 = base + j * p.chunk_bytes
                            assert s0 + pc.bytes <= p.stage_bytes
                            if load:
                                stage[s0:s0 + pc.bytes] = buf[o:o + pc.bytes]
                                written[s0:s0 + pc.bytes] = b"\x01" * pc.bytes
                            else:
                                assert all(written[s0:s0 + pc.bytes]), "store of unloaded bytes"
                                buf[o:o + pc.bytes] = stage[s0:s0 + pc.bytes]
            done += 1
            if p.layer_flags and k + pipes >= p.num_pieces:    # its last piece of the group
                key = (pipe // warps, lay)
                arrived[key] = arrived.get(key, 0) + 1
    if p.layer_flags:
        assert signals is not None, "a launch with layer_flags needs signals"
        assert pipes % warps == 0, "pipelines come in CTAs of `warps`"
        for cta in range(pipes // warps):
            for g in range(p.loops):
                holders = group_holders_in_cta(p.num_pieces, pipes, warps, cta, g)
                assert holders == arrived.get((cta, g), 0), "publisher and pipelines disagree"
                signals[g] += holders
    return done


def pipeline_items(p: KvtParams, pipe: int, pipes: int) -> list[tuple[int, int]]:
    """The (layer group, piece) items pipeline ``pipe`` of ``pipes`` moves, in its order:
    the launch's items (every piece of group 0, then of group 1, ...) dealt round-robin over
    the pipelines as one sequence, as the kernel deals them."""
    loops = p.loops if p.layer_flags else 1
    return [divmod(q, p.num_pieces) for q in range(pipe, p.num_pieces * loops, pipes)]


def _tmap_box(t: TensorMapGeometry, page: int, layer: int, stage: bytearray, written: bytearray,
              base: int, load: bool, dev_span) -> None:
    """One tiled box at (0, page, 0, layer): rows in [layer][comp] order; layers past the
    map's extent are zero-filled on loads and skipped on stores (TMA out-of-bounds rules)."""
    E, _, C, L = t.dims
    row = E * TMAP_ELEM
    assert base % SMEM_ALIGN == 0, "tensor-map boxes need 128-byte aligned shared memory"
    assert base + t.box_bytes <= len(stage)
    for bl in range(t.box[3]):
        for c in range(C):
            s0 = base + (bl * C + c) * row
            l = layer + bl
            if l >= L:
                if load:
                    stage[s0:s0 + row] = bytes(row)
                    written[s0:s0 + row] = b"\x01" * row
                continue
            a = t.base + page * t.strides[0] + c * t.strides[1] + l * t.strides[2]
            buf, o = dev_span(a, row)
            if load:
                stage[s0:s0 + row] = buf[o:o + row]
                written[s0:s0 + row] = b"\x01" * row
            else:
                buf[o:o + row] = stage[s0:s0 + row]



# --------------------------------------------------------------------------------------------
# Chunk-size routing (nvidia-routed): where the copy engine takes over from the SM kernel
class PathRates(NamedTuple):
    """One calibrated chunk size of one direction: each path's GB/s timed from an idle GPU
    (the call's host time counts: the GPU waits on it), the same timed behind GPU work (the
    device's own rate: the call is queued while the GPU is busy), and the share of the copy
    engine's device time that its call holds the host (near or over 1, an idle GPU waits on
    the host: per-layer copy-engine transfers queue one copy per page and layer)."""

    sm: float
    copy: float
    sm_device: float
    copy_device: float
    copy_call_share: float

    @classmethod
    def of(cls, value: Any) -> "PathRates":
        """From a calibration table's entry: a mapping of the fields (what the cache holds)
        or the fields in order."""
        if isinstance(value, dict):
            return cls(**{k: float(value[k]) for k in cls._fields})
        return cls(*(float(v) for v in value))


def copy_engine_keeps_up(rates: PathRates, prefer_copy_within: float,
                         idle_shortfall: float) -> bool:
    """Whether the copy engine takes a chunk size: its device rate within
    ``prefer_copy_within`` of the SM path's, and from an idle GPU (where its calls' host time
    counts) at most ``idle_shortfall`` under the SM path."""
    return rates.copy_device >= (1 - prefer_copy_within) * rates.sm_device \
        and rates.copy >= (1 - idle_shortfall) * rates.sm


def choose_crossover(table: dict[int, Any], prefer_copy_within: float,
                     idle_shortfall: float = 0.5) -> int | None:
    """The smallest measured chunk size from which on the copy engine always keeps up
    (:func:`copy_engine_keeps_up`), given ``{chunk_bytes: PathRates}``; None when it never
    does (every size goes to the SMs).

    Device rates decide within the tight margin, not rates timed from an idle GPU: from idle a
    call's host time counts, and on the H200 it put the copy engine at 0.91-0.98 of the SM
    kernel at 64-256 KiB on one start and 0.77-0.86 on another, across a 5% margin, where
    behind GPU work it ran at 1.00-1.07 of it on every start. The idle rates only keep the copy
    engine from sizes where its calls leave an idle GPU waiting far longer (per-layer loads of
    a 61-layer pool at 1-8 KiB chunks: 0.02-0.30 of the SM kernel). Ties go to the copy
    engine on purpose: it leaves the SMs to the model (a GEMM beside the SM kernel's
    transfers slowed by 50%, beside the copy engine's by under 2%)."""
    for key, v in (("prefer_copy_within", prefer_copy_within),
                   ("idle_shortfall", idle_shortfall)):
        if not 0 <= v < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {v!r}", key=key, value=v)
    # Host time per byte only falls as chunks grow (fewer copies per byte), so where the copy
    # engine kept up from idle at a smaller size it keeps up at a larger one: a size's idle
    # ratio is the best one up to it (on the H200 one run read 0.77 at 64 KiB between 0.90 at
    # 32 KiB and 0.95 at 128 KiB).
    rates, best = {}, 0.0
    for c in sorted(table):
        r = PathRates.of(table[c])
        best = max(best, r.copy / r.sm if r.sm > 0 else 0.0)
        rates[c] = r._replace(copy=best * r.sm)
    cross = None
    for c in sorted(rates, reverse=True):
        if copy_engine_keeps_up(rates[c], prefer_copy_within, idle_shortfall):
            cross = c
        else:
            break
    return cross


def calibrated_rate(table: dict[int, Any], chunk_bytes: int, field: str) -> float | None:
    """The calibration's ``field`` of :class:`PathRates` at the largest measured chunk size not
    above ``chunk_bytes`` (the smallest one if all are above)."""
    if not table:
        return None
    sizes = sorted(table)
    below = [c for c in sizes if c <= chunk_bytes]
    return float(getattr(PathRates.of(table[below[-1] if below else sizes[0]]), field))


def median_rate(gbps: Sequence[float]) -> float:
    """The middle of the rates measured (the upper one of an even count), as the in-use check
    and its trial decide on."""
    return sorted(gbps)[len(gbps) // 2]


def copy_engine_falls_short(measured_gbps: Sequence[float], expected_gbps: float | None,
                            margin: float, need: int) -> bool | None:
    """Whether the copy engine, routed to on the calibration's word, delivers less in use than
    the margin allows against ``expected_gbps`` (its own calibrated rate from an idle GPU):
    None until ``need`` transfers are measured (their median decides), False when no rate is
    known."""
    if len(measured_gbps) < need:
        return None
    if not expected_gbps:
        return False
    return median_rate(measured_gbps) < (1 - margin) * expected_gbps


def sm_beats_copy_in_use(sm_gbps: Sequence[float], copy_gbps: Sequence[float],
                         margin: float, need: int) -> bool | None:
    """After the copy engine fell short of its calibrated rate in use, the SM kernel is tried
    on the same transfers: whether its median rate in use beats the copy engine's median in
    use by more than ``margin`` (None until ``need`` SM transfers are measured). Both are timed
    under the same load; a copy engine slowed by the host (other copies, memory traffic) is
    not compared with an SM kernel timed on an idle machine, and the SM kernel, which takes
    SMs from the model beside it, must be clearly faster to be kept."""
    if len(sm_gbps) < need:
        return None
    if not copy_gbps:
        return True
    return median_rate(sm_gbps) > (1 + margin) * median_rate(copy_gbps)
