"""CPU parts of the copy engine's addressing over pool.chunks and of the router's crossover:
the copy lists are replayed with memmove between CPU pools, bitwise, for every device layout."""

from __future__ import annotations

import ctypes
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvtier.errors import ConfigError
from kvtier.testing.contracts import DEVICE_LAYOUTS, layout_specs, make_layout_pool
from kvtier.testing.data import make_host_pool

from kvtier_nvidia_tma._plan import (PathRates, calibrated_rate, choose_crossover,
                                     copy_engine_falls_short, sm_beats_copy_in_use)
from kvtier_nvidia_tma._driver import OP3D
from kvtier_nvidia_tma.transfer_engine import (chunk_runs, copy_list, layer_copy_lists,
                                               strided_ops, strided_runs)


def _replay(src, dst, sizes) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


def _replay_strided(ops) -> None:
    """What cuMemcpy3DBatchAsync does with pointer operands: per op, ``height`` rows of
    ``width`` bytes, each side at its own row length (pitch)."""
    assert ops.dtype == OP3D
    for op in ops:
        assert op["src_type"] == op["dst_type"] == 1 and op["depth"] == 1 and op["order"] == 1
        assert op["src_row"] >= op["width"] and op["dst_row"] >= op["width"]
        assert op["src_height"] >= op["height"] and op["dst_height"] >= op["height"]
        for r in range(int(op["height"])):
            ctypes.memmove(int(op["dst_ptr"]) + r * int(op["dst_row"]),
                           int(op["src_ptr"]) + r * int(op["src_row"]), int(op["width"]))


@pytest.mark.parametrize("strided", [False, True], ids=["per-chunk", "strided"])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("which", [0, 1])
def test_copies_move_every_layout_bitwise(layout, which, host_layout, strided):
    """Per-chunk copy lists (layers allocated apart) and, where a pool's layers sit at one
    stride, strided copies over ranges of layers, replayed on CPU pools: random pages, odd
    sizes, both directions, bitwise."""
    spec = layout_specs(layout)[which]
    dpool = make_layout_pool(spec, layout, 11, one_block=strided)
    hpool = make_host_pool(spec, 13, host_layout, "mmap")
    try:
        runs = chunk_runs(dpool, hpool)
        rows = strided_runs(runs, spec.num_layers) if strided else None
        if strided:
            assert (rows is not None) is (spec.num_layers > 1), layout
            if rows is None:
                return
        base = hpool.raw.data_ptr()

        def move(h, d, d2h, layer0, layers):
            h, d = np.array(h), np.array(d)
            if rows is None:
                _replay(*copy_list(runs, base, h, d, d2h, layer0, layers))
            else:
                ops = strided_ops(rows, base, h, d, d2h, layer0, layers)
                assert len(ops) == len(h) * len(rows["nbytes"])
                _replay_strided(ops)
        rng = random.Random(which + 3 * strided)
        src = rng.sample(range(dpool.num_pages), 7)
        host = rng.sample(range(hpool.num_pages), 7)
        want = [dpool.page_bytes(p) for p in src]
        hpool.raw.fill_(0x5A)
        move(host, src, True, 0, spec.num_layers)
        for i, p in enumerate(host):
            assert torch.equal(torch.cat(hpool.page_segments(p)), want[i])
        for layer in dpool.chunks:
            for c in layer:
                c.fill_(0xA5)
        dst = rng.sample(range(dpool.num_pages), 7)
        if rows is None:                                 # per-layer launches
            ranges = [(layer, 1) for layer in range(spec.num_layers)]
        else:                                            # two ranges of layers
            cut = rng.randint(1, spec.num_layers - 1)
            ranges = [(0, cut), (cut, spec.num_layers - cut)]
        for layer0, layers in ranges:
            move(host, dst, False, layer0, layers)
        for i, p in enumerate(dst):
            assert torch.equal(dpool.page_bytes(p), want[i])
    finally:
        hpool.close()


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", DEVICE_LAYOUTS)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_per_layer_lists_are_each_layers_copies(layout, which, host_layout, order):
    """A per-layer transfer's copies built in one pass are, layer by layer, the copies of that
    layer alone (merges of sequential pages included, never across layers), and replayed in
    layer order they move every page bitwise."""
    spec = layout_specs(layout)[which]
    dpool = make_layout_pool(spec, layout, 11, one_block=which == 0)
    hpool = make_host_pool(spec, 13, host_layout, "mmap")
    try:
        runs = chunk_runs(dpool, hpool)
        base = hpool.raw.data_ptr()
        rng = random.Random(which + 7)
        if order == "random":
            host, dst = rng.sample(range(13), 7), rng.sample(range(11), 7)
        else:
            host, dst = list(range(2, 9)), list(range(3, 10))
        want = [torch.cat(hpool.page_segments(p)).clone() for p in host]
        for d2h in (False, True):
            got = layer_copy_lists(runs, base, np.array(host), np.array(dst), d2h,
                                   spec.num_layers)
            assert got is not None
            src, dstp, sizes, bounds = got
            assert bounds[0] == 0 and bounds[-1] == len(sizes)
            for layer in range(spec.num_layers):
                one = copy_list(runs, base, np.array(host), np.array(dst), d2h, layer, 1)
                a, b = bounds[layer], bounds[layer + 1]
                for x, y in zip(one, (src, dstp, sizes)):
                    assert np.array_equal(x, y[a:b]), (layer, d2h)
        for layer in dpool.chunks:
            for c in layer:
                c.fill_(0xA5)
        _replay(*layer_copy_lists(runs, base, np.array(host), np.array(dst), False,
                                  spec.num_layers)[:3])
        for i, p in enumerate(dst):
            assert torch.equal(dpool.page_bytes(p), want[i])
        uneven = {k: v[1:] for k, v in runs.items()}      # layer 0 short of a run
        if len(runs["layer"]) > spec.num_layers:
            assert layer_copy_lists(uneven, base, np.array(host), np.array(dst), False,
                                    spec.num_layers) is None
    finally:
        hpool.close()


