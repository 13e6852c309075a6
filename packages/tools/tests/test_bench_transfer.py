"""kvtier bench transfer: argument checks, the control cases and the report (no GPU needed)."""

import pytest

from kvtier import cli
from kvtier_tools.bench import transfer


def test_bad_arguments_are_refused_before_anything_runs(capsys):
    assert cli.main(["bench", "transfer", "--cases", "mla-p1,nope"]) == 2
    assert "unknown case(s) nope" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--mixed", "nvidia-tma"]) == 2
    assert "LOAD_ENGINE+BACKUP_ENGINE" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--mixed", "a+"]) == 2
    assert cli.main(["bench", "transfer", "--mib", "0"]) == 2
    assert cli.main(["bench", "transfer", "--modes", "layer,layr"]) == 2
    assert "--modes: unknown layr" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--directions", "h2d,up"]) == 2
    assert "--directions: unknown up" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--order", "backwards"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--host-layout", "token_major"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--indices", "pinned"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--both-order", "together"])
    for bad in ("-1", "nan", "20000"):
        assert cli.main(["bench", "transfer", "--behind-ms", bad]) == 2


@pytest.mark.parametrize("case", [c for c in transfer.CASES if c.startswith("flat-")])
def test_flat_cases_are_one_chunk_per_page(case):
    spec = transfer.CASES[case]
    assert spec.num_layers == 1 and spec.num_components == 1
    assert spec.chunk_bytes == spec.page_bytes and spec.chunk_bytes % 16 == 0
    assert case not in transfer.DEFAULT_CASES


def test_parse_value():
    assert transfer.parse_value("4") == 4 and transfer.parse_value("0.5") == 0.5
    assert transfer.parse_value("False") is False and transfer.parse_value("x") == "x"


def test_render_names_the_order_the_host_layout_and_mixed_rows():
    row = {"case": "mla-p1", "chunk_bytes": 1152, "engine": "a+b", "config": {},
           "mode": "all", "direction": "both", "ctas": 4, "gbps": 60.0, "ratio": 0.6}
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0, "d2h": 50.0, "both": 100.0},
            "host_backing": "thp", "mib": 256, "order": "sequential",
            "host_layout": "layer_first", "results": [row]}
    out = transfer.render(data)
    assert "pages in sequential order, host pool layer_first" in out
    del data["host_layout"]             # a record from before the option: page_first
    out = transfer.render(data)
    assert "host pool page_first, page indices where each engine reads them" in out
    assert "page indices on the host" in transfer.render({**data, "indices": "host"})
    assert "| a+b " in out and "60.0%" in out


def test_render_says_how_transfers_were_timed():
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0}, "mib": 1, "results": []}
    assert "timed from an idle GPU" in transfer.render(data)
    assert "both directions called load-first" in transfer.render(data)
    out = transfer.render({**data, "behind_ms": 10.0, "both_order": "backup-first"})
    assert "the end of 10 ms of GPU work" in out and "called backup-first" in out


def test_render_shows_a_routing_engines_routes_only_where_there_is_one():
    """A router's rows (and GEMM rows) say where loads and backups went, and which direction
    its in-use check moved; tables of other engines keep their columns."""
    row = {"case": "mla-p64", "chunk_bytes": 73728, "engine": "e", "config": {}, "mode": "all",
           "direction": "h2d", "ctas": None, "gbps": 50.0, "ratio": 0.9, "info": {}}
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 55.0}, "mib": 1, "results": [row]}
    assert "routes" not in transfer.render(data)
    routed = {**row, "engine": "r", "info": {"route": {"h2d": "sm", "d2h": "copy_engine"},
                                             "rerouted": {"h2d": {"copy_engine_gbps": 20.0}}}}
    gemm = {"engine": "r", "case": "mla-p64", "priority": "high", "gemm_ms": 1.7,
            "slowdown": 0.05, "transfer_gbps": 45.0,
            "info": {"route": {"h2d": "copy_engine", "d2h": "copy_engine"}}}
    out = transfer.render({**data, "results": [row, routed], "gemm": [gemm]})
    assert "| SM / CE (moved: h2d) |" in out and "| CE / CE" in out
    assert "routes: where a routing engine sent loads / backups" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("| mla-p64")]
    assert lines[0].split("|")[-2].strip() == "-"      # the other engine's row: no route
    assert transfer._route_text({"route": {"h2d": "sm"}}) == "-"
    assert transfer._route_text(None) == "-"


class _FakeCuda:
    """torch.cuda's events for timed_ms on the CPU: each start/end pair reads the next GPU
    time of a script."""

    def __init__(self, gpu_ms):
        self.gpu_ms = list(gpu_ms)
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.gpu_ms.pop(0)
        self.Event = Event


