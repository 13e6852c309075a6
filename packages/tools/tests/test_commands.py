"""kvtier-tools' ``kvtier`` sub-commands: found through the ``kvtier.commands`` entry points of
this distribution, loaded lazily (listing them imports no tool module and no torch), user
mistakes one line and exit 2."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap

import pytest

from kvtier import cli

COMMANDS = {"demo": "kvtier_tools.demo.command", "simulate": "kvtier_tools.simulate",
            "bench": None, "bench.keys": "kvtier_tools.bench.keys",
            "bench.transfer": "kvtier_tools.bench.transfer",
            "bench.store": "kvtier_tools.bench.store",
            "bench.control": "kvtier_tools.bench.control",
            "bench.mooncake": "kvtier_tools.bench.mooncake_store",
            "bench.vllm": "kvtier_tools.bench.vllm",
            "bench.prefill": "kvtier_tools.bench.prefill",
            "bench.serve": "kvtier_tools.bench.serve"}
#: What listing the commands must not import (the records in kvtier_tools.commands it may).
HEAVY = ("torch", "numpy", "kvtier_tools.bench", "kvtier_tools.demo", "kvtier_tools.simulate",
         "kvtier_tools.trace", "kvtier.cache", "kvtier.registry")


def _modules_after(argv: list[str]) -> tuple[list[str], str]:
    """(heavy modules loaded, stdout) of ``kvtier argv`` in a fresh interpreter."""
    code = textwrap.dedent(f"""
        import sys, json, io, contextlib
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                from kvtier.cli import main
                main({argv!r})
            except SystemExit:
                pass
        heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))
        print(json.dumps([heavy, out.getvalue()]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    heavy, out = json.loads(proc.stdout.strip().splitlines()[-1])
    return heavy, out


def test_every_command_is_an_entry_point_of_this_distribution():
    eps = {ep.name: ep for ep in md.entry_points(group=cli.COMMAND_GROUP)
           if ep.dist is not None and ep.dist.name == "kvtier-tools"}
    assert set(eps) == set(COMMANDS) == {c for c in cli.TOOL_COMMANDS}
    found = cli.discover_commands()
    for name, module in COMMANDS.items():
        f = found[name]
        assert f.distribution == "kvtier-tools" and f.error == "", (name, f.error)
        assert f.command is not None and f.command.module == module, name
        assert cli.missing_tool(name.split("."), found) is None


def test_core_registers_none_of_them():
    core = {ep.name for ep in md.entry_points(group=cli.COMMAND_GROUP)
            if ep.dist is not None and ep.dist.name == "kvtier-core"}
    assert core == {"backends"}


def test_help_lists_the_commands_without_loading_them():
    heavy, out = _modules_after(["--help"])
    assert heavy == [] and "come with kvtier-tools" not in out
    for name in ("demo", "simulate", "bench"):
        assert name in out
    heavy, out = _modules_after(["bench", "--help"])
    assert heavy == []
    for name in ("keys", "transfer", "store", "control", "mooncake", "prefill", "vllm"):
        assert name in out


def test_version_loads_no_tool_module():
    code = ("import sys, io, contextlib; from kvtier.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['--version'])\n"
            "print([m for m in sys.modules if m.split('.')[0] in ('kvtier_tools', 'torch')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_a_command_help_loads_only_its_module():
    heavy, out = _modules_after(["bench", "keys", "--help"])
    assert "kvtier_tools.bench.keys" in heavy and "--json" in out
    assert not [m for m in heavy if m.startswith(("kvtier_tools.bench.transfer",
                                                  "kvtier_tools.demo", "kvtier_tools.simulate"))]


@pytest.mark.parametrize("argv, words", [
    (["simulate", "--trace", "t.jsonl", "--l1-pages", "1X", "--l2-pages", "4"],
     "argument --l1-pages: invalid int value: '1X'"),
    (["bench", "store", "--total", "1X"], "--total: '1X' is not a size"),
    (["bench", "store", "--page-sizes", "4K,big"], "--page-sizes: 'big' is not a size"),
    (["bench", "store", "--callers", "0"], "--callers must be >= 1, got 0"),
    (["bench", "store", "--batch", "-3"], "--batch must be >= 1, got -3"),
    (["bench", "store", "--io-depth", "-1"], "--io-depth must be >= 0, got -1"),
])
def test_user_mistakes_are_one_line_exit_2(argv, words):
    out = subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
        out.stderr
    assert words in out.stderr


def test_help_shows_defaults():
    _, out = _modules_after(["simulate", "--help"])
    assert "(default: write_through;" in out and "(default: wait_complete;" in out
    assert "(default 64)" in out and "(default: 64)" not in out      # said once
    assert "(default: None)" not in out and "(default: False)" not in out
