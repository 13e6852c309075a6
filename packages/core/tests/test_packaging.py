"""What every distribution of the repository ships the same way: the Apache-2.0 LICENSE its
metadata declares, py.typed, a `runtime` extra for a vendor package's runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")


def _project(pkg: Path) -> dict:
    import tomllib
    return tomllib.loads((pkg / "pyproject.toml").read_text())["project"]


def test_every_distribution_ships_the_license_it_declares():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for pkg in [ROOT, *PACKAGES, ROOT / "examples" / "backend-template"]:
        assert _project(pkg)["license"] == "Apache-2.0", pkg
        assert (pkg / "LICENSE").read_text() == text, f"{pkg}/LICENSE differs from LICENSE"


def test_every_package_is_typed():
    for pkg in PACKAGES:
        (top,) = [d for d in (pkg / "src").iterdir() if d.is_dir() and d.name.isidentifier()]
        assert (top / "py.typed").exists(), top


def _is_vendor_package(pkg: Path) -> bool:
    """A package besides core that registers backends (kvtier-native-keys, an accelerator of
    core's own keys, registers none and has no vendor runtime)."""
    if sys.version_info < (3, 11):         # collected, then skipped (no tomllib)
        return pkg.name != "core"
    groups = _project(pkg).get("entry-points", {})
    return pkg.name != "core" and any(g in groups for g in (
        "kvtier.host_allocators", "kvtier.transfer_engines", "kvtier.l3_stores"))


@pytest.mark.parametrize("pkg", [p for p in PACKAGES if _is_vendor_package(p)],
                         ids=lambda p: p.name)
def test_vendor_runtime_extra_is_named_runtime(pkg):
    """One name across vendor packages: ``pip install 'kvtier-<vendor>[runtime]'``; the
    probe's install hint says the same."""
    proj = _project(pkg)
    extras = proj.get("optional-dependencies", {})
    assert extras.get("runtime"), f"{proj['name']} has no runtime extra"
    hints = "".join(p.read_text() for p in (pkg / "src").rglob("_probe.py"))
    assert f"{proj['name']}[runtime]" in hints
    for name, reqs in extras.items():       # the older names are aliases of runtime*
        if not name.startswith("runtime"):
            assert all(r.startswith(f"{proj['name']}[runtime") for r in reqs), (name, reqs)


#: Modules of kvtier-tools (packages/tools) that kvtier-core must not ship.
TOOL_MODULES = ("bench", "demo", "simulate", "trace")


def test_core_wheel_ships_no_tool_code(tmp_path):
    """``pip install packages/core`` installs no demo, benchmark or simulator: its wheel holds
    none of their modules, registers only its own command and has no ``demo`` extra."""
    import re
    import subprocess
    import zipfile
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                           "--wheel-dir", str(tmp_path), str(ROOT / "packages" / "core")],
                          capture_output=True, text=True)
    if proc.returncode != 0 and re.search(r"(No matching distribution|Could not find a "
                                          r"version).*hatchling", proc.stderr):
        pytest.skip(f"no hatchling to build with here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvtier_core-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tools = [n for n in names if n.startswith("kvtier/") and
             n.split("/")[1].removesuffix(".py") in TOOL_MODULES]
    assert tools == [] and not [n for n in names if n.startswith("kvtier_tools")], tools
    assert "kvtier/cli.py" in names and "kvtier/page_allocator.py" in names
    commands = eps.decode().split("[kvtier.commands]")[1].split("[")[0].split()
    assert commands == ["backends", "=", "kvtier.cli:BACKENDS"], commands
    assert "Provides-Extra: demo" not in meta and "transformers" not in meta


def test_no_library_module_imports_a_tool():
    """kvtier-tools builds on the library, never the other way round. The one exception is a
    vendor package's own benchmark command (``kvtier bench limits``), which imports it lazily
    and says to install it where it is missing."""
    allowed = {ROOT / "packages/nvidia-tma/src/kvtier_nvidia_tma/limits.py"}
    found = []
    for pkg in PACKAGES:
        if pkg.name == "tools":
            continue
        for f in (pkg / "src").rglob("*.py"):
            if f not in allowed and "kvtier_tools" in f.read_text():
                found.append(str(f.relative_to(ROOT)))
    assert found == []