def test_timed_ms_takes_medians_or_with_best_the_shortest(monkeypatch):
    """The first run is the warm-up; then medians, or with ``best`` the shortest GPU and
    call times (a noisy host only slows a run)."""
    import types
    calls = iter([0.001, 0.004, 0.003, 0.009, 0.001, 0.004, 0.003, 0.009])
    clock = [0.0]

    def fn():
        clock[0] += next(calls)
    monkeypatch.setattr(transfer.time, "perf_counter", lambda: clock[0])
    gpu = [9.0, 5.0, 2.0, 7.0]
    torch = types.SimpleNamespace(cuda=_FakeCuda(gpu + gpu))
    ms, call = transfer.timed_ms(torch, fn, 3)
    assert ms == 5.0 and call == pytest.approx(4.0)
    ms, call = transfer.timed_ms(torch, fn, 3, best=True)
    assert ms == 2.0 and call == pytest.approx(3.0)


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


class _Cuda:
    """The slice of torch.cuda ``_both`` uses, recording which stream each call ran on."""
    def __init__(self, log):
        self.log, self.cur = log, _Stream("cur", log)

    def current_stream(self):
        return self.cur

    def stream(self, s):
        cuda = self

        class Ctx:
            def __enter__(self):
                cuda.cur, self.prev = s, cuda.cur

            def __exit__(self, *exc):
                cuda.cur = self.prev
        return Ctx()


def _both_calls(order: str) -> list[str]:
    """What ``_both`` does, in order, with engines and streams that log each call."""
    log: list[str] = []
    cuda = _Cuda(log)
    torch = type("T", (), {"cuda": cuda})

    class Handle:
        def __init__(self, what):
            self.what = what

        def wait(self):
            log.append(f"{self.what} waited on {cuda.cur.name}")

    class Eng:
        def load(self, h, d, layers=None):
            log.append(f"load on {cuda.cur.name}")
            return Handle("load")

        def backup(self, d, h):
            log.append(f"backup on {cuda.cur.name}")
            return Handle("backup")
    transfer._both(torch, Eng(), Eng(), _Stream("side", log), 1, 2, 3, 4, order)
    return log


def test_both_directions_are_called_in_the_order_asked():
    """load-first calls the load on the caller's stream, then the backup on the side stream;
    backup-first the other way round; either way both are waited for on their own streams and
    the caller's stream ends after the side stream."""
    for order, first in (("load-first", "load"), ("backup-first", "backup")):
        log = _both_calls(order)
        calls = [x for x in log if " on " in x and "waited" not in x]
        assert calls[0].startswith(first) and len(calls) == 2
        assert "load on cur" in log and "backup on side" in log
        assert "backup waited on side" in log and "load waited on cur" in log
        assert log[0] == "side waits cur" and log[-1] == "cur waits side"
    with pytest.raises(ValueError, match="order"):
        _both_calls("together")


def test_ratios_use_the_higher_of_the_start_and_end_ceilings():
    """A ceiling measured low at the start (a link slow for a while) must not inflate the
    ratios: each direction takes the higher figure, both are kept and rendered, and the
    largest difference is returned so the run can report it."""
    rows = [{"case": "mla-p1", "chunk_bytes": 1152, "engine": "e", "config": {},
             "mode": "all", "direction": d, "ctas": 2, "gbps": g, "ratio": g / c}
            for d, g, c in (("h2d", 50.0, 55.0), ("d2h", 45.0, 50.0), ("both", 90.0, 68.6))]
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 55.0, "d2h": 50.0, "both": 68.6},
            "mib": 256, "results": rows}
    moved = transfer.settle_ceilings(data, {"h2d": 54.0, "d2h": 50.0, "both": 98.0})
    assert data["ceiling"] == {"h2d": 55.0, "d2h": 50.0, "both": 98.0}
    assert data["ceiling_start"]["both"] == 68.6 and data["ceiling_end"]["h2d"] == 54.0
    assert [round(r["ratio"], 4) for r in rows] == [round(50 / 55, 4), 0.9, round(90 / 98, 4)]
    assert moved == pytest.approx(1 - 68.6 / 98.0) and moved > transfer.CEILING_DRIFT
    out = transfer.render(data)
    assert "both 98.0 GB/s" in out and "start: h2d 55.0 GB/s" in out and "91.8%" in out
    steady = {"env": {}, "ceiling": {"h2d": 55.0}, "mib": 1, "results": []}
    assert transfer.settle_ceilings(steady, {"h2d": 54.5}) < transfer.CEILING_DRIFT


