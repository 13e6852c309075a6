"""The ``kvtier`` command: sub-commands from the ``kvtier.commands`` entry points, loaded
lazily, so ``--version``/``--help`` import neither torch nor any tool; user mistakes are one
line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier import cli

#: Modules of the tools (and torch) that listing the commands must not import.
HEAVY = ("torch", "numpy", "kvtier.bench.", "kvtier.demo", "kvtier.simulate", "kvtier.report",
         "kvtier.registry", "kvtier.interfaces", "kvtier.cache", "kvtier_nvidia_tma.limits")


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


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["bench", "--help"]])
def test_version_and_help_import_no_torch_and_no_tool(argv):
    heavy, out, elapsed = _modules_after(argv)
    assert heavy == [], f"kvtier {' '.join(argv)} imported {heavy}"
    assert out.strip()
    # measured against torch's own import in the same run: listing costs a fraction of it
    torch_s = _seconds("import torch")
    print(f"kvtier {' '.join(argv)}: {elapsed:.2f} s; python -c 'import torch': {torch_s:.2f} s")
    assert elapsed < torch_s


def test_help_lists_every_command_and_bench_children():
    _, out, _ = _modules_after(["--help"])
    for name in ("backends", "bench", "demo", "simulate"):
        assert name in out
    _, out, _ = _modules_after(["bench", "--help"])
    for name in ("keys", "transfer", "store", "control", "mooncake"):
        assert name in out


def test_a_command_help_loads_only_its_module():
    heavy, out, _ = _modules_after(["bench", "keys", "--help"])
    assert "kvtier.bench.keys" in heavy and "--json" in out or "usage" in out
    assert not [m for m in heavy if m.startswith(("kvtier.bench.transfer", "kvtier.demo",
                                                  "kvtier.simulate"))]


def test_import_kvtier_is_light_and_names_resolve_on_use():
    code = ("import sys, kvtier; light = not any(m.split('.')[0] == 'torch' for m in "
            "sys.modules); from kvtier import HostKVPool, KVTierError, Capabilities; "
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
