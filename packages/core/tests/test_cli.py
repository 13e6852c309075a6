"""The ``kvtier`` command: sub-commands from the ``kvtier.commands`` entry points, loaded
lazily, so ``--version``/``--help`` import neither torch nor any tool; user mistakes are one
line and exit 2; the tools' commands without kvtier-tools say how to install it. (The tools'
own commands: kvtier-tools' test_commands.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier import cli

#: Modules of the tools (and torch) that listing the commands must not import.
HEAVY = ("torch", "numpy", "kvtier_tools.bench", "kvtier_tools.demo", "kvtier_tools.simulate",
         "kvtier_tools.trace", "kvtier.report", "kvtier.registry", "kvtier.interfaces",
         "kvtier.cache", "kvtier_nvidia_tma.limits")


def _modules_after(argv: list[str], path: str | None = None) -> tuple[list[str], str, float]:
    """(heavy modules loaded, stdout, seconds) of ``kvtier argv`` in a fresh interpreter."""
    code = textwrap.dedent(f"""
        import sys, json, io, contextlib
        {'sys.path.insert(0, %r)' % path if path else ''}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                from kvtier.cli import main
                main({argv!r})
            except SystemExit:
                pass
        heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}) or
                       m.split('.')[0] in ('torch', 'numpy'))
        print(json.dumps([heavy, out.getvalue()]))
    """)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    elapsed = time.perf_counter() - t0
    heavy, out = json.loads(proc.stdout.strip().splitlines()[-1])
    return heavy, out, elapsed


def _seconds(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["backends", "--help"]])
def test_version_and_help_import_no_torch_and_no_tool(argv):
    heavy, out, elapsed = _modules_after(argv)
    assert heavy == [], f"kvtier {' '.join(argv)} imported {heavy}"
    assert out.strip()
    # measured against torch's own import in the same run: listing costs a fraction of it
    torch_s = _seconds("import torch")
    print(f"kvtier {' '.join(argv)}: {elapsed:.2f} s; python -c 'import torch': {torch_s:.2f} s")
    assert elapsed < torch_s


def test_help_lists_every_command():
    _, out, _ = _modules_after(["--help"])
    assert "backends" in out
    tools = "demo" in cli.discover_commands()
    for name in ("bench", "demo", "simulate"):          # kvtier-tools' (or how to get them)
        assert name in out
    assert ("come with kvtier-tools" in out) is not tools


def test_version_and_import_kvtier_load_no_tool_module():
    """Not even kvtier-tools' command records (where it is installed): ``--version`` reads no
    entry point."""
    code = ("import sys, io, contextlib, kvtier; from kvtier.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out: rc = main(['--version'])\n"
            "print(rc, out.getvalue().strip(), sorted(m for m in sys.modules if m.split('.')[0] "
            "in ('torch', 'numpy', 'kvtier_tools', 'kvtier_nvidia_tma')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    from kvtier import __version__
    assert out == f"0 kvtier {__version__} []"


def test_tool_commands_without_kvtier_tools_say_how_to_install_it(monkeypatch, capsys):
    core_only = {n: f for n, f in cli.discover_commands().items() if n == "backends"}
    monkeypatch.setattr(cli, "discover_commands", lambda: dict(core_only))
    for argv, name in ((["demo", "--model-size", "tiny"], "demo"), (["simulate"], "simulate"),
                       (["bench", "keys", "--json"], "bench keys"), (["bench"], "bench")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"kvtier {name}: error: not installed")
        assert 'pip install "kvtier[demo]"' in err and "packages/tools[demo]" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "demo, simulate and bench come with kvtier-tools" in capsys.readouterr().out


def test_a_vendor_benchmark_without_kvtier_tools_is_still_found():
    """``bench`` is a group kvtier-tools fills; a vendor's ``bench limits`` does not need it,
    while ``bench keys`` still says where it comes from."""
    found = {"bench.limits": cli._Found("bench.limits", cli.Command("x", "m"), "vendor")}
    assert cli.missing_tool(["bench", "limits"], found) is None
    assert cli.missing_tool(["bench"], found) is None
    assert cli.missing_tool(["bench", "keys"], found) == "bench keys"
    assert cli.missing_tool(["demo"], found) == "demo"
    assert cli.missing_tool(["backends"], {}) is None


def test_import_kvtier_is_light_and_names_resolve_on_use():
    code = ("import sys, kvtier; light = not any(m.split('.')[0] in ('torch', 'kvtier_tools') "
            "for m in sys.modules); from kvtier import HostKVPool, KVTierError, Capabilities; "
            "print(light, HostKVPool.__module__, KVTierError.__module__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "kvtier.host_pool", "kvtier.errors", "True"]
    import kvtier
    with pytest.raises(AttributeError):
        kvtier.no_such_name  # noqa: B018
    assert "HostKVPool" in dir(kvtier)


def _plugin_dist(root) -> None:
    info = root / "kvt_cmd_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvt-cmd-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""
        [kvtier.commands]
        hello = kvt_cmd_plugin:HELLO
        bench.hello = kvt_cmd_plugin:BENCH_HELLO
        broken = kvt_cmd_nonexistent:THING
        """))
    (root / "kvt_cmd_plugin.py").write_text(textwrap.dedent("""
        from kvtier.cli import Command
        HELLO = Command("say hello (a vendor command)", "kvt_cmd_impl")
        BENCH_HELLO = Command("a vendor benchmark", "kvt_cmd_impl")
        """))
    (root / "kvt_cmd_impl.py").write_text(textwrap.dedent("""
        from kvtier.errors import InvalidArgumentError
        def add_arguments(p):
            p.add_argument("--who", default="world")
        def run(args):
            if args.who == "bad":
                raise InvalidArgumentError("--who: bad is not a name", argument="who")
            print("hello", args.who)
            return 0
        """))


