"""`kvtier bench control --json`: the printed table, as data."""

from __future__ import annotations

import json

from kvtier.cli import main


def test_bench_control_json(tmp_path, capsys) -> None:
    out = tmp_path / "control.json"
    assert main(["bench", "control", "--tokens", "2048", "--small-requests", "4",
                 "--small-tokens", "256", "--repeat", "1", "--ref-layers", "2",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["page_size"] == 64 and data["page_copy_s"] > 0
    assert data["rows"][0]["scenario"] == "page keys only (hashing floor)"
    assert all(r["scenario"] in printed for r in data["rows"])
