"""Layout math against a plain reference (nested loops over the logical index)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVSpec, LayoutError
from kvtier import layout as L
from kvtier.device_pool import DeviceKVPool
from kvtier.testing import fill_random

DTYPES = ["float32", "bfloat16", "float16", "int8"]


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["mha", "mla"]))
    common = dict(num_layers=draw(st.integers(1, 4)), page_size=draw(st.integers(1, 6)),
                  dtype=draw(st.sampled_from(DTYPES)))
    if kind == "mha":
        return KVSpec(kind="mha", num_kv_heads=draw(st.integers(1, 3)),
                      head_dim=draw(st.integers(1, 9)), **common)
    return KVSpec(kind="mla", kv_lora_rank=draw(st.integers(1, 9)),
                  rope_dim=draw(st.integers(0, 4)), **common)


def reference_offset(spec, num_pages, layout, p, l, c, t, h, d):
    """Element offset by the definition in the module docstring, written out longhand."""
    Lr, C, S = spec.num_layers, spec.num_components, spec.page_size
    H, D = spec.row_shape
    if layout == "page_first":
        return ((((p * Lr + l) * C + c) * S + t) * H + h) * D + d
    return (((l * C + c) * (num_pages * S) + (p * S + t)) * H + h) * D + d


@settings(max_examples=60, deadline=None)
@given(spec=specs(), num_pages=st.integers(1, 5), layout=st.sampled_from(L.HOST_LAYOUTS))
def test_strides_offsets_and_view_match_reference(spec, num_pages, layout):
    st_ = L.host_strides(spec, num_pages, layout)
    H, D = spec.row_shape
    for p, l, c, t, h, d in itertools.product(range(num_pages), range(spec.num_layers),
                                              range(spec.num_components),
                                              range(spec.page_size), range(H), range(D)):
        off = sum(i * s for i, s in zip((p, l, c, t, h, d), st_))
        assert off == reference_offset(spec, num_pages, layout, p, l, c, t, h, d)
    raw = torch.empty(L.host_nbytes(spec, num_pages), dtype=torch.uint8)
    fill_random(raw)
    view = L.logical_view(raw, spec, num_pages, layout)
    assert tuple(view.shape) == (num_pages, spec.num_layers, spec.num_components,
                                 spec.page_size, H, D)
    assert view.stride() == st_
    flat = raw.view(spec.torch_dtype)
    for p in range(num_pages):
        for l in range(spec.num_layers):
            for c in range(spec.num_components):
                off = L.chunk_offset(spec, num_pages, layout, p, l, c)
                n = spec.chunk_bytes
                chunk = raw[off:off + n]
                assert torch.equal(chunk, view[p, l, c].contiguous().view(-1).view(torch.uint8))
    e = (num_pages - 1, spec.num_layers - 1, spec.num_components - 1, spec.page_size - 1,
         H - 1, D - 1)
    last = reference_offset(spec, num_pages, layout, *e)
    assert torch.equal(view[e].reshape(1).view(torch.uint8),
                       flat[last:last + 1].view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(spec=specs(), num_pages=st.integers(1, 5), layout=st.sampled_from(L.HOST_LAYOUTS))
def test_page_ranges_cover_the_page_exactly(spec, num_pages, layout):
    raw = torch.empty(L.host_nbytes(spec, num_pages), dtype=torch.uint8)
    fill_random(raw)
    view = L.logical_view(raw, spec, num_pages, layout)
    covered = torch.zeros_like(raw, dtype=torch.int32)
    for p in range(num_pages):
        ranges = L.page_ranges(spec, num_pages, layout, p)
        assert sum(n for _, n in ranges) == spec.page_bytes
        if layout == "page_first":
            assert len(ranges) == 1
        joined = torch.cat([raw[o:o + n] for o, n in ranges])
        assert torch.equal(joined, view[p].contiguous().view(-1).view(torch.uint8))
        for o, n in ranges:
            covered[o:o + n] += 1
    assert bool((covered == 1).all()), "pages overlap or leave holes"


@settings(max_examples=30, deadline=None)
@given(spec=specs(), num_pages=st.integers(1, 4), src=st.sampled_from(L.HOST_LAYOUTS),
       dst=st.sampled_from(L.HOST_LAYOUTS))
def test_conversion_preserves_every_element(spec, num_pages, src, dst):
    raw = torch.empty(L.host_nbytes(spec, num_pages), dtype=torch.uint8)
    fill_random(raw)
    out = L.convert_host(raw, spec, num_pages, src, dst)
    a = L.logical_view(raw, spec, num_pages, src)
    b = L.logical_view(out, spec, num_pages, dst)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    back = L.convert_host(out, spec, num_pages, dst, src)
    assert torch.equal(back, raw)


@settings(max_examples=30, deadline=None)
@given(spec=specs(), num_pages=st.integers(1, 5), data=st.data())
def test_device_page_views_and_gather(spec, num_pages, data):
    pool = DeviceKVPool.empty(spec, num_pages)
    for comp in pool.layers:
        for t in comp:
            fill_random(t)
    pages = data.draw(st.lists(st.integers(0, num_pages - 1), max_size=6))
    got = L.gather_device(pool.layers, spec, pages)
    for i, p in enumerate(pages):
        for l in range(spec.num_layers):
            for c in range(spec.num_components):
                S = spec.page_size
                ref = pool.layers[c][l][p * S:(p + 1) * S]
                assert torch.equal(got[i, l, c].view(torch.uint8), ref.view(torch.uint8))


def test_bad_layouts_and_buffers():
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32")
    with pytest.raises(LayoutError, match="column_first"):
        L.host_shape(spec, 2, "column_first")
    with pytest.raises(LayoutError, match="needs"):
        L.logical_view(torch.empty(10, dtype=torch.uint8), spec, 2, "page_first")
    with pytest.raises(LayoutError, match="uint8"):
        L.logical_view(torch.empty(64, dtype=torch.float32), spec, 2, "page_first")
    with pytest.raises(LayoutError, match="do not divide"):
        L.device_page_view(torch.empty(5, 1, 4), 2)


def test_device_pool_validation():
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
    good = [torch.empty(8, 2, 4) for _ in range(2)]
    DeviceKVPool(spec, good, [torch.empty(8, 2, 4) for _ in range(2)])
    cases = [
        ([torch.empty(8, 2, 4)], good, "layer buffers"),
        (good, [torch.empty(8, 2, 4, dtype=torch.float16)] * 2, "dtype"),
        (good, [torch.empty(8, 3, 4)] * 2, "shape"),
        ([torch.empty(6, 2, 4)] * 2, [torch.empty(6, 2, 4)] * 2, "multiple of page_size"),
        (good, [torch.empty(4, 2, 4)] * 2, "slots"),
        (good, [torch.empty(2, 4, 8).transpose(0, 2).transpose(1, 2)] * 2, "shape|contiguous"),
    ]
    for k, v, msg in cases:
        with pytest.raises(LayoutError, match=msg):
            DeviceKVPool(spec, k, v)
