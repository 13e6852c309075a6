"""docs/integrate.md's runnable example (examples/integrate.py) runs and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "integrate.py"


def test_integration_example_runs() -> None:
    if not EXAMPLE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{EXAMPLE} is missing")
        pytest.skip("not in a checkout of the repository")
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok: every restored page equals its recompute" in out.stdout, out.stdout
    assert "from L2: {'l1': 0, 'loaded': 5" in out.stdout, out.stdout
    assert "after restart (from L3): {'l1': 0, 'loaded': 5" in out.stdout, out.stdout
    assert 'kvtier_hit_pages_total{engine="toy",tier="l2"} 5' in out.stdout, out.stdout


def test_kvtier_exports_the_controller() -> None:
    import kvtier
    from kvtier.cache import CacheConfig, CacheExecutor, CachePlanner, TieredKVCache
    assert kvtier.TieredKVCache is TieredKVCache and kvtier.CacheConfig is CacheConfig
    assert kvtier.CachePlanner is CachePlanner and kvtier.CacheExecutor is CacheExecutor
    assert {"TieredKVCache", "CacheConfig"} <= set(kvtier.__all__)
