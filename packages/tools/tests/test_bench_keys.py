"""`kvtier bench keys --json`: native and Python chains side by side with the bare floor."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.keys import NATIVE_KEYS_ENV, native_chain


@pytest.mark.parametrize("native_env", ["", "0"])
def test_bench_keys_reports_both_implementations(tmp_path, capsys, monkeypatch, native_env):
    monkeypatch.setenv(NATIVE_KEYS_ENV, native_env)
    out = tmp_path / "keys.json"
    assert main(["bench", "keys", "--tokens", "1024", "--page-sizes", "3,64", "--hashes",
                 "sha256,blake2b", "--repeat", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "native ms" in printed and "python ms" in printed and "bare ms" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(r["hash"], r["page_size"], r["pages"]) for r in rows] == [
        ("sha256", 3, 341), ("sha256", 64, 16), ("blake2b", 3, 341), ("blake2b", 64, 16)]
    for r in rows:
        native = native_chain(r["hash"]) is not None
        assert r["implementation"] == ("native" if native else "python")
        assert (r["native_ms"] is not None) == native
        assert r["python_ms"] > 0 and r["bare_ms"] > 0
        assert r["keys_ms"] == (r["native_ms"] if native else r["python_ms"])
