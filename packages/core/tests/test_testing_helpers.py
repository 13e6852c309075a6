"""Small core pieces the vendor packages lean on: error codes, test-data helpers, contract hooks."""

import pytest
import torch

from kvtier.errors import AllocationError, TransferError
from kvtier.host_allocators.torch_pinned import TorchPinnedAllocator
from kvtier.spec import KVSpec
from kvtier.testing import TransferEngineContract, fill_random, make_host_pool


def test_runtime_codes_ride_on_errors():
    err = AllocationError("malloc returned 0", backend="x", nbytes=8, code=0)
    assert (err.code, err.backend, err.nbytes) == (0, "x", 8)
    assert AllocationError("plain").code is None
    assert TransferError("launch", code=-1).code == -1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16,
                                   torch.float32, torch.int8])
def test_fill_random_every_dtype(dtype):
    t = torch.zeros(4096, dtype=dtype)
    fill_random(t)
    assert int(t.view(torch.uint8).max()) > 0
    if dtype.itemsize > 1 and dtype.is_floating_point:
        assert not torch.isnan(t).any()


def test_make_host_pool_takes_an_allocator_instance():
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2, dtype="float16")
    with make_host_pool(spec, 3, "layer_first", TorchPinnedAllocator()) as pool:
        assert pool.layout == "layer_first" and int(pool.raw.max()) > 0


def test_engine_contract_host_allocator_default():
    assert TransferEngineContract().host_allocator("torch") == "torch-pinned"


_BLOCK_PYTEST = """
import sys
class _NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pytest', '_pytest'):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None
sys.meta_path.insert(0, _NoPytest())
"""


def test_data_helpers_import_without_pytest():
    """kvtier.testing.data (used by benchmarks) works on an install without the test extra."""
    import subprocess
    import sys
    code = _BLOCK_PYTEST + (
        "import kvtier.testing.data as d\n"
        "from kvtier.testing import fill_random, random_specs\n"
        "import torch\n"
        "t = fill_random(torch.empty(64, dtype=torch.uint8)); assert int(t.min()) > 0\n"
        "assert random_specs()\n"
        "try:\n    import kvtier.testing.contracts\nexcept ModuleNotFoundError as e:\n"
        "    print('contracts need', e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "contracts need pytest"     # the blocker really blocks


def test_pytest_plugin_imports_nothing_heavy():
    """The pytest11 plugin loads into every pytest run of an environment with kvtier-core:
    it imports no torch and no kvtier module beyond its own package."""
    import subprocess
    import sys
    code = ("import sys; import kvtier.testing.plugin as p; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvtier', 'torch', "
            "'numpy', 'pytest'))); print(sorted(p.MARKERS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == str(sorted(["kvtier", "kvtier._lazy", "kvtier._version", "kvtier.testing",
                                 "kvtier.testing.plugin"]))
    assert out[1] == "['hardware']"


def test_unregistered_markers_are_errors(tmp_path):
    """--strict-markers (the workspace's pytest settings): a typo in a marker fails."""
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "test_typo.py").write_text("import pytest\n\n@pytest.mark.hardwre\n"
                                           "def test_x():\n    pass\n\n"
                                           "@pytest.mark.hardware\ndef test_y():\n    pass\n")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(root), "-c", str(root / "pyproject.toml"),
                          str(tmp_path / "test_typo.py")], capture_output=True, text=True)
    assert out.returncode != 0 and "'hardwre' not found in `markers`" in out.stdout
