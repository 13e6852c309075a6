"""Launch-plan and tensor-map math, replayed on CPU buffers exactly as the TMA kernel would."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvtier.errors import ConfigError, InvalidArgumentError, LayoutError

from kvtier_nvidia_tma._plan import (MAX_PIECES, Geometry, KvtParams, TmaPlan, check_alignment,
                                     group_holders_in_cta, host_strides, layer_signal_target,
                                     pipeline_items,
                                     plan_register, plan_tma, simulate, tensor_map_geometry,
                                     uniform_strides)
from kvtier_nvidia_tma.transfer_engine import merge_runs

DEV_BASE = 0x7F0000000000


def make_case(rng, *, chunk, comps, layers, host_pages, dev_pages, layout, uniform):
    hps, hcs = host_strides(chunk, comps, layers, host_pages, layout)
    geo = Geometry(chunk, comps, layers, hps, hcs, host_pages, dev_pages)
    host = bytearray(rng.randbytes(host_pages * comps * layers * chunk))
    dev: dict[int, bytearray] = {}
    table = []
    if uniform:   # one block [comp][layer][pages][chunk], like DeviceKVPool.empty
        block = bytearray(rng.randbytes(comps * layers * dev_pages * chunk))
        dev[DEV_BASE] = block
        for layer in range(layers):
            for c in range(comps):
                table.append(DEV_BASE + (c * layers + layer) * dev_pages * chunk)
    else:         # separate buffers in shuffled address order (no constant stride)
        slots = list(range(comps * layers))
        rng.shuffle(slots)
        for g in range(comps * layers):
            base = DEV_BASE + slots[g] * (dev_pages * chunk + 4096)
            dev[base] = bytearray(rng.randbytes(dev_pages * chunk))
            table.append(base)
    return geo, host, dev, table


def host_chunk(geo, host, h, g):
    o = h * geo.host_page_stride + g * geo.host_chunk_stride
    return bytes(host[o:o + geo.chunk_bytes])


def dev_chunk(geo, dev, table, d, g):
    a = table[g] + d * geo.chunk_bytes
    for base, buf in dev.items():
        if base <= a < base + len(buf):
            return bytes(buf[a - base:a - base + geo.chunk_bytes])
    raise AssertionError("address outside the device buffers")


def params(geo, n, layer0, layers, d2h, plan: TmaPlan) -> KvtParams:
    p = KvtParams()
    p.host_base, p.dev_table, p.host_idx, p.dev_idx, p.err = 0, 0, 0, 0, 0
    p.host_page_stride, p.host_chunk_stride = geo.host_page_stride, geo.host_chunk_stride
    p.chunk_bytes, p.host_pages, p.dev_pages = geo.chunk_bytes, geo.host_pages, geo.dev_pages
    p.n, p.comps, p.layer0, p.layers, p.d2h = n, geo.comps, layer0, layers, int(d2h)
    return plan.fill(p)


CASES = [  # chunk, comps, layers, stage_bytes -> exercises modes 0, 1, 2
    (1152, 1, 7, 4096),      # MLA rows: per-layer mode 0; all-layer mode 1 (tmap boxes of 3)
    (1152, 1, 3, 8192),      # all-layer fits a stage: mode 0
    (96, 2, 3, 1024),        # MHA K/V, tiny chunks
    (5 * 256, 2, 2, 1024),   # chunk > stage: mode 2 (parts)
    (2048, 2, 4, 2048),      # MHA, chunk == stage, tmap box of one layer
    (4096, 1, 2, 1536),      # > 2 KiB chunks: no tensor map, mode 2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[0]}x{c[1]}xL{c[2]}-s{c[3]}")
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "scattered"])
@pytest.mark.parametrize("d2h", [False, True], ids=["h2d", "d2h"])
def test_plan_moves_every_chunk_exactly(case, layout, uniform, d2h):
    chunk, comps, layers, stage = case
    rng = random.Random(hash((case, layout, uniform, d2h)) & 0xFFFF)
    geo, host, dev, table = make_case(rng, chunk=chunk, comps=comps, layers=layers,
                                      host_pages=11, dev_pages=13, layout=layout,
                                      uniform=uniform)
    n = 7
    hidx = rng.sample(range(11), n)
    didx = rng.sample(range(13), n)
    if d2h:
        didx[3] = didx[1]          # repeated sources are fine
    else:
        hidx[3] = hidx[1]
    hidx[5] = 11                   # out of range: skipped, nothing written through it
    for layer0, nl in [(0, layers), (layers - 1, 1)] + ([(1, layers - 1)] if layers > 2 else []):
        host0, dev0 = bytearray(host), {b: bytearray(v) for b, v in dev.items()}
        plan = plan_tma(geo, n, nl, ctas=2, warps=1, stages=3, stage_bytes=stage,
                        tmap_ok=uniform)
        tmap = None
        if plan.use_tmap:
            tmap = tensor_map_geometry(table, geo, layer0, nl, plan.box_layers)
            assert tmap is not None
        p = params(geo, n, layer0, nl, d2h, plan)
        assert simulate(p, host, dev, hidx, didx, table, tmap, pipes=3) == plan.num_pieces
        for i in range(n):
            h, d = hidx[i], didx[i]
            for g in range(geo.comps * layers):
                inside = layer0 * comps <= g < (layer0 + nl) * comps
                if i == 5 or not inside:   # untouched
                    assert host_chunk(geo, host, h, g) == host_chunk(geo, host0, h, g) \
                        if h < 11 else True
                    if not d2h and d < 13:
                        assert dev_chunk(geo, dev, table, d, g) == \
                            dev_chunk(geo, dev0, table, d, g)
                    continue
                if d2h:
                    assert host_chunk(geo, host, h, g) == dev_chunk(geo, dev0, table, d, g)
                else:
                    assert dev_chunk(geo, dev, table, d, g) == host_chunk(geo, host0, h, g)
        # nothing outside the moved pairs changed
        if d2h:
            moved = {hidx[i] for i in range(n) if i != 5}
            for h in set(range(11)) - moved:
                for g in range(geo.comps * layers):
                    assert host_chunk(geo, host, h, g) == host_chunk(geo, host0, h, g)
        else:
            moved = {didx[i] for i in range(n) if i != 5}
            for d in set(range(13)) - moved:
                for g in range(geo.comps * layers):
                    assert dev_chunk(geo, dev, table, d, g) == dev_chunk(geo, dev0, table, d, g)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[0]}x{c[1]}xL{c[2]}-s{c[3]}")
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "scattered"])
@pytest.mark.parametrize("d2h", [False, True], ids=["h2d", "d2h"])
@pytest.mark.parametrize("pipes,warps", [(1, 1), (3, 1), (40, 1), (6, 3), (40, 8)])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_layer_signalled_launch_moves_every_layer_and_counts_each(case, layout, uniform, d2h,
                                                                   pipes, warps, group):
    """Launches looping over groups of layers, each group cut as a launch of it would be
    (nvidia-tma's per-layer signals; a second launch for a shorter last group), move exactly
    what an all-layer launch moves, and every group's counter ends at the target the waiting
    stream uses, also with more pipelines than pieces."""
    chunk, comps, layers, stage = case
    rng = random.Random(hash((case, layout, uniform, d2h, pipes, warps, group)) & 0xFFFF)
    geo, host, dev, table = make_case(rng, chunk=chunk, comps=comps, layers=layers,
                                      host_pages=11, dev_pages=13, layout=layout,
                                      uniform=uniform)
    n = 5
    hidx, didx = rng.sample(range(11), n), rng.sample(range(13), n)
    G = min(group, layers)
    full, rest = divmod(layers, G)
    host0, dev0 = bytearray(host), {b: bytearray(v) for b, v in dev.items()}
    signals = [0] * (full + (1 if rest else 0))
    want = []
    for layer0, nl, loops in [(0, G, full)] + ([(full * G, rest, 1)] if rest else []):
        plan = plan_tma(geo, n, nl, ctas=2, warps=1, stages=3, stage_bytes=stage,
                        tmap_ok=uniform)
        tmap = None
        if plan.use_tmap and nl % plan.box_layers == 0:   # the engine's rule
            tmap = tensor_map_geometry(table, geo, layer0, nl * loops, plan.box_layers)
            assert tmap is not None
        elif plan.use_tmap:
            plan = plan_tma(geo, n, nl, ctas=2, warps=1, stages=3, stage_bytes=stage,
                            tmap_ok=False)
        p = params(geo, n, layer0, nl, d2h, plan)
        p.layer_flags, p.loops = 1, loops
        first = layer0 // G
        part = signals[first:first + loops]
        assert simulate(p, host, dev, hidx, didx, table, tmap, pipes=pipes,
                        signals=part, warps=warps) == plan.num_pieces * loops
        signals[first:first + loops] = part
        want += [layer_signal_target(p, pipes)] * loops
    assert signals == want and all(want)
    for i in range(n):
        for g in range(comps * layers):
            if d2h:
                assert host_chunk(geo, host, hidx[i], g) == \
                    dev_chunk(geo, dev0, table, didx[i], g)
            else:
                assert dev_chunk(geo, dev, table, didx[i], g) == \
                    host_chunk(geo, host0, hidx[i], g)


@pytest.mark.parametrize("seed", range(40))
def test_signalled_items_are_dealt_evenly_over_the_whole_launch(seed):
    """Every (group, piece) item goes to exactly one pipeline, each pipeline's items are in
    group order, no pipeline holds more than one item over another across the whole launch
    (groups whose piece count the pipelines do not divide included), and the pipelines that
    hold pieces of a group are as many as the group's counter waits for."""
    rng = random.Random(seed)
    p = KvtParams()
    p.num_pieces, p.loops, p.layer_flags = rng.randint(1, 300), rng.randint(1, 9), 1
    pipes = rng.choice([1, 2, 3, 7, 32, 64, 500])
    items = [pipeline_items(p, pipe, pipes) for pipe in range(pipes)]
    every = sorted(x for mine in items for x in mine)
    assert every == [(g, k) for g in range(p.loops) for k in range(p.num_pieces)]
    assert all(mine == sorted(mine) for mine in items)
    counts = [len(mine) for mine in items]
    assert max(counts) - min(counts) <= 1
    for g in range(p.loops):
        holders = sum(1 for mine in items if any(lay == g for lay, _ in mine))
        assert holders == layer_signal_target(p, pipes)


@pytest.mark.parametrize("seed", range(60))
def test_each_ctas_publisher_counts_exactly_its_pipelines_that_hold_a_group(seed):
    """The kernel's publishing warp (one per CTA) waits for, and adds, the number of its CTA's
    pipelines that hold pieces of each group, computed from the deal alone: for every group
    that equals the pipelines whose items include the group, and over the CTAs it adds up to
    the target the waiting stream uses -- with fewer pieces than pipelines, groups that start
    mid-CTA, and one CTA."""
    rng = random.Random(seed)
    p = KvtParams()
    p.num_pieces, p.loops, p.layer_flags = rng.randint(1, 200), rng.randint(1, 9), 1
    warps = rng.choice([1, 2, 3, 16, 31])
    ctas = rng.choice([1, 2, 3, 5])
    pipes = warps * ctas
    items = [pipeline_items(p, pipe, pipes) for pipe in range(pipes)]
    for g in range(p.loops):
        total = 0
        for cta in range(ctas):
            mine = sum(1 for w in range(warps)
                       if any(lay == g for lay, _ in items[cta * warps + w]))
            got = group_holders_in_cta(p.num_pieces, pipes, warps, cta, g)
            assert got == mine
            total += got
        assert total == layer_signal_target(p, pipes)


def test_a_signalled_launch_has_a_publishing_warp_and_group_counters():
    geo = Geometry(1152, 1, 61, 61 * 1152, 1152, 100, 100)
    args = dict(ctas=2, stages=3, stage_bytes=4096, tmap_ok=False)
    plain = plan_tma(geo, 100, 1, warps=16, **args)
    signalled = plan_tma(geo, 100, 1, warps=16, **args, loops=61, signals=True)
    assert plain.threads == 512 and signalled.threads == 544
    assert plain.pipes == signalled.pipes == 32 and signalled.signals and not plain.signals
    assert signalled.smem_bytes == plain.smem_bytes + 256       # 61 counters, 16-byte padded
    small = {**args, "stage_bytes": 1024}
    assert plan_tma(geo, 100, 1, warps=32, **small).threads == 1024
    assert plan_tma(geo, 100, 1, warps=31, **small, loops=61, signals=True).threads == 1024
    with pytest.raises(ConfigError, match="publishes") as ei:
        plan_tma(geo, 100, 1, warps=32, **small, loops=61, signals=True)
    assert ei.value.key == "warps"
    tight = plain.smem_bytes + 16                 # room for 4 counters, not for 61
    plan_tma(geo, 100, 1, warps=16, **args, loops=4, signals=True, max_smem=tight)
    with pytest.raises(ConfigError, match="61 layer-group counters"):
        plan_tma(geo, 100, 1, warps=16, **args, loops=61, signals=True, max_smem=tight)


def test_dealing_each_group_afresh_would_not_balance():
    """The case the launch-wide deal is for: 1190 pieces per layer over 32 pipelines, 61
    layers. Dealt per layer, 6 pipelines would move 38 pieces of every layer (2318) against
    an even share of 2268.4; dealt over the launch, none moves more than 2269."""
    p = KvtParams()
    p.num_pieces, p.loops, p.layer_flags = 1190, 61, 1
    assert max(len(pipeline_items(p, pipe, 32)) for pipe in range(32)) == 2269


def test_small_segments_get_more_ctas():
    """Launches whose host segments are at most small_bytes run on small_ctas CTAs (never
    fewer than ctas); 0 turns it off."""
    mha = Geometry(256, 2, 32, 32 * 2 * 256, 256, 100, 100)     # 512-byte segments per layer
    args = dict(ctas=2, warps=16, stages=3, stage_bytes=4096, tmap_ok=True)
    assert plan_tma(mha, 10, 1, **args, small_ctas=4, small_bytes=1024).grid == 4
    assert plan_tma(mha, 10, 2, **args, small_ctas=4, small_bytes=1024).grid == 4   # 1 KiB
    assert plan_tma(mha, 10, 2, **args, small_ctas=4, small_bytes=1023).grid == 2
    assert plan_tma(mha, 10, 32, **args, small_ctas=4, small_bytes=1024).grid == 2
    assert plan_tma(mha, 10, 1, **args, small_ctas=0, small_bytes=1024).grid == 2
    assert plan_tma(mha, 10, 1, **{**args, "ctas": 6}, small_ctas=4, small_bytes=1024).grid == 6
    layer_first = Geometry(256, 2, 32, 256, 100 * 256, 100, 100)  # every segment one chunk
    assert plan_tma(layer_first, 10, 32, **args, small_ctas=4, small_bytes=1024).grid == 4


@pytest.mark.parametrize("key,value", [("small_ctas", -1), ("small_bytes", -5),
                                       ("small_ctas", 2.5), ("small_bytes", True)])
def test_small_cta_settings_are_checked(key, value):
    geo = Geometry(256, 2, 4, 4 * 2 * 256, 256, 10, 10)
    with pytest.raises(ConfigError) as ei:
        plan_tma(geo, 3, 1, ctas=2, warps=2, stages=3, stage_bytes=4096, tmap_ok=False,
                 **{key: value})
    assert ei.value.key == key


def test_a_launch_past_the_kernels_32_bit_piece_count_is_refused():
    geo = Geometry(1152, 1, 61, 61 * 1152, 1152, 10, 10)
    args = dict(ctas=2, warps=16, stages=3, stage_bytes=4096, tmap_ok=False)
    plan = plan_tma(geo, 3000, 1, **args)
    loops = MAX_PIECES // plan.num_pieces
    plan_tma(geo, 3000, 1, **args, loops=loops)
    with pytest.raises(InvalidArgumentError, match="smaller transfers"):
        plan_tma(geo, 3000, 1, **args, loops=loops + 1)


def test_plan_modes_and_tensor_map_choice():
    mla = Geometry(1152, 1, 61, 61 * 1152, 1152, 100, 100)
    per_layer = plan_tma(mla, 1000, 1, ctas=2, warps=2, stages=4, stage_bytes=24576,
                         tmap_ok=True)
    assert per_layer.mode == 0 and per_layer.use_tmap and per_layer.box_layers == 1
    assert per_layer.per_piece == 24576 // 1152 and per_layer.slot_bytes == 1152
    all_layers = plan_tma(mla, 1000, 61, ctas=2, warps=2, stages=4, stage_bytes=24576,
                          tmap_ok=True)
    assert all_layers.mode == 1 and all_layers.box_layers == 21 and all_layers.per_piece == 21
    assert all_layers.pieces_per_seg == 3 and all_layers.num_pieces == 3000
    big = plan_tma(mla, 10, 61, ctas=2, warps=1, stages=2, stage_bytes=72 * 1024,
                   tmap_ok=True)
    assert big.mode == 0 and big.box_layers == 61 and big.slot_bytes == 61 * 1152
    mha = Geometry(128 * 1024, 2, 32, 64 * 128 * 1024, 128 * 1024, 10, 10)
    p2 = plan_tma(mha, 3, 32, ctas=2, warps=2, stages=4, stage_bytes=24576, tmap_ok=True)
    assert p2.mode == 2 and not p2.use_tmap
    assert p2.pieces_per_seg == 64 * 6 and p2.num_pieces == 3 * 64 * 6
    layer_first = Geometry(1152, 1, 61, 1152, 100 * 1152, 100, 100)
    p3 = plan_tma(layer_first, 5, 61, ctas=2, warps=2, stages=4, stage_bytes=24576,
                  tmap_ok=True)
    assert p3.seg_chunks == 1 and not p3.use_tmap and p3.mode == 0
    assert p3.smem_bytes == 128 + 2 * 4 * 24576 and p3.threads == 64 and p3.grid == 2


@pytest.mark.parametrize("kw,key", [
    ({"stage_bytes": 1000}, "stage_bytes"),
    ({"stages": 1}, "stages"),
    ({"warps": 0}, "warps"),
    ({"ctas": 0}, "ctas"),
    ({"stage_bytes": 128 * 1024, "stages": 4}, "stage_bytes"),   # over the smem limit
])
def test_plan_rejects_bad_config(kw, key):
    geo = Geometry(1152, 1, 4, 4 * 1152, 1152, 10, 10)
    args = dict(ctas=2, warps=2, stages=4, stage_bytes=24576, tmap_ok=False)
    args.update(kw)
    with pytest.raises(ConfigError) as ei:
        plan_tma(geo, 3, 4, **args)
    assert ei.value.key == key


def test_tensor_map_geometry():
    geo = Geometry(1152, 2, 4, 8 * 1152, 1152, 10, 50)
    span = 50 * 1152
    table = [DEV_BASE + (c * 4 + layer) * span for layer in range(4) for c in range(2)]
    assert uniform_strides(table, 2, 4) == (4 * span, span)
    t = tensor_map_geometry(table, geo, 1, 3, 3)
    assert t.base == table[2] and t.dims == (144, 50, 2, 3)
    assert t.strides == (1152, 4 * span, span) and t.box == (144, 1, 2, 3)
    assert t.box_bytes == 3 * 2 * 1152
    one = tensor_map_geometry(table, geo, 2, 1, 1)
    assert one.dims[3] == 1 and one.strides[2] % 16 == 0 and one.strides[2] > 0
    bad = list(table)
    bad[5] += 4096
    assert uniform_strides(bad, 2, 4) is None
    assert tensor_map_geometry(bad, geo, 0, 4, 4) is None
    desc = list(reversed(table))   # layers at decreasing addresses: negative stride
    assert tensor_map_geometry(desc, geo, 0, 4, 4) is None
    wide = Geometry(4096, 1, 2, 8192, 4096, 10, 10)
    assert tensor_map_geometry([DEV_BASE, DEV_BASE + 40960], wide, 0, 2, 2) is None


def test_register_plan_splits_large_launches():
    geo = Geometry(128 * 1024, 2, 80, 80 * 2 * 128 * 1024, 128 * 1024, 10 ** 6, 10 ** 6)
    plan = plan_register(geo, 5000, 80, ctas=2, threads=1024, unroll=4)
    assert sum(c for _, c in plan.batches) == 5000
    per_pair = 2 * 80 * 128 * 1024 // 16
    assert all(c * per_pair + 2 * 1024 * 4 < 2 ** 31 for _, c in plan.batches)
    assert [f for f, _ in plan.batches] == sorted(f for f, _ in plan.batches)
    assert plan.kernel == "kvt_register_u4"
    assert plan_register(geo, 1, 1, ctas=2, threads=1024, unroll=8).kernel == "kvt_register_u8"
    with pytest.raises(ConfigError):
        plan_register(geo, 1, 1, ctas=2, threads=2048, unroll=4)
    with pytest.raises(ConfigError):
        plan_register(geo, 1, 1, ctas=2, threads=100, unroll=4)
    with pytest.raises(ConfigError):
        plan_register(geo, 1, 1, ctas=2, threads=256, unroll=3)


def test_alignment_is_typed_error():
    check_alignment(1152, 1152)
    with pytest.raises(LayoutError, match="16"):
        check_alignment(40, 40)
    with pytest.raises(LayoutError):
        check_alignment(8 * 24, 24)


def test_merge_runs():
    src = np.array([0, 100, 200, 1000, 1100, 5000], dtype=np.uint64)
    dst = np.array([10, 110, 210, 50, 150, 7000], dtype=np.uint64)
    sizes = np.full(6, 100, dtype=np.uint64)
    s, d, n = merge_runs(src, dst, sizes)
    assert s.tolist() == [0, 1000, 5000] and d.tolist() == [10, 50, 7000]
    assert n.tolist() == [300, 200, 100]
    dst2 = dst.copy()
    dst2[1] = 999            # sources continue, destinations do not: no merge
    s, d, n = merge_runs(src, dst2, sizes)
    assert s.tolist() == [0, 100, 200, 1000, 5000] and n.tolist() == [100, 100, 100, 200, 100]


@pytest.mark.parametrize("n, max_batch, first, expect", [
    (10, 4, 0, [4, 4, 2]), (10, 0, 0, [10]), (10, 10, 0, [10]), (10, 64, 0, [10]),
    (1, 1, 0, [1]), (0, 4, 0, []),
    # a first small call, then 4x larger ones up to max_batch (or to the rest, max_batch 0)
    (10, 4, 2, [2, 4, 4]), (1000, 256, 16, [16, 64, 256, 256, 256, 152]), (10, 0, 3, [3, 7]),
    (10, 4, 16, [4, 4, 2]), (5, 256, 16, [5]), (17, 256, 16, [16, 1]),
])
def test_batch_copier_splits_batches(n, max_batch, first, expect):
    from kvtier_nvidia_tma._driver import BatchCopier
    copier = object.__new__(BatchCopier)       # no driver here: record the batches instead
    seen = []
    copier._batch = lambda d, s, z, stream: seen.append((d.tolist(), s.tolist(), z.tolist()))
    src = np.arange(n, dtype=np.uint64) * 100
    dst = src + 7
    sizes = np.full(n, 5, dtype=np.uint64)
    copier(dst, src, sizes, stream=0, max_batch=max_batch, first=first)
    assert [len(b[0]) for b in seen] == expect
    assert sum((b[1] for b in seen), []) == src.tolist()          # every copy once, in order
    assert sum((b[0] for b in seen), []) == dst.tolist()


def _fake_batch_copier(kind: str, rc: int = 0):
    """A BatchCopier whose driver entry points are fakes that record what they are given:
    ``cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)``
    (CUDA 13) or, for kind "batch", ``cuMemcpyBatchAsync`` with ``failIdx`` before the stream
    (CUDA 12.8); ``cuMemcpyAsync(dst, src, bytes, hStream)`` for the per-copy loop."""
    import ctypes

    from kvtier_nvidia_tma import _driver
    copier = object.__new__(_driver.BatchCopier)
    log: list = []

    def read(ptr, k):
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint64)),
                                     (k,)).tolist() if k else []

    def batch(*args):
        assert len(args) == (9 if kind == "batch" else 8)
        k = args[3].value
        assert args[6].value == 1                    # one attribute for every copy
        log.append(("batch", read(args[0], k), read(args[1], k), read(args[2], k),
                    args[-1].value))
        return rc

    def copy(d, s, n, stream):
        log.append(("copy", d.value, s.value, n.value, stream.value))
        return 0
    copier._fn, copier.kind, copier._copy = batch, kind, copy
    copier._attr = _driver._MemcpyAttributes(_driver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                             0, 0, 0, 0, 0)
    return copier, log


