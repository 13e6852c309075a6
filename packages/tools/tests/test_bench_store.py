"""`kvtier bench store --json`: the store called as the controller calls it (batches from
several threads at once) beside raw ceilings with as many I/O calls in flight."""

from __future__ import annotations

import json
import os
import statistics


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
    assert "against the median of the same raw modes (set / get): 256 KiB " in printed
    data = json.loads(out.read_text())
    assert data["callers"] == 3 and data["batch"] == 3 and data["failures"] == 0
    assert data["io_depth"] == 1 and data["io_call_bytes"] == 512 << 10
    assert data["raw_modes"] == ["1", "2", "2 files", "6", "6 files", "1 @1 MiB",
                                 "1 slots @512 KiB", "1 hot"]
    assert data["ceiling_modes"] == data["raw_modes"][:-1]      # the reused buffer is not one
    assert [r["page_bytes"] for r in data["results"]] == [256 << 10]
    for r in data["results"]:
        assert set(r["raw_read"]) == set(data["raw_modes"]) == set(r["raw_write"])
        assert r["set"] > 0 and r["get"] > 0
        assert r["set_ratio"] == r["set"] / max(r["raw_write"][m] for m in data["ceiling_modes"])
        assert r["get_ratio"] == r["get"] / max(r["raw_read"][m] for m in data["ceiling_modes"])
        assert r["get_ratio_median_mode"] == r["get"] / statistics.median(
            r["raw_read"][m] for m in data["ceiling_modes"])
        assert r["set_ratio_median_mode"] >= r["set_ratio"]
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    # --replot prints the same table and both ratios, for records made before the ceiling
    # named its modes too; a JSON file of another shape gets a typed error
    capsys.readouterr()
    assert main(["bench", "store", "--replot", str(out)]) == 0
    again = capsys.readouterr().out
    row = next(ln for ln in printed.splitlines() if ln.startswith("| 256 KiB"))
    assert row in again and "against the median of the same raw modes" in again
    old = {k: v for k, v in data.items() if k not in ("raw_modes", "ceiling_modes",
                                                       "io_call_bytes")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["bench", "store", "--replot", str(tmp_path / "old.json")]) == 0
    assert "| 256 KiB" in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({"runs": [data]}))
    assert main(["bench", "store", "--replot", str(tmp_path / "other.json")]) != 0
    assert "is not a `kvtier bench store --json` record" in capsys.readouterr().err


def test_raw_slot_mode_lays_pages_out_as_the_segments_format(tmp_path):
    """The raw "slots" mode passes the store's iovecs (each page, then its 4 KiB tail) in calls
    of whole slots, and counts payload bytes: its file holds pages x (page + 4 KiB)."""
    import mmap
    import os

    from kvtier_tools.bench import store as bench
    page = 64 << 10
    view = memoryview(mmap.mmap(-1, 1 << 20))
    iov = bench._iov(view, 3 * (page + 4096), page)
    assert [len(v) for v in iov] == [page, 4096] * 3
    size, plan = bench._slot_plan(20 * page, 1, False, 5 * (page + 4096) + 100, page)
    assert size == 20 * (page + 4096)
    assert [n for _, _, n, _ in plan[0]] == [5 * (page + 4096)] * 4
    src, dst = mmap.mmap(-1, 20 * page), mmap.mmap(-1, 20 * page)
    src.write(os.urandom(20 * page))
    path = str(tmp_path / "raw.bin")
    assert bench.raw_write(path, 20 * page, src, False, piece=5 * (page + 4096),
                           slot_page=page) > 0
    assert os.path.getsize(path) == 20 * (page + 4096)
    with open(path, "rb") as f:            # page j at slot j, then its tail
        blob = f.read()
    assert all(blob[j * (page + 4096):j * (page + 4096) + page] == src[j * page:(j + 1) * page]
               for j in range(20))
    assert bench.raw_read(path, 20 * page, dst, False, piece=5 * (page + 4096),
                          slot_page=page) > 0
    assert dst[:] == src[:]                 # every call read into its own pages
    assert main(["bench", "store", "--dir", str(tmp_path / "d"), "--raw-pieces", "1000"]) != 0
    assert not (tmp_path / "d").exists()          # refused before anything is made


