"""A running demo's metrics can be scraped on 127.0.0.1 (the exporter lives as long as the
setups' caches); a bad or busy metrics port fails the command at once, before the model is
built."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

import kvtier_tools.demo.run as demo_run
from kvtier.cli import main
from kvtier_tools.demo.run import SETUPS, DemoConfig, run_demo
from kvtier.errors import ConfigError

SMALL = dict(model_size="tiny", page_size=16, clients=2, rounds=2, first_tokens=96,
             turn_tokens=32, answer_tokens=16, l1_pages=12, l2_pages=12, threads=1,
             progress=False, plot=False, check="none")


def test_metrics_of_every_setup_are_served_while_the_demo_runs(tmp_path) -> None:
    pytest.importorskip("transformers")
    scraped: list[str] = []

    def scrape(url: str) -> None:
        assert url.startswith("http://127.0.0.1:")
        scraped.append(urllib.request.urlopen(url, timeout=10).read().decode())

    cfg = DemoConfig.from_dict(SMALL | {"metrics_port": 0, "out": str(tmp_path)})
    report = run_demo(cfg, log=lambda *a: None, on_metrics=scrape)
    assert len(scraped) == 1
    body = scraped[0]
    for setup in SETUPS:
        assert f'kvtier_capacity_pages{{setup="{setup}",tier="l2"}}' in body
    assert report.runs and all(r.results for r in report.runs)


DEMO_ARGV = ["demo", "--model-size", "tiny", "--page-size", "16", "--clients", "2", "--rounds",
             "2", "--threads", "1", "--no-plot", "--no-progress", "--check", "none"]


@pytest.fixture
def built(monkeypatch) -> list[tuple]:
    """Every call of the demo's model builder (a stand-in that fails the run if reached)."""
    calls: list[tuple] = []

    def build(*args, **kwargs):
        calls.append((args, kwargs))
        raise RuntimeError("the demo model was built")

    monkeypatch.setattr(demo_run, "DemoModel", build)
    return calls


@pytest.mark.parametrize("port", ["65536", "70000", "-1"])
def test_an_out_of_range_metrics_port_is_a_usage_error(port, built, capsys, tmp_path) -> None:
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(DEMO_ARGV + ["--out", str(tmp_path), "--metrics-port", port])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--metrics-port" in err and port in err and "\n" not in err
    assert built == [] and time.monotonic() - t0 < 5
    with pytest.raises(ConfigError, match="metrics_port"):
        DemoConfig.from_dict({"metrics_port": int(port)})


def test_a_metrics_port_in_use_fails_before_the_model_is_built(built, capsys, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        rc = main(DEMO_ARGV + ["--out", str(tmp_path), "--metrics-port", str(port)])
        elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "cannot listen" in err and f"127.0.0.1:{port}" in err
    assert built == [] and elapsed < 5
