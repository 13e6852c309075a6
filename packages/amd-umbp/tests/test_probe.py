"""The package's backends are discovered and report honestly why they can or cannot run."""

import subprocess
import sys

from kvtier import registry


def test_backends_discovered_with_reason():
    recs = [r for r in registry.records() if r.distribution == "kvtier-amd-umbp"]
    assert recs, "the package's entry points are not registered"
    for rec in recs:
        assert rec.error is None, rec.error
        av = registry.probe(rec)
        assert av.ok or av.reason, f"{rec.name}: unavailable without a reason"


def test_import_loads_no_vendor_runtime():
    """Importing the package and discovering its backends adds no vendor module to what torch
    itself loads (torch imports cuda.bindings when that package is installed)."""
    code = ("import sys; roots = ('torch_npu', 'mori', 'cuda', 'memfabric_hybrid')\n"
            "vendor = lambda: {m for m in sys.modules if m.split('.')[0] in roots}\n"
            "import torch; before = vendor()\n"
            "import kvtier, kvtier_amd_umbp; from kvtier import registry; registry.discover()\n"
            "print(sorted(vendor() - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
