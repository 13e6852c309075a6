"""kvtier's adapter counters reach SGLang's /metrics: SGLang serves it in prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by sglang.srt.utils before its processes
start), so the adapter, living in the scheduler process, writes its counters there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from conftest import (CASES, attach, extra_config, make_pools, page_indices, random_tokens,
                      storage_config)
from sglang.srt.mem_cache.utils import get_storage_hash_str
case = CASES[0]
dev, host = make_pools(case)
cfg = storage_config(extra_config("file", {"root": sys.argv[2]}), tp_rank=0)
backend = attach(host, cfg)
keys = get_storage_hash_str(random_tokens(3 * host.page_size, 1), None,
                            page_size=host.page_size)
idx = host.alloc(3 * host.page_size)
assert all(backend.batch_set_v1(keys, idx))
assert backend.batch_get_v1(keys, idx) == [True] * 3
assert backend.batch_exists(keys) == 3
def boom(*a, **k):
    raise OSError(5, "Input/output error")
backend.store.batch_get = boom
assert backend.batch_get_v1(keys, idx) == [False] * 3
backend.close()
"""


def test_adapter_counters_reach_sglangs_multiprocess_metrics(tmp_path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(tmp_path / "l3")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp))      # what SGLang's /metrics handler does
    got = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            got[s.name] = got.get(s.name, 0) + s.value
            if s.name.startswith("kvtier_"):
                assert s.labels["store"] == "file" and s.labels["tp_rank"] == "0"
    assert got["kvtier_set_pages_total"] == 3 and got["kvtier_set_ok_total"] == 3
    assert got["kvtier_get_hits_total"] == 3
    assert got["kvtier_exists_hits_total"] == 3
    assert got["kvtier_batch_get_v1_errors_total"] == 1
