"""kvtier_nvidia_tma.limits: the parts that need no GPU (config-space and CSV parsing, argument
checks)."""

import sys

import pytest

from kvtier_nvidia_tma import limits


def _config_space(devctl: int, devcap: int = 0x1, caps: bool = True, loop: bool = False) -> bytes:
    cfg = bytearray(256)
    if caps:
        cfg[6] = 0x10                        # status: capability list present
    cfg[0x34] = 0x40
    cfg[0x40], cfg[0x41] = 0x01, 0x60        # power management, next at 0x60
    cfg[0x60], cfg[0x61] = 0x10, (0x40 if loop else 0x00)   # PCI Express capability
    if loop:
        cfg[0x60] = 0x05                     # not PCIe: the list loops back to 0x40
    cfg[0x64:0x68] = devcap.to_bytes(4, "little")
    cfg[0x68:0x6A] = devctl.to_bytes(2, "little")
    return bytes(cfg)


def test_parse_pcie_config_reads_payload_and_read_request_sizes():
    devctl = (1 << 5) | (5 << 12)            # MPS 256 B, MRRS 4096 B
    got = limits.parse_pcie_config(_config_space(devctl, devcap=0x2))
    assert got == {"max_payload_supported": 512, "max_payload": 256,
                   "max_read_request": 4096}
    got = limits.parse_pcie_config(_config_space(0, devcap=0))
    assert got["max_payload"] == 128 and got["max_read_request"] == 128


def test_parse_pcie_config_malformed():
    assert "error" in limits.parse_pcie_config(b"\0" * 16)
    assert "error" in limits.parse_pcie_config(_config_space(0, caps=False))
    assert "error" in limits.parse_pcie_config(_config_space(0, loop=True))   # terminates


def test_pcie_config_bad_bus_id():
    assert "cannot parse" in limits.pcie_config("not-a-bus-id")["error"]


def test_parse_ncu_csv_skips_tool_chatter():
    text = ('==PROF== Connected to process 1\n'
            '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","kvt_tma_copy","pcie__read_bytes.sum","byte","73,326,592"\n'
            '==PROF== Disconnected\n')
    rows = limits._parse_ncu_csv(text)
    assert len(rows) == 1 and rows[0]["Metric Value"] == "73,326,592"
    assert limits._parse_ncu_csv("no csv here") == []


