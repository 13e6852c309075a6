"""Dependencies of the meta distribution `kvtier`: its own packages from this checkout, or
version ranges for a release.

From a clone, ``pip install ".[nvidia-tma]"`` must install the packages beside it, so they are
file references to ``packages/*``. A release (``KVTIER_RELEASE=1``, as ``nox -s build`` sets)
or a build from an sdist (no ``packages/`` beside it) gets ``name>=X.Y,<X.(Y+1)`` ranges that
resolve from an index.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hatchling.metadata.plugin.interface import MetadataHookInterface

#: extra -> the packages/* folders it installs ("" = the base dependencies).
EXTRAS = {
    "": ["core"],
    "amd-umbp": ["amd-umbp"],
    "ascend": ["ascend"],
    "nvidia-tma": ["nvidia-tma"],
    "native-keys": ["native-keys"],
    "tools": ["tools"],
    "all": ["amd-umbp", "ascend", "nvidia-tma", "native-keys"],
}
#: extra -> an extra of kvtier-core it passes on.
CORE_EXTRAS = ("test", "vllm", "prometheus", "mooncake")
#: extra -> an extra of kvtier-tools it passes on (``kvtier[demo]``: the demo's model too).
TOOLS_EXTRAS = ("demo",)
DISTS = {"core": ("kvtier-core", "src/kvtier/_version.py"),
         "amd-umbp": ("kvtier-amd-umbp", "src/kvtier_amd_umbp/_version.py"),
         "ascend": ("kvtier-ascend", "src/kvtier_ascend/_version.py"),
         "nvidia-tma": ("kvtier-nvidia-tma", "src/kvtier_nvidia_tma/_version.py"),
         "native-keys": ("kvtier-native-keys", "src/kvtier_native_keys/_version.py"),
         "tools": ("kvtier-tools", "src/kvtier_tools/_version.py")}
#: Released versions of the packages when building from an sdist (kept by the release build).
RELEASED = {"kvtier-core": "0.1.0", "kvtier-amd-umbp": "0.1.0", "kvtier-ascend": "0.1.0",
            "kvtier-nvidia-tma": "0.1.0", "kvtier-native-keys": "0.1.0", "kvtier-tools": "0.1.0"}


def _version(root: Path, folder: str) -> str:
    dist, rel = DISTS[folder]
    f = root / "packages" / folder / rel
    if not f.exists():
        return RELEASED[dist]
    m = re.search(r'__version__\s*=\s*"([^"]+)"', f.read_text())
    if not m:
        raise RuntimeError(f"no __version__ in {f}")
    return m.group(1)


def requirement(root: Path, folder: str, extras: str = "", *, release: bool) -> str:
    dist = DISTS[folder][0]
    tail = f"[{extras}]" if extras else ""
    if release:
        major, minor = (int(x) for x in _version(root, folder).split(".")[:2])
        return f"{dist}{tail}>={major}.{minor},<{major}.{minor + 1}"
    return f"{dist}{tail} @ {(root / 'packages' / folder).as_uri()}"


class KVTierMetadataHook(MetadataHookInterface):
    def update(self, metadata: dict) -> None:
        root = Path(self.root)
        release = bool(os.environ.get("KVTIER_RELEASE")) or not (root / "packages").is_dir()
        metadata["dependencies"] = [requirement(root, f, release=release) for f in EXTRAS[""]]
        optional = {name: [requirement(root, f, release=release) for f in folders]
                    for name, folders in EXTRAS.items() if name}
        for extra in CORE_EXTRAS:
            optional[extra] = [requirement(root, "core", extra, release=release)]
        for extra in TOOLS_EXTRAS:
            optional[extra] = [requirement(root, "tools", extra, release=release)]
        metadata["optional-dependencies"] = optional
