"""The kv_exchange_copy metadata builder against kvtier's layouts.

Every pitch and base is checked against a reference taken from the pools' own tensors (the host
pool's logical view, the device pool's page views): the address the kernel computes for every
(page, layer, component) must be the address of that chunk. Round trips then run the metadata
through the FAKE kernel (tests/fakes/fake_memfabric.py) over real memory.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import DeviceKVPool, HostKVPool, KVSpec
from kvtier.errors import InvalidArgumentError, LayoutError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.testing import fill_random
from kvtier_ascend import metadata as md
from kvtier_ascend.host_allocator import MemfabricHostAllocator

DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "int8"]
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@st.composite
def specs(draw) -> KVSpec:
    dtype = draw(st.sampled_from(DTYPES))
    layers = draw(st.integers(1, 4))
    page = draw(st.integers(1, 9))
    if draw(st.booleans()):
        return KVSpec.mha(num_layers=layers, num_kv_heads=draw(st.integers(1, 3)),
                          head_dim=draw(st.integers(1, 40)), page_size=page, dtype=dtype)
    return KVSpec.mla(num_layers=layers, kv_lora_rank=draw(st.integers(1, 40)),
                      rope_dim=draw(st.integers(0, 9)), page_size=page, dtype=dtype)


def scattered_device_pool(spec: KVSpec, num_pages: int, rng: random.Random) -> DeviceKVPool:
    """Per-(component, layer) tensors at uneven addresses: some layers are views of one block
    (evenly spaced), others separate allocations, in shuffled order."""
    slots = num_pages * spec.page_size
    comps = []
    for _ in range(spec.num_components):
        block = torch.empty((spec.num_layers + 2, slots, *spec.row_shape),
                            dtype=spec.torch_dtype)
        order = list(range(spec.num_layers + 2))
        if rng.random() < 0.5:
            rng.shuffle(order)
        layers = []
        for layer in range(spec.num_layers):
            if rng.random() < 0.4:
                layers.append(torch.empty((slots, *spec.row_shape), dtype=spec.torch_dtype))
            else:
                layers.append(block[order[layer]])
        comps.append(layers)
    pool = DeviceKVPool(spec, comps[0], comps[1] if spec.num_components == 2 else None)
    for comp in pool.layers:
        for t in comp:
            fill_random(t)
    return pool


def uniform_device_pool(spec: KVSpec, num_pages: int) -> DeviceKVPool:
    pool = DeviceKVPool.empty(spec, num_pages)
    for comp in pool.layers:
        for t in comp:
            fill_random(t)
    return pool


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, flat (bitwise comparison; -0.0 != 0.0 here)."""
    return t.contiguous().view(-1).view(torch.uint8)


def parse(row: list[int]) -> tuple[list[int], list[list[int]]]:
    head = row[:md.META_HEADER]
    comps = [row[md.META_HEADER + md.META_STRIDE * c:md.META_HEADER + md.META_STRIDE * (c + 1)]
             for c in range(head[0])]
    return head, comps


def check_plan_against_tensors(plan: md.ExchangePlan, dpool: DeviceKVPool, hpool: HostKVPool,
                               host_dva: int) -> None:
    spec = dpool.spec
    dva = lambda t: host_dva + (t.data_ptr() - hpool.raw.data_ptr())
    covered = []
    for seg in plan.segments:
        covered.extend(range(seg.lo, seg.hi))
        assert len(seg.components) == spec.num_components
        for c, m in enumerate(seg.components):
            assert (m.layer_lo, m.layer_hi) == (seg.lo, seg.hi)
            chunk = hpool.view[0, seg.lo, c]
            assert chunk.is_contiguous()
            assert m.width == chunk.numel() * chunk.element_size() == spec.chunk_bytes
            assert m.host_page_pitch == hpool.view.stride(0) * spec.itemsize
            assert m.host_layer_pitch == hpool.view.stride(1) * spec.itemsize
            assert m.host_base == dva(hpool.view[0, 0, c])
            pv = dpool.pages_view(c, seg.lo)
            assert m.device_page_pitch == pv.stride(0) * spec.itemsize
            if seg.hi - seg.lo > 1:
                assert m.device_layer_pitch == (dpool.layers[c][seg.lo + 1].data_ptr()
                                                - dpool.layers[c][seg.lo].data_ptr())
            for layer in range(seg.lo, seg.hi):
                for p in range(dpool.num_pages):      # kernel's device address, every page
                    assert (m.device_base + layer * m.device_layer_pitch
                            + p * m.device_page_pitch) == dpool.pages_view(c, layer)[p].data_ptr()
                for p in range(hpool.num_pages):      # kernel's host address, every page
                    assert (m.host_base + p * m.host_page_pitch + layer * m.host_layer_pitch
                            ) == dva(hpool.view[p, layer, c])
    assert covered == list(range(spec.num_layers)), "segments must tile the layers in order"