def test_op_layout_is_cudas():
    """CUDA_MEMCPY3D_BATCH_OP as cuda.h (CUDA 13.0) lays it out: 112 bytes, operands of 40."""
    assert OP3D.itemsize == 112
    assert [OP3D.fields[k][1] for k in ("src_ptr", "src_row", "src_height", "dst_type",
                                         "dst_ptr", "width", "order", "flags")] == \
        [8, 16, 24, 40, 48, 80, 104, 108]


def _runs(layers, dev_base, dev_stride=1000, nbytes=64, host_pitch=128):
    n = len(layers)
    return {"layer": np.array(layers, dtype=np.int64),
            "dev_base": np.array(dev_base, dtype=np.uint64),
            "dev_stride": np.full(n, dev_stride, dtype=np.uint64),
            "host_off": np.array([host_pitch * g for g in layers], dtype=np.uint64),
            "host_stride": np.full(n, 4096, dtype=np.uint64),
            "nbytes": np.full(n, nbytes, dtype=np.uint64)}


@pytest.mark.parametrize("runs, ok", [
    (_runs([0, 1, 2], [10_000, 20_000, 30_000]), True),
    (_runs([0, 1, 2], [10_000, 20_000, 40_000]), False),    # layers not at one stride
    (_runs([0, 1, 2], [30_000, 20_000, 10_000]), False),    # a negative pitch
    (_runs([0, 1, 2], [10_000, 10_032, 10_064]), False),    # rows would overlap
    (_runs([0, 1, 2], [10_000, 20_000, 30_000], host_pitch=32), False),
    (_runs([0], [10_000]), False),                          # one layer: nothing to gain
    (_runs([0, 0, 1], [10_000, 10_500, 20_000]), False),    # layers with other runs
])
def test_strided_runs_only_where_layers_sit_at_one_stride(runs, ok):
    layers = int(runs["layer"].max()) + 1
    assert (strided_runs(runs, layers) is not None) is ok


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


def _rates(sm, ce, share=0.5, sm_idle=None, ce_idle=None):
    """A calibrated size: device rates ``sm`` and ``ce``, idle rates (default: the same)."""
    return PathRates(sm if sm_idle is None else sm_idle, ce if ce_idle is None else ce_idle,
                     sm, ce, share)