def test_raw_modes_move_the_data_through_memory_as_large_as_the_data(tmp_path):
    """Each raw call writes from and reads into its own part of the data buffer (as the store
    moves its own host pages), whatever the streams and files; only ``hot`` reuses one region
    per stream, so its read leaves the rest of the buffer untouched."""
    import mmap
    import os

    from kvtier_tools.bench import store as bench
    total, piece = 24 << 20, 1 << 20
    src = mmap.mmap(-1, total)
    src.write(os.urandom(total))
    for streams, files in ((1, False), (3, False), (3, True)):
        path = str(tmp_path / f"raw-{streams}-{files}")
        bench.raw_write(path, total, src, False, streams, files, piece)
        dst = mmap.mmap(-1, total)
        bench.raw_read(path, total, dst, False, streams, files, piece)
        assert dst[:] == src[:], (streams, files)
        bench._remove_raw(path, streams, files)
    path = str(tmp_path / "raw-hot")
    bench.raw_write(path, total, src, False, 2, False, piece, hot=True)
    with open(path, "rb") as f:             # every call of stream s wrote piece s's bytes
        blob = f.read()
    assert [blob[i:i + piece] == src[(i // piece % 2) * piece:(i // piece % 2 + 1) * piece]
            for i in range(0, total, piece)] == [True] * (total // piece)
    dst = mmap.mmap(-1, total)
    bench.raw_read(path, total, dst, False, 2, False, piece, hot=True)
    assert dst[:2 * piece] == src[:2 * piece] and dst[2 * piece:] == bytes(total - 2 * piece)


def test_bench_store_measures_the_shm_store_against_memcpy(tmp_path, capsys):
    from kvtier.cli import main
    out = tmp_path / "shm.json"
    assert main(["bench", "store", "--store", "shm", "--dir", str(tmp_path), "--total", "2M",
                 "--page-sizes", "256K,1M", "--batch", "3", "--callers", "2", "--repeat", "2",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "every page read back bitwise identical" in printed and "batch=3, callers=2" in printed
    data = json.loads(out.read_text())
    assert data["store"] == "shm" and data["failures"] == 0
    assert [r["page_bytes"] for r in data["results"]] == [256 << 10, 1 << 20]
    for r in data["results"]:
        assert r["set"] > 0 and r["get"] > 0 and len(r["samples"]["get"]) == 2
        assert r["get_ratio"] == r["get"] / max(r["memcpy_r_calls"], r["memcpy_r_one"])
        assert r["set_ratio"] == r["set"] / max(r["memcpy_w_calls"], r["memcpy_w_one"])
    assert sorted(os.listdir(tmp_path)) == ["shm.json"], "the arena and raw file are gone"


def test_bench_store_threads_default_to_the_stores_own_for_the_directory(tmp_path,
                                                                         monkeypatch):
    """Without ``--threads`` the store runs its own default for the directory's medium (one
    I/O thread per CPU in memory, 4 to 16; 4 on a disk), and the raw modes match it."""
    from kvtier.l3_stores.file import _files
    out = tmp_path / "store.json"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    for medium, want in (("memory", 6), ("disk", 4)):
        monkeypatch.setattr(_files, "medium", lambda fd, m=medium: m)
        monkeypatch.setattr("kvtier_tools.bench.store.medium", lambda fd, m=medium: m)
        assert main(["bench", "store", "--dir", str(tmp_path / medium), "--total", "1M",
                     "--page-sizes", "256K", "--batch", "4", "--callers", "1", "--repeat",
                     "1", "--cache", "fadvise", "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["threads"] == want and data["failures"] == 0
        assert f"{want} files" in data["raw_modes"]