def test_engine_modes_and_indices_follow_declared_capabilities():
    """Engines without layerwise switches run their one (per-layer) mode; index tensors stay
    on the device unless the engine reads them on the host for that direction (its
    ``indices_on_host``), or ``--indices`` puts them on one side for every engine -- no engine
    named anywhere."""
    from kvtier.errors import InvalidArgumentError
    from kvtier.interfaces import Capabilities, TransferEngine
    from kvtier.transfer_engines.torch_engine import TorchTransferEngine
    assert transfer._modes(TorchTransferEngine, ["layer", "all"]) == ["layer"]
    assert transfer._with_mode(TorchTransferEngine, {"zero_copy": False}, "all") == \
        {"zero_copy": False}

    class Switches:
        class Config:
            __dataclass_fields__ = {"layerwise_load": 1, "layerwise_backup": 1}

        @classmethod
        def capabilities(cls):
            return Capabilities(host_indices=True)

        indices_on_host = TransferEngine.indices_on_host     # the default: the declaration
    assert transfer._modes(Switches, ["layer", "all"]) == ["layer", "all"]
    assert transfer._with_mode(Switches, {}, "all") == {"layerwise_load": False,
                                                         "layerwise_backup": False}
    # "default": the engine's own switches, or the sweep's where it sets them
    assert transfer._with_mode(Switches, {"ctas": 2}, "default") == {"ctas": 2}
    assert transfer._with_mode(Switches, {"layerwise_backup": True}, "default") == \
        {"layerwise_backup": True}
    assert transfer._modes(TorchTransferEngine, ["default"]) == ["layer"]

    class Idx:
        """Stands in for a device tensor: .cpu() says where the bench moved it."""
        def __init__(self, side="device"):
            self.side = side

        def cpu(self):
            return Idx("host")

    class Routed:                      # loads read on the host, backups on the device
        def indices_on_host(self, direction):
            return direction == "h2d"

    pools = {k: Idx() for k in ("host", "dev", "host2", "dev2")}

    def sides(eng, op, where="engine"):
        return tuple(t.side for t in transfer.indices(pools, eng, op, where))
    assert sides(Switches(), "load") == sides(Switches(), "backup") == ("host", "host")
    assert sides(Routed(), "load") == ("host", "host")
    assert sides(Routed(), "backup") == ("device", "device")
    assert sides(Routed(), "backup", "host") == ("host", "host")
    assert sides(Switches(), "load", "device") == ("device", "device")
    torch_eng = TorchTransferEngine.__new__(TorchTransferEngine)
    assert torch_eng.indices_on_host("d2h") is TorchTransferEngine.capabilities().host_indices
    with pytest.raises(InvalidArgumentError, match="direction"):
        torch_eng.indices_on_host("both")


def test_plot_has_one_panel_per_direction(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"case": c, "chunk_bytes": b, "engine": e, "config": {}, "mode": m,
             "direction": d, "ctas": None, "gbps": 40.0, "ratio": 0.8}
            for c, b in (("a", 1024), ("b", 65536)) for e in ("torch", "x")
            for m in ("layer", "all") for d in ("h2d", "d2h")]
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0, "d2h": 50.0, "both": 90.0},
            "results": rows}
    path = tmp_path / "p.png"
    transfer.plot(data, str(path))
    assert path.stat().st_size > 0


def test_plot_splits_a_swept_key_into_lines(tmp_path, monkeypatch):
    """--plot-split draws one line per value of a swept config key (labelled), where the
    default draws each engine's best setting."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    rows = [{"case": c, "chunk_bytes": b, "engine": "torch", "config": {"zero_copy": z},
             "mode": "layer", "direction": "h2d", "ctas": None, "gbps": 40.0,
             "ratio": 0.8 if z else 0.5} for c, b in (("a", 1024), ("b", 65536))
            for z in (True, False)]
    rows.append({**rows[0], "engine": "x", "mode": "default", "config": {}})
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0}, "results": rows}
    labels = []
    real = matplotlib.figure.Figure.legend
    monkeypatch.setattr(matplotlib.figure.Figure, "legend",
                        lambda self, h, lab, **k: labels.append(list(lab)) or real(self, h, lab,
                                                                                   **k))
    titles = []
    real_title = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **k: titles.append(t) or real_title(self, t, **k))
    transfer.plot(data, str(tmp_path / "best.png"))
    transfer.plot({**data, "behind_ms": 10.0, "both_order": "backup-first"},
                  str(tmp_path / "split.png"), split="zero_copy")
    assert "from an idle GPU" in titles[0] and "load-first" in titles[0]
    assert "behind 10 ms of GPU work" in titles[1] and "backup-first" in titles[1]
    assert labels[0] == ["torch (per-layer)", "x (engine's defaults)"]
    assert sorted(labels[1]) == ["torch (per-layer, zero_copy=False)",
                                 "torch (per-layer, zero_copy=True)", "x (engine's defaults)"]
    assert (tmp_path / "split.png").stat().st_size > 0


def test_host_copies_measure_both_ways_and_render():
    """The staged path's CPU side is measured (positive rates, torch's thread count) and
    named in the report."""
    import torch
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    got = transfer.host_copies(torch, buf, 3 << 20, repeat=1, row=64 << 10, staging=1 << 20)
    assert got["gather"] > 0 and got["scatter"] > 0
    assert got["threads"] == torch.get_num_threads()
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0}, "host_copies": got, "results": []}
    assert f"gather {got['gather']:.1f} GB/s" in transfer.render(data)
