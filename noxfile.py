"""Test matrix: one session per package under packages/, plus lint and a demo smoke run.

torch is pinned to the CPU build (``TORCH`` below) and installed first in every session, so
nothing can pull a multi-GB CUDA build onto a CPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
TORCH = os.environ.get("KVTIER_TORCH", "torch==2.13.0")
PYTHON = os.environ.get("KVTIER_NOX_PYTHON", "3.11")

nox.options.sessions = [f"tests-{p}" for p in PACKAGES] + ["lint"]
#: Extras of kvtier-core a package's tests need (core: the Mooncake client, so the `mooncake`
#: L3 store runs against a real master; .ci/run installs its system libraries).
CORE_EXTRAS = {"core": ("mooncake",)}
nox.options.reuse_existing_virtualenvs = True


def install_base(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    core = "packages/core[test" + "".join("," + e for e in extras) + "]"
    session.install(core)


for _pkg in PACKAGES:
    def _tests(session: nox.Session, pkg: str = _pkg) -> None:
        """Run one package's tests (contract suites included) on CPU."""
        install_base(session, *CORE_EXTRAS.get(pkg, ()))
        if pkg != "core":
            session.install(f"packages/{pkg}")
        extra = ROOT / "packages" / pkg / "tests" / "requirements.txt"
        if extra.exists():
            session.install("-r", str(extra))
        session.run("pytest", f"packages/{pkg}/tests", "-q", *session.posargs)

    nox.session(name=f"tests-{_pkg}", python=PYTHON)(_tests)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over every package."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "noxfile.py")
