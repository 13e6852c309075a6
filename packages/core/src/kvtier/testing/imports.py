"""Check that importing kvtier (or a vendor package) pulls in no vendor runtime."""

from __future__ import annotations

import subprocess
import sys

#: Top-level modules of vendor runtimes and integrations kvtier must only import on demand.
VENDOR_ROOTS = ("torch_npu", "mori", "cuda", "memfabric_hybrid", "sglang", "mooncake")


def vendor_modules_added(statements: str, roots: tuple[str, ...] = VENDOR_ROOTS) -> list[str]:
    """Run ``statements`` in a fresh interpreter after ``import torch, numpy`` and return the
    vendor modules they added. Compared with what torch itself loads, since torch imports
    ``cuda.bindings`` when that package is installed."""
    code = (f"import sys; roots = {tuple(roots)!r}\n"
            "vendor = lambda: {m for m in sys.modules if m.split('.')[0] in roots}\n"
            "import torch, numpy; before = vendor()\n"
            f"{statements}\n"
            "print('\\n'.join(sorted(vendor() - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()
