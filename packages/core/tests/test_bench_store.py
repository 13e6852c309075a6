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
                 "--raw-pieces", "1M", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch=3, callers=3, calls of 512 KiB, io_depth=1" in printed
    assert "every page read back bitwise identical" in printed
    data = json.loads(out.read_text())
    assert data["callers"] == 3 and data["batch"] == 3 and data["failures"] == 0
    assert data["io_depth"] == 1 and data["io_call_bytes"] == 512 << 10
    assert data["raw_modes"] == ["1", "2", "2 files", "6", "6 files", "1 @1 MiB",
                                 "1 slots @512 KiB"]
    assert [r["page_bytes"] for r in data["results"]] == [256 << 10]
    for r in data["results"]:
        assert set(r["raw_read"]) == set(data["raw_modes"]) == set(r["raw_write"])
        assert r["set"] > 0 and r["get"] > 0
        assert r["set_ratio"] == r["set"] / max(r["raw_write"].values())
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_raw_slot_mode_lays_pages_out_as_the_segments_format(tmp_path):
    """The raw "slots" mode passes the store's iovecs (each page, then its 4 KiB tail) in calls
    of whole slots, and counts payload bytes: its file holds pages x (page + 4 KiB)."""
    import mmap
    import os

    from kvtier.bench import store as bench
    page = 64 << 10
    view = memoryview(mmap.mmap(-1, 1 << 20))
    iov = bench._iov(view, 3 * (page + 4096), page)
    assert [len(v) for v in iov] == [page, 4096] * 3
    size, plan = bench._slot_plan(20 * page, 1, False, 5 * (page + 4096) + 100, page)
    assert size == 20 * (page + 4096)
    assert [n for _, _, n in plan[0]] == [5 * (page + 4096)] * 4
    bufs = [mmap.mmap(-1, 1 << 20)]
    path = str(tmp_path / "raw.bin")
    assert bench.raw_write(path, 20 * page, bufs, False, piece=5 * (page + 4096),
                           slot_page=page) > 0
    assert os.path.getsize(path) == 20 * (page + 4096)
    assert bench.raw_read(path, 20 * page, bufs, False, piece=5 * (page + 4096),
                          slot_page=page) > 0
    assert main(["bench", "store", "--dir", str(tmp_path / "d"), "--raw-pieces", "1000"]) != 0
    assert not (tmp_path / "d").exists()          # refused before anything is made