@pytest.mark.parametrize("table, within, want", [
    ({4096: _rates(50, 5), 65536: _rates(50, 51), 131072: _rates(50, 52)}, 0.02, 65536),
    ({4096: _rates(50, 5), 65536: _rates(50, 48), 131072: _rates(50, 52)}, 0.02, 131072),
    ({4096: _rates(50, 5), 65536: _rates(50, 48), 131072: _rates(50, 52)}, 0.05, 65536),
    ({4096: _rates(50, 5), 65536: _rates(50, 30)}, 0.02, None),
    # a dip above a good size: only sizes from which on the copy engine always keeps up
    ({4096: _rates(50, 50), 8192: _rates(50, 20), 65536: _rates(50, 51)}, 0.02, 65536),
    # device rates decide within the margin: an idle GPU waiting on the calls' host time
    # (0.77 of the SM path here) does not, up to the idle shortfall
    ({32768: _rates(50, 30), 65536: _rates(50, 51, ce_idle=38.5, share=1.2),
      131072: _rates(50, 52, ce_idle=43)}, 0.05, 65536),
    ({65536: _rates(50, 40, ce_idle=52)}, 0.05, None),
    # calls that leave an idle GPU waiting far longer: the SM kernel keeps those sizes
    ({16384: _rates(50, 52, ce_idle=14, share=3.5), 32768: _rates(50, 51, ce_idle=30.5),
      65536: _rates(50, 51, ce_idle=40)}, 0.05, 65536),
    ({16384: _rates(50, 52, ce_idle=14, share=3.5), 65536: _rates(50, 51, ce_idle=35)},
     0.05, 65536),
    # host time per byte only falls with larger chunks: a dip in the idle rate at one size
    # above a size that kept up is noise, not a limit (a dip in the device rate is not)
    ({16384: _rates(50, 52, ce_idle=24), 32768: _rates(50, 51, ce_idle=45),
      65536: _rates(50, 51, ce_idle=38.5), 131072: _rates(50, 51, ce_idle=47.5)}, 0.05, 32768),
    ({32768: _rates(50, 51, ce_idle=45), 65536: _rates(50, 45, ce_idle=45),
      131072: _rates(50, 51)}, 0.05, 131072),
])
def test_crossover_is_where_the_copy_engine_keeps_up(table, within, want):
    assert choose_crossover(table, within, 0.3) == want
    # the table as the cache holds it: a mapping per size
    assert choose_crossover({k: v._asdict() for k, v in table.items()}, within, 0.3) == want


def test_idle_shortfall_is_the_callers_setting():
    table = {16384: _rates(50, 52, ce_idle=14), 65536: _rates(50, 51, ce_idle=40)}
    assert choose_crossover(table, 0.05, 0.75) == 16384
    assert choose_crossover(table, 0.05, 0.1) is None


@pytest.mark.parametrize("within, shortfall", [(1.0, 0.3), (-0.1, 0.3), (0.05, 1.0),
                                               (0.05, -0.1)])
def test_crossover_settings_are_checked(within, shortfall):
    with pytest.raises(ConfigError):
        choose_crossover({4096: _rates(1, 1)}, within, shortfall)


def test_path_rates_read_from_a_mapping_or_in_order():
    r = _rates(50, 49, 0.3, 48, 47)
    assert PathRates.of(r._asdict()) == r == PathRates.of(list(r))
    with pytest.raises(KeyError):
        PathRates.of({"sm": 1.0})
    with pytest.raises(TypeError):
        PathRates.of([1.0, 2.0])


def test_calibrated_rate_takes_the_largest_measured_size_not_above_the_chunk():
    table = {4096: _rates(50.0, 4.0, ce_idle=3.0), 65536: _rates(49.0, 47.0, ce_idle=45.0),
             131072: _rates(48.0, 49.0, ce_idle=46.0)}
    assert calibrated_rate(table, 100_000, "sm") == 49.0
    assert calibrated_rate(table, 131072, "copy") == 46.0
    assert calibrated_rate(table, 131072, "copy_device") == 49.0
    assert calibrated_rate(table, 1024, "sm") == 50.0          # below every size: the smallest
    assert calibrated_rate({}, 4096, "sm") is None


@pytest.mark.parametrize("measured, expected, need, want", [
    ([30.0, 31.0], 50.0, 3, None),                  # not enough transfers yet
    ([30.0, 52.0, 31.0], 50.0, 3, True),            # median 31 < 0.9 x 50
    ([46.0, 20.0, 47.0], 50.0, 3, False),           # one slow transfer does not decide
    ([44.0, 44.5, 46.0], 50.0, 3, True),
    ([45.5, 45.5, 45.5], 50.0, 3, False),           # within the 10% margin
    ([1.0, 1.0, 1.0], None, 3, False),              # no calibrated rate: keep the route
])
def test_copy_engine_route_is_kept_only_if_it_holds_up_in_use(measured, expected, need, want):
    assert copy_engine_falls_short(measured, expected, 0.10, need) is want


