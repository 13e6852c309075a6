"""docs/backends.md walks through examples/backend-template; this proves the walk: the template
package, registered by its entry point, passes kvtier's L3 contract suite and the package
contract. Its distribution metadata is written to a temporary directory (what pip would
install), its sources are put on the path, and its own tests run in a fresh pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "examples" / "backend-template"


def _install_metadata(site: Path) -> None:
    """A .dist-info with the template's name, version and entry points (from its
    pyproject.toml), as an install would leave it."""
    import tomllib
    meta = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())
    proj = meta["project"]
    info = site / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\n"
                                   f"Version: {proj['version']}\n")
    lines = []
    for group, eps in proj["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_template_package_passes_the_contract_suites(tmp_path):
    if not TEMPLATE.is_dir():
        pytest.skip(f"{TEMPLATE} is not part of this checkout")
    _install_metadata(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "site"), str(TEMPLATE / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
                          str(TEMPLATE / "tests")], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 20, out.stdout[-2000:]
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]
    # and kvtier lists it as available
    code = "from kvtier.cli import main; main(['backends', '--kind', 'l3_store', '--json'])"
    listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True).stdout
    assert '"name": "example-sqlite"' in listed and '"distribution": "kvtier-example-sqlite"' \
        in listed