@pytest.mark.parametrize("argv, message", [
    (["gemm", "--cases", "nope"], "unknown case(s) nope"),
    (["gemm", "--ops", "loads,sideways"], "--ops: sideways"),
    (["gemm", "--config", "ctas"], "expected KEY=VALUE"),
    (["routes", "--config", "idle_shortfall"], "expected KEY=VALUE"),
    (["routes", "--repeat", "0"], "--repeat must be at least 1"),
    (["routes", "--cases", "mla-p64,nope"], "unknown case(s) nope"),
    (["queue", "--issue-threads", "1,two"], "--issue-threads: expected thread counts"),
    (["queue", "--issue-threads", "0,2"], "--issue-threads: expected thread counts"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        limits.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_without_kvtier_tools_it_is_one_line_saying_to_install_it(monkeypatch, capsys):
    """The probes share kvtier-tools' transfer cases; without it, ``kvtier bench limits`` says
    so in one line (exit 2) instead of a traceback."""
    from kvtier import cli
    for name in ("kvtier_tools", "kvtier_tools.bench", "kvtier_tools.bench.transfer"):
        monkeypatch.setitem(sys.modules, name, None)          # as if not installed
    assert cli.main(["bench", "limits", "gemm"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "needs kvtier-tools" in err and "pip install packages/tools" in err


def test_ncu_rows_derive_request_and_header_sizes():
    req = 500_000.0
    launches = {
        "0": {"kernel": "kvt_tma_copy", "metrics": {
            "lts__t_requests_srcunit_tex_aperture_sysmem_op_read.sum": req,
            "lts__t_sectors_srcunit_tex_aperture_sysmem_op_read.sum": 4 * req,
            "lts__t_requests_srcunit_tex_aperture_sysmem_op_write.sum": 3.0,   # ignored: few
            "lts__t_sectors_srcunit_tex_aperture_sysmem_op_write.sum": 3.0,
            "pcie__read_bytes.sum": 140 * req, "pcie__write_bytes.sum": 16 * req,
            "gpu__time_duration.sum": 1.28e6}},
        "1": {"kernel": "kvt_register_u8", "metrics": {
            "lts__t_requests_srcunit_tex_aperture_sysmem_op_write.sum": req,
            "lts__t_sectors_srcunit_tex_aperture_sysmem_op_write.sum": 4 * req,
            "pcie__read_bytes.sum": "n/a", "pcie__write_bytes.sum": 144 * req}},
    }
    rows = limits.ncu_rows(launches)
    assert len(rows) == 2 and all(len(r) == len(limits.NCU_COLUMNS) for r in rows)
    h2d, d2h = rows
    assert h2d[2] == "h2d" and h2d[5] == "128.0" and h2d[7] == "12.0" and h2d[9] == "16.0"
    assert h2d[10] == "50.0"                              # 64 MB in 1.28 ms
    assert d2h[2] == "d2h" and d2h[5] == "128.0" and d2h[7] == "-" and d2h[10] == "-"


def test_make_chain_is_one_cycle_through_every_slot():
    torch = pytest.importorskip("torch")
    step = limits.CHAIN_STRIDE // 8
    slots = 37
    words = torch.full((slots * step + 5,), -1, dtype=torch.int64)
    limits.make_chain(words, slots, seed=3)
    seen, idx = [], 0
    for _ in range(slots):                       # follow it as the kernel does
        seen.append(idx)
        idx = int(words[idx])
        assert idx % step == 0 and 0 <= idx < slots * step
    assert idx == 0 and sorted(seen) == [i * step for i in range(slots)]
    assert seen != sorted(seen)                  # random order, not a stride the GPU can guess
    untouched = torch.ones(words.numel(), dtype=torch.bool)
    untouched[torch.arange(slots) * step] = False
    assert bool((words[untouched] == -1).all())
    with pytest.raises(ValueError):
        limits.make_chain(words, slots + 1)


@pytest.mark.parametrize("argv, message", [
    (["gemm", "--cases", "nope"], "unknown case(s) nope"),
    (["gemm", "--ops", "sideways"], "--ops: sideways"),
])
def test_kvtier_bench_limits_is_the_same_tool(argv, message, capsys):
    """This package adds ``kvtier bench limits``; a bad value is one line, exit 2, before any
    GPU work."""
    from kvtier import cli
    assert cli.main(["bench", "limits", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_kvtier_bench_help_lists_limits_without_loading_it():
    import subprocess
    import sys
    code = ("import sys; from kvtier.cli import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED' if 'kvtier_nvidia_tma.limits' in sys.modules else 'LAZY')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "limits" in out and "(kvtier-nvidia-tma)" in out
    assert out.strip().endswith("LAZY")


def test_limits_sh_commands_parse():
    """Every kvtier command bench/limits.sh runs is accepted by kvtier's parser."""
    import shlex
    from pathlib import Path

    from kvtier import cli
    script = (Path(__file__).parents[1] / "bench" / "limits.sh").read_text()
    script = script.replace("\\\n", " ")
    runs = []
    for line in script.splitlines():
        if '-m kvtier ' not in line:
            continue
        words = shlex.split(line.split("-m kvtier ", 1)[1].split("2>&1")[0]
                            .replace('"$out', '"/tmp/out').replace('"$order"', "random")
                            .replace('"$cases"', "mla-p1"))
        args = cli.build_parser(words).parse_args(words)
        assert callable(args._run), words
        runs.append(words[:2])
    assert ["bench", "limits"] in runs and ["bench", "transfer"] in runs


def _run(case, route, table, within=0.05, shortfall=0.3):
    cal = {d: {"table": {str(k): v for k, v in table.items()}, "crossover": None}
           for d in ("h2d", "d2h")}
    return {"case": case, "run": 0, "route": {"h2d": route, "d2h": route}, "calibration": cal,
            "prefer_copy_within": within, "idle_shortfall": shortfall}


def test_queue_issue_threads_parse():
    args = limits.argparse.ArgumentParser()
    limits.add_arguments(args)
    ns = args.parse_args(["queue", "--issue-threads", "1, 2,8"])
    limits.check_arguments(ns)
    assert ns.issue_threads == [1, 2, 8]
    ns = args.parse_args(["queue", "--issue-threads", ""])
    limits.check_arguments(ns)
    assert ns.issue_threads == []


def test_routes_table_marks_the_sizes_the_copy_engine_takes():
    """Per calibrated size: CE/SM idle / behind work / call share, starred from the crossover
    the rule picks (device rates within the margin, idle rate within the shortfall); sizes a
    calibration skipped are dashes."""
    rates = {
        32768: {"sm": 50.0, "copy": 25.0, "sm_device": 50.0, "copy_device": 51.0,
                "copy_call_share": 1.9},
        65536: {"sm": 50.0, "copy": 40.0, "sm_device": 50.0, "copy_device": 51.0,
                "copy_call_share": 1.1},
        131072: {"sm": 50.0, "copy": 49.0, "sm_device": 50.0, "copy_device": 50.0,
                 "copy_call_share": 0.5}}
    out = limits.routes_table([_run("mla-p64", "copy_engine", rates)]).splitlines()
    assert "1 KiB" in out[1] and "256 KiB" in out[1]
    rows = [r for r in out if r.startswith("| mla-p64")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[:3] == ["mla-p64", "1", "h2d"] and cells[-1] == "copy_engine"
    by_size = dict(zip(["1", "4", "8", "16", "32", "64", "128", "256"], cells[3:-1]))
    assert by_size["1"] == "-" and by_size["256"] == "-"
    assert by_size["32"] == "0.50 / 1.02 / 1.90"                  # idle 50% under: not taken
    assert by_size["64"] == "0.80 / 1.02 / 1.10 *"
    assert by_size["128"] == "0.98 / 1.00 / 0.50 *"
    wide = limits.routes_table([_run("mla-p64", "sm", rates, shortfall=0.6)])
    assert "0.50 / 1.02 / 1.90 *" in wide
    slow = {**rates, 131072: {**rates[131072], "copy_device": 46.0}}   # device 8% under
    none = limits.routes_table([_run("mla-p64", "sm", slow)])
    assert "*" not in none.split("\n", 1)[1]


@pytest.mark.parametrize("argv, message", [
    (["--cases", "mla-p64,nope"], "unknown case(s) nope"),
    (["--repeat", "0"], "--mib and --repeat must be >= 1"),
])
def test_queue_layers_bench_refuses_bad_arguments(argv, message, capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "bench" / "queue_layers.py"
    spec = importlib.util.spec_from_file_location("queue_layers_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
