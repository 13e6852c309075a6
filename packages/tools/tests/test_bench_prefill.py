"""`kvtier bench prefill`: the demo model's prefill after a cached prefix vs all tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvtier.cli import main  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402


def test_bench_prefill_json(tmp_path, capsys) -> None:
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model-size", "tiny", "--page-size", "16",
                 "--cases", "0:32,32:16", "--attention", "blocks,lower_right",
                 "--repeat", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    first, second = data["cases"]
    assert (first["prefix"], first["computed"]) == (0, 32) and "blocks_s" not in first
    assert second["blocks_s"] > 0 and second["lower_right_s"] > 0 and second["full_s"] > 0
    assert "after prefix ms (lower_right)" in printed and "3.00x" in printed


@pytest.mark.parametrize("cases", ["16", "0:0", "8:16", "16:x"])
def test_bench_prefill_refuses_bad_cases(cases, capsys) -> None:
    assert main(["bench", "prefill", "--model-size", "tiny", "--page-size", "16",
                 "--cases", cases, "--repeat", "1"]) != 0
    assert "ConfigError: --cases" in capsys.readouterr().err
    from kvtier_tools.bench.prefill import _cases
    with pytest.raises(ConfigError, match="--cases"):
        _cases(cases, 16)
