"""`kvtier bench store --json`: the store called as the controller calls it (batches from
several threads at once) beside raw ceilings with as many I/O calls in flight."""

from __future__ import annotations

import json

from kvtier.cli import main


def test_bench_store_calls_from_several_threads_and_measures_matching_ceilings(tmp_path,
                                                                              capsys):
    out = tmp_path / "store.json"
    assert main(["bench", "store", "--dir", str(tmp_path / "d"), "--total", "1M",
                 "--page-sizes", "256K", "--batch", "3", "--callers", "3", "--threads",
                 "2", "--io-depth", "1", "--io-call", "512K", "--repeat", "1", "--cache", "fadvise",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch=3, callers=3, io_depth=1 (512 KiB calls)" in printed
    assert "every page read back bitwise identical" in printed
    data = json.loads(out.read_text())
    assert data["callers"] == 3 and data["batch"] == 3 and data["failures"] == 0
    assert data["io_depth"] == 1 and data["io_call_bytes"] == 512 << 10
    assert data["raw_modes"] == ["1", "2", "2 files", "6", "6 files"]
    assert [r["page_bytes"] for r in data["results"]] == [256 << 10]
    for r in data["results"]:
        assert set(r["raw_read"]) == set(data["raw_modes"]) == set(r["raw_write"])
        assert r["set"] > 0 and r["get"] > 0
        assert r["set_ratio"] == r["set"] / max(r["raw_write"].values())
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