@pytest.mark.parametrize("sm, copy, need, want", [
    ([40.0, 41.0], [30.0, 31.0, 32.0], 3, None),        # the trial has not timed enough yet
    ([40.0, 41.0, 39.0], [30.0, 31.0, 32.0], 3, True),  # 40 > 1.1 x 31: the SM kernel stays
    ([38.0, 39.0, 40.0], [38.5, 38.9, 39.5], 3, False),  # as slow in use: back to the copy engine
    ([42.0, 42.5, 43.0], [38.5, 38.9, 39.5], 3, False),  # 9% faster: within the margin
    ([43.0, 43.0, 60.0], [38.5, 38.9, 39.5], 3, True),   # 10.5% faster: past it
    ([10.0, 50.0, 11.0], [30.0, 31.0, 32.0], 3, False),  # one fast transfer does not decide
    ([5.0, 5.0, 5.0], [], 3, True),                     # nothing of the copy engine measured
])
def test_sm_kernel_is_kept_only_if_clearly_faster_under_the_same_load(sm, copy, need, want):
    """The trial that follows a copy-engine shortfall: both medians in use, the copy engine
    at equal rates (the SM kernel takes SMs from the model beside it)."""
    assert sm_beats_copy_in_use(sm, copy, 0.10, need) is want


def _entry(table):
    return {d: {"table": {str(k): v._asdict() for k, v in table.items()}, "crossover": 1024}
            for d in ("h2d", "d2h")}


class _Router:
    """What RoutedTransferEngine's cache handling reads of itself, without a GPU."""

    name = "nvidia-routed"

    def __init__(self, path):
        from kvtier_nvidia_tma.transfer_engine import RoutedTransferEngine as R
        self.config = R.Config(cache_file=str(path))
        self.sm = SimpleNamespace(_dev=SimpleNamespace(ordinal=0))
        self.spec = SimpleNamespace(num_layers=3)
        self._sm_cfg = {}
        for m in ("_calibration", "_from_cache", "_cache_path"):
            setattr(self, m, getattr(R, m).__get__(self))

    def _cache_key(self):
        return "this-gpu"

    def _copy_cfg(self):
        return {}


GOOD = {32768: _rates(50, 51, ce_idle=20, share=2.5), 65536: _rates(50, 51)}


def test_cached_calibration_chooses_its_crossover_again():
    """A cached table's crossover is chosen again with the engine's settings, not read."""
    got = _Router("none")._from_cache(_entry(GOOD))
    assert got["h2d"]["crossover"] == got["d2h"]["crossover"] == 65536
    assert PathRates.of(got["d2h"]["table"]["32768"]) == GOOD[32768]


@pytest.mark.parametrize("entry", [
    [], "x", {"h2d": {"table": {}}},                            # not a calibration
    {d: {"table": {}} for d in ("h2d", "d2h")},                 # no sizes
    {d: {"table": {"4096": [1.0, 2.0]}} for d in ("h2d", "d2h")},   # the old two-rate rows
    {d: {"table": {"4096": {**GOOD[65536]._asdict(), "sm": "fast"}}} for d in ("h2d", "d2h")},
    {d: {"table": {"4096": {**GOOD[65536]._asdict(), "copy": -3.0}}} for d in ("h2d", "d2h")},
    {d: {"table": {"4096": {**GOOD[65536]._asdict(), "copy_device": float("nan")}}}
     for d in ("h2d", "d2h")},
    {d: {"table": {"4 KiB": GOOD[65536]._asdict()}} for d in ("h2d", "d2h")},
])
def test_a_cached_calibration_that_is_not_one_is_refused(entry):
    with pytest.raises(ValueError):
        _Router("none")._from_cache(entry)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"this-gpu": [3]}),
                                     json.dumps({"this-gpu": {"h2d": 1}, "other-gpu": 7})])
def test_a_hostile_calibration_cache_costs_a_new_calibration(tmp_path, monkeypatch, content,
                                                             caplog):
    """A cache file that is not what this version writes is measured again (with a warning)
    and rewritten; other machines' entries in it are kept."""
    import logging

    from kvtier_nvidia_tma import routed
    measured = []

    def fake_calibrate(*args, **kwargs):
        measured.append(1)
        return _entry(GOOD)
    monkeypatch.setattr(routed, "calibrate", fake_calibrate)
    path = tmp_path / "routes.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        got, source = _Router(path)._calibration()
    assert source == "calibrated" and measured == [1] and "not used" in caplog.text
    assert got == _entry(GOOD)
    saved = json.loads(path.read_text())
    assert "this-gpu" in saved and (saved.get("other-gpu") == 7) == ("other-gpu" in content)
    again, source = _Router(path)._calibration()
    assert source == "cached" and measured == [1] and again["h2d"]["crossover"] == 65536