@pytest.mark.parametrize("kind", ["batch-v2", "batch"])
@pytest.mark.parametrize("max_batch, first", [(0, 0), (4, 0), (256, 0), (5, 2), (3, 16)])
def test_queue_layers_queues_each_layer_then_marks_it(kind, max_batch, first):
    from kvtier_nvidia_tma._driver import batch_sizes
    rng = np.random.default_rng(max_batch * 31 + first)
    counts = [int(x) for x in rng.integers(0, 12, size=7)] + [0, 9]   # empty layers too
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    n = bounds[-1]
    src = rng.integers(1 << 20, 1 << 40, size=n, dtype=np.uint64)
    dst = rng.integers(1 << 20, 1 << 40, size=n, dtype=np.uint64)
    sizes = rng.integers(1, 1 << 17, size=n, dtype=np.uint64)
    copier, log = _fake_batch_copier(kind)
    copier.queue_layers(dst, src, sizes, bounds, stream=0x5A, max_batch=max_batch, first=first,
                        after=lambda layer: log.append(("after", layer)))
    want = []
    for layer in range(len(counts)):
        a = bounds[layer]
        for k in batch_sizes(counts[layer], max_batch, first):
            want.append(("batch", dst[a:a + k].tolist(), src[a:a + k].tolist(),
                          sizes[a:a + k].tolist(), 0x5A))
            a += k
        want.append(("after", layer))
    assert log == want