def test_vendor_commands_register_through_entry_points(tmp_path):
    _plugin_dist(tmp_path)
    heavy, out, _ = _modules_after(["--help"], str(tmp_path))
    assert "say hello (a vendor command)" in out and "unusable" in out   # broken one listed
    assert heavy == []
    _, out, _ = _modules_after(["bench", "--help"], str(tmp_path))
    assert "a vendor benchmark" in out
    base = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"]
    ok = subprocess.run(base + ["hello", "--who", "you"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "hello you\n"
    ok = subprocess.run(base + ["bench", "hello"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "hello world\n"
    bad = subprocess.run(base + ["hello", "--who", "bad"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == ("kvtier hello: error: InvalidArgumentError: --who: bad is "
                                  "not a name")
    broken = subprocess.run(base + ["broken"], capture_output=True, text=True)
    assert broken.returncode == 2 and "failed to load" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_unknown_command_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2


# ----- a CLI that fits (issue: tables wider than the terminal, tracebacks for typos) -----------
def test_table_wraps_long_cells_to_the_width():
    from kvtier.report import table
    rows = [["a", "short", "x " * 60], ["bb", "also-short", "y"]]
    text = table(["k", "name", "reason"], rows, width=50)
    assert max(len(line) for line in text.splitlines()) <= 50
    assert "also-short" in text                     # short columns are not broken
    words = " ".join(line.split("|")[3].strip() for line in text.splitlines()[2:])
    assert words.split() == ("x " * 60).split() + ["y"]          # nothing lost
    wide = table(["k", "name", "reason"], rows, width=None)
    assert len(wide.splitlines()) == 4                              # no limit: one line a row


def test_backends_fits_an_80_column_terminal():
    import os
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "kvtier", "backends"], capture_output=True,
                         text=True, env=env, check=True).stdout
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "torch" in out and "why / how:" in out


@pytest.mark.parametrize("argv, words", [
    (["backends", "--kind", "nope"], "argument --kind: invalid choice: 'nope'"),
    (["backends", "--jsn"], "unrecognized arguments: --jsn"),
])
def test_user_mistakes_are_one_line_exit_2(argv, words):
    out = subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
        out.stderr
    assert words in out.stderr


def test_parse_size():
    from kvtier.errors import InvalidArgumentError
    from kvtier.report import parse_size
    assert parse_size("4096") == 4096 and parse_size("256K") == 256 << 10
    assert parse_size("1.5M") == 3 << 19 and parse_size("1GiB") == 1 << 30
    assert parse_size(" 2mb ") == 2 << 20
    for bad in ("1X", "", "-4K", "0", "K", "nan", "1e3"):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad, "--total")


def test_progress_bar_stays_when_done():
    from kvtier.report import progress
    bar = progress(range(3), desc="x")
    assert bar.leave is True
    bar.close()
    assert list(progress(range(2), disable=True)) == [0, 1]