# ----- the router's config: the two paths' configs, composed ----------------------------------
def test_routed_config_composes_the_paths_configs():
    """Each path's settings are its engine's own config, nested; the engine-wide ones
    (layerwise, debug, device) are set once and given to both."""
    from kvtier.config import build_config
    from kvtier_nvidia_tma.copy_engine import CopyEngineTransferEngine
    from kvtier_nvidia_tma.routed import RoutedTransferEngine as R
    from kvtier_nvidia_tma.tma import TmaTransferEngine
    c = build_config(R.Config, {"layerwise_backup": True, "crossover_bytes": 1,
                                "copy_engine": {"max_batch": 64, "issue_thread": True},
                                "sm": {"ctas": 4, "warps": 8}}, section="nvidia-routed")
    assert isinstance(c.copy_engine, CopyEngineTransferEngine.Config)
    assert isinstance(c.sm, TmaTransferEngine.Config)
    assert (c.copy_engine.max_batch, c.copy_engine.issue_thread) == (64, True)
    assert (c.sm.ctas, c.sm.warps, c.sm.small_bytes) == (4, 8, 1024)
    assert c.copy_engine.layerwise_backup is c.sm.layerwise_backup is True
    d = build_config(R.Config, {}, section="nvidia-routed")
    assert d.copy_engine == CopyEngineTransferEngine.Config()
    assert d.sm == TmaTransferEngine.Config()
    with pytest.raises(ConfigError, match=r"nvidia-routed\.sm\.ctas must be an int"):
        build_config(R.Config, {"sm": {"ctas": 2.5}}, section="nvidia-routed")
    with pytest.raises(ConfigError, match=r"nvidia-routed\.copy_engine\.'warps'"):
        build_config(R.Config, {"copy_engine": {"warps": 8}}, section="nvidia-routed")


def test_sm_kernel_gets_its_settings_the_register_kernel_the_ones_it_has():
    from kvtier.config import build_config
    from kvtier_nvidia_tma.register import RegisterTransferEngine
    from kvtier_nvidia_tma.routed import RoutedTransferEngine as R, sm_config
    from kvtier_nvidia_tma.tma import TmaTransferEngine
    c = build_config(R.Config, {"debug": True, "sm": {"ctas": 3, "small_ctas": 4,
                                                       "side_stream": True}})
    tma = sm_config(c, TmaTransferEngine)
    assert build_config(TmaTransferEngine.Config, tma) == c.sm
    assert (tma["ctas"], tma["small_ctas"], tma["debug"]) == (3, 4, True)
    assert sm_config(c, RegisterTransferEngine) == {
        "ctas": 3, "side_stream": True, "layerwise_load": True, "layerwise_backup": False,
        "debug": True, "device": None}


@pytest.mark.parametrize("config, where", [
    ({"ctas": 4}, r"'ctas' moved to sm\.ctas .*pass \{\"sm\": \{\"ctas\": 4\}\}"),
    ({"max_batch": 64}, r"'max_batch' moved to copy_engine\.max_batch"),
    ({"issue_thread": True}, r"copy_engine\.issue_thread"),
    ({"layer_signals": False}, r"sm\.layer_signals"),
    ({"side_stream": True}, r"copy_engine\.side_stream or sm\.side_stream"),
    ({"copy_engine": {"layerwise_load": False}}, r"copy_engine\.layerwise_load goes at the top"),
    ({"sm": {"device": 0}}, r"sm\.device goes at the top level"),
])
def test_a_flat_path_key_is_a_config_error_saying_where_it_moved(config, where):
    """Keys that were the router's own before its config composed the paths' are refused
    with a one-line message naming their new place (before any GPU work: CPU pools here)."""
    from kvtier.testing.contracts import make_layout_pool
    from kvtier_nvidia_tma.routed import RoutedTransferEngine, check_moved_keys
    with pytest.raises(ConfigError, match=where) as err:
        check_moved_keys(config)
    assert "\n" not in str(err.value)
    spec = layout_specs("mla")[0]
    dpool = make_layout_pool(spec, "mla", 3)
    with make_host_pool(spec, 3) as hpool, pytest.raises(ConfigError, match=where):
        RoutedTransferEngine(dpool, hpool, config)