def test_queue_layers_falls_back_to_one_copy_at_a_time():
    copier, log = _fake_batch_copier("batch-v2", rc=801)     # CUDA_ERROR_NOT_SUPPORTED
    src = np.array([10, 20, 30], dtype=np.uint64)
    dst = np.array([7, 8, 9], dtype=np.uint64)
    sizes = np.array([1, 2, 3], dtype=np.uint64)
    copier.queue_layers(dst, src, sizes, [0, 2, 3], stream=3,
                        after=lambda layer: log.append(("after", layer)))
    copies = [e for e in log if e[0] != "batch"]
    assert copies == [("copy", 7, 10, 1, 3), ("copy", 8, 20, 2, 3), ("after", 0),
                      ("copy", 9, 30, 3, 3), ("after", 1)]
    assert copier._fn is None and copier.kind == "loop"
    assert sum(e[0] == "batch" for e in log) <= 2       # not asked again for later layers


def test_queue_layers_names_a_driver_error():
    from kvtier.errors import TransferError
    copier, log = _fake_batch_copier("batch-v2", rc=1)       # CUDA_ERROR_INVALID_VALUE
    marks = []
    with pytest.raises(TransferError, match=r"cuMemcpyBatchAsync failed \(CUresult 1\)"):
        copier.queue_layers(np.arange(4, dtype=np.uint64), np.arange(4, dtype=np.uint64),
                            np.ones(4, dtype=np.uint64), [0, 2, 4], stream=0,
                            after=marks.append)
    assert marks == []                  # no layer is marked queued after a refused call