@SETTINGS
@given(spec=specs(), layout=st.sampled_from(["page_first", "layer_first"]),
       host_pages=st.integers(1, 6), dev_pages=st.integers(1, 6), scattered=st.booleans(),
       seed=st.integers(0, 2**16), dva_offset=st.integers(1, 2**40))
def test_every_pitch_and_base_matches_the_tensors(spec, layout, host_pages, dev_pages,
                                                  scattered, seed, dva_offset):
    rng = random.Random(seed)
    dpool = (scattered_device_pool(spec, dev_pages, rng) if scattered
             else uniform_device_pool(spec, dev_pages))
    hpool = HostKVPool(spec, host_pages, layout=layout, allocator=TorchPinnedAllocator())
    host_dva = (dva_offset << 12) | (hpool.raw.data_ptr() & 0xFFF)
    plan = md.ExchangePlan(dpool, hpool, host_dva)
    check_plan_against_tensors(plan, dpool, hpool, host_dva)
    if not scattered:
        assert len(plan.segments) == 1, "a pool from one block is one launch"

    # rows: header fields, one row per launch, components re-ranged per launch
    n = rng.randint(0, 5)
    for direction in md.DIRECTIONS:
        for per_layer in (True, False):
            launches = plan.launches(direction, per_layer)
            rows = plan.rows(direction, n, 0x1111, 0x2222, launches)
            assert len(rows) == len(launches)
            for (lo, hi), row in zip(launches, rows):
                assert len(row) == md.META_SIZE
                head, comps = parse(row)
                assert head == [spec.num_components, n, spec.page_size, direction, 0x1111,
                                0x2222, md.HOST_LAYOUT_MODES[layout], 0]
                assert all(v == 0 for v in row[md.META_HEADER
                                               + md.META_STRIDE * spec.num_components:])
                seg = plan.segment_for_layer(lo)
                for c, vals in enumerate(comps):
                    assert vals[7:] == [lo, hi]
                    assert vals[:7] == list(seg.components[c].values()[:7])
            if per_layer:
                assert launches == [(i, i + 1) for i in range(spec.num_layers)]
    t = plan.rows_tensor(md.H2D, n, 1, 2, plan.launches(md.H2D, True))
    assert t.dtype == torch.int64 and t.shape == (spec.num_layers, md.META_SIZE)
    hpool.close()


def test_header_values_and_validation():
    assert md.header(2, 7, 16, md.D2H, 10, 20, "layer_first") == [2, 7, 16, 2, 10, 20, 1, 0]
    assert md.header(1, 0, 1, md.H2D, 0, 0, "page_first") == [1, 0, 1, 1, 0, 0, 0, 0]
    with pytest.raises(LayoutError):
        md.header(0, 1, 1, md.H2D, 0, 0, "page_first")
    with pytest.raises(LayoutError):
        md.header(5, 1, 1, md.H2D, 0, 0, "page_first")
    with pytest.raises(InvalidArgumentError):
        md.header(1, 1, 1, 3, 0, 0, "page_first")
    with pytest.raises(InvalidArgumentError):
        md.header(1, 1 << 30, 8, md.H2D, 0, 0, "page_first")      # > uint32 index elements
    with pytest.raises(LayoutError):
        md.header(1, 1, 1, md.H2D, 0, 0, "page_last")
    with pytest.raises(LayoutError):
        md.pack([0] * 8, [md.ComponentMeta(*[0] * 9)] * 5)
    with pytest.raises(LayoutError):
        md.pack([1 << 63] + [0] * 7, [])


def test_layer_runs():
    assert md.layer_runs([100]) == [(0, 1, 0)]
    assert md.layer_runs([0, 10, 20, 30]) == [(0, 4, 10)]
    assert md.layer_runs([30, 20, 10]) == [(0, 3, -10)]
    assert md.layer_runs([0, 10, 20, 25, 30, 99]) == [(0, 3, 10), (3, 5, 5), (5, 6, 0)]
    assert md.layer_runs([5, 1, 7, 2]) == [(0, 2, -4), (2, 4, -5)]


def test_token_indices():
    pages = torch.tensor([3, 0, 7])
    assert md.token_indices(pages, 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31]
    assert md.token_indices(torch.tensor([], dtype=torch.int64), 4).numel() == 0
    assert md.token_indices(pages, 1).tolist() == [3, 0, 7]


def test_plan_refuses_bad_pools():
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    dpool = uniform_device_pool(spec, 3)
    hpool = HostKVPool(spec, 3, allocator=TorchPinnedAllocator())
    with pytest.raises(InvalidArgumentError):
        md.ExchangePlan(dpool, hpool, 0)
    other = HostKVPool(KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=2,
                                  dtype="float16"), 3, allocator=TorchPinnedAllocator())
    with pytest.raises(LayoutError):
        md.ExchangePlan(dpool, other, 1 << 40)
    plan = md.ExchangePlan(dpool, hpool, 1 << 40)
    with pytest.raises(LayoutError):
        plan.segment_for_layer(2)
    with pytest.raises(InvalidArgumentError):
        plan.launches(0, True)
    hpool.close()
    other.close()


