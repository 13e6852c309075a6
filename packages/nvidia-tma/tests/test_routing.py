"""CPU parts of the copy engine's addressing over pool.chunks and of the router's crossover:
the copy lists are replayed with memmove between CPU pools, bitwise, for every device layout."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch
from kvtier.errors import ConfigError
from kvtier.testing.contracts import DEVICE_LAYOUTS, layout_specs, make_layout_pool
from kvtier.testing.data import make_host_pool

from kvtier_nvidia_tma._plan import calibrated_rate, choose_crossover, copy_engine_falls_short
from kvtier_nvidia_tma.transfer_engine import chunk_runs, copy_list


def _replay(src, dst, sizes) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("which", [0, 1])
def test_copy_lists_move_every_layout_bitwise(layout, which, host_layout):
    spec = layout_specs(layout)[which]
    dpool = make_layout_pool(spec, layout, 11)
    hpool = make_host_pool(spec, 13, host_layout, "mmap")
    try:
        runs = chunk_runs(dpool, hpool)
        base = hpool.raw.data_ptr()
        rng = random.Random(which)
        src = rng.sample(range(dpool.num_pages), 7)
        host = rng.sample(range(hpool.num_pages), 7)
        want = [dpool.page_bytes(p) for p in src]
        _replay(*copy_list(runs, base, np.array(host), np.array(src), True, 0,
                           spec.num_layers))
        for i, p in enumerate(host):
            assert torch.equal(torch.cat(hpool.page_segments(p)), want[i])
        for layer in dpool.chunks:
            for c in layer:
                c.fill_(0xA5)
        dst = rng.sample(range(dpool.num_pages), 7)
        for layer in range(spec.num_layers):            # per-layer launches
            _replay(*copy_list(runs, base, np.array(host), np.array(dst), False, layer, 1))
        for i, p in enumerate(dst):
            assert torch.equal(dpool.page_bytes(p), want[i])
    finally:
        hpool.close()


def test_contiguous_runs_merge():
    """Sequential pages of a one-chunk layer are one copy on both sides."""
    spec = layout_specs("mla")[1]
    spec1 = type(spec).mla(num_layers=1, kv_lora_rank=20, rope_dim=4, page_size=3,
                           dtype="bfloat16")
    dpool = make_layout_pool(spec1, "mla", 8)
    hpool = make_host_pool(spec1, 8, "page_first", "mmap")
    try:
        src, dst, sizes = copy_list(chunk_runs(dpool, hpool), hpool.raw.data_ptr(),
                                    np.arange(8), np.arange(8), False, 0, 1)
        assert len(src) == 1 and int(sizes[0]) == 8 * spec1.page_bytes
    finally:
        hpool.close()


@pytest.mark.parametrize("table, within, want", [
    ({4096: (50, 5), 65536: (50, 51), 131072: (50, 52)}, 0.02, 65536),
    ({4096: (50, 5), 65536: (50, 48), 131072: (50, 52)}, 0.02, 131072),
    ({4096: (50, 5), 65536: (50, 48), 131072: (50, 52)}, 0.05, 65536),
    ({4096: (50, 5), 65536: (50, 30)}, 0.02, None),
    # a dip above a good size: only sizes from which on the copy engine always keeps up
    ({4096: (50, 50), 8192: (50, 20), 65536: (50, 51)}, 0.02, 65536),
])
def test_crossover_is_where_the_copy_engine_keeps_up(table, within, want):
    assert choose_crossover(table, within) == want


def test_crossover_margin_is_checked():
    with pytest.raises(ConfigError):
        choose_crossover({4096: (1, 1)}, 1.0)


def test_calibrated_rate_takes_the_largest_measured_size_not_above_the_chunk():
    table = {4096: (50.0, 4.0), 65536: (49.0, 47.0), 131072: (48.0, 49.0)}
    assert calibrated_rate(table, 100_000, 0) == 49.0
    assert calibrated_rate(table, 131072, 1) == 49.0
    assert calibrated_rate(table, 1024, 0) == 50.0          # below every size: the smallest
    assert calibrated_rate({}, 4096, 0) is None


@pytest.mark.parametrize("measured, sm, need, want", [
    ([30.0, 31.0], 50.0, 3, None),                  # not enough transfers yet
    ([30.0, 52.0, 31.0], 50.0, 3, True),            # median 31 < 0.9 x 50
    ([46.0, 20.0, 47.0], 50.0, 3, False),           # one slow transfer does not decide
    ([44.0, 44.5, 46.0], 50.0, 3, True),
    ([45.5, 45.5, 45.5], 50.0, 3, False),           # within the 10% margin
    ([1.0, 1.0, 1.0], None, 3, False),              # no SM rate known: keep the route
])
def test_copy_engine_route_is_kept_only_if_it_holds_up_in_use(measured, sm, need, want):
    assert copy_engine_falls_short(measured, sm, 0.10, need) is want