# ----- round trips through the FAKE kernel -----------------------------------------------------
@SETTINGS
@given(spec=specs(), layout=st.sampled_from(["page_first", "layer_first"]),
       scattered=st.booleans(), seed=st.integers(0, 2**16), per_layer=st.booleans())
def test_round_trip_through_the_fake_kernel(ascend_fakes, spec, layout, scattered, seed,
                                            per_layer):
    npu, mf = ascend_fakes
    rng = random.Random(seed)
    host_pages, dev_pages = rng.randint(1, 7), rng.randint(1, 7)
    dpool = (scattered_device_pool(spec, dev_pages, rng) if scattered
             else uniform_device_pool(spec, dev_pages))
    alloc = MemfabricHostAllocator({"capacity_bytes": 1 << 24})
    with HostKVPool(spec, host_pages, layout=layout, allocator=alloc) as hpool:
        _round_trip(npu, mf, spec, dpool, hpool, rng, per_layer)


def _round_trip(npu, mf, spec, dpool, hpool, rng, per_layer) -> None:
    host_pages, dev_pages = hpool.num_pages, dpool.num_pages
    fill_random(hpool.raw)
    mf.device_regions = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                         for comp in dpool.layers for t in comp]
    host_dva = hpool.buffer.details["dva"] + (hpool.raw.data_ptr() - hpool.buffer.ptr)
    plan = md.ExchangePlan(dpool, hpool, host_dva)
    n = rng.randint(1, min(host_pages, dev_pages))
    # sorted runs make the layer_first walker merge consecutive pages
    h = sorted(rng.sample(range(host_pages), n)) if rng.random() < 0.5 \
        else rng.sample(range(host_pages), n)
    d = sorted(rng.sample(range(dev_pages), n)) if rng.random() < 0.5 \
        else rng.sample(range(dev_pages), n)
    h_tok = md.token_indices(torch.tensor(h), spec.page_size)
    d_tok = md.token_indices(torch.tensor(d), spec.page_size)
    dev_before = [[t.clone() for t in comp] for comp in dpool.layers]

    def run(direction: int) -> None:
        launches = plan.launches(direction, per_layer)
        meta = plan.rows_tensor(direction, n, d_tok.data_ptr(), h_tok.data_ptr(), launches)
        for i in range(len(launches)):
            assert mf.module.offload.kv_exchange_copy(meta[i], torch.device("cpu", 0)) == 0
        npu.synchronize()

    host_before = hpool.view.clone()
    run(md.D2H)
    for hp, dp in zip(h, d):
        for layer in range(spec.num_layers):
            for c in range(spec.num_components):
                assert torch.equal(raw(hpool.view[hp, layer, c]), raw(dpool.page(c, layer, dp)))
    for p in set(range(host_pages)) - set(h):
        assert torch.equal(raw(hpool.view[p]), raw(host_before[p]))
    for c, comp in enumerate(dpool.layers):                # D2H leaves the device alone
        for layer, t in enumerate(comp):
            assert torch.equal(raw(t), raw(dev_before[c][layer]))

    want = hpool.view.clone()
    for comp in dpool.layers:
        for t in comp:
            fill_random(t)
    poisoned = [[t.clone() for t in comp] for comp in dpool.layers]
    run(md.H2D)
    for hp, dp in zip(h, d):
        for layer in range(spec.num_layers):
            for c in range(spec.num_components):
                assert torch.equal(raw(dpool.page(c, layer, dp)), raw(want[hp, layer, c]))
    for c in range(spec.num_components):
        for layer in range(spec.num_layers):
            for p in set(range(dev_pages)) - set(d):
                old = poisoned[c][layer].view(dev_pages, spec.page_size, *spec.row_shape)[p]
                assert torch.equal(raw(dpool.page(c, layer, p)), raw(old))


def test_fake_kernel_rejects_an_hva_where_a_dva_belongs(ascend_fakes):
    """The check the round trips rely on: the fake kernel faults on a host HVA."""
    npu, mf = ascend_fakes
    spec = KVSpec.mla(num_layers=2, kv_lora_rank=8, rope_dim=0, page_size=2, dtype="float32")
    dpool = uniform_device_pool(spec, 2)
    hpool = HostKVPool(spec, 2, allocator=MemfabricHostAllocator({"capacity_bytes": 1 << 20}))
    plan = md.ExchangePlan(dpool, hpool, hpool.raw.data_ptr())      # wrong: the HVA
    tok = md.token_indices(torch.tensor([0]), 2)
    meta = plan.rows_tensor(md.D2H, 1, tok.data_ptr(), tok.data_ptr(), [(0, 2)])
    assert mf.module.offload.kv_exchange_copy(meta[0], torch.device("cpu", 0)) == 0
    with pytest.raises(RuntimeError, match="HVA where the kernel needs a DVA"):
        npu.synchronize()
    hpool.close()
