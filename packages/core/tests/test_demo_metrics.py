"""A running demo's metrics can be scraped on 127.0.0.1 (the exporter lives as long as the
setups' caches)."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("transformers")

from kvtier.demo.run import DemoConfig, run_demo  # noqa: E402

SMALL = dict(model_size="tiny", page_size=16, clients=2, rounds=2, first_tokens=96,
             turn_tokens=32, answer_tokens=16, l1_pages=12, l2_pages=12, threads=1,
             progress=False, plot=False, check="none")


def test_metrics_of_every_setup_are_served_while_the_demo_runs(tmp_path) -> None:
    scraped: list[str] = []

    def scrape(url: str) -> None:
        assert url.startswith("http://127.0.0.1:")
        scraped.append(urllib.request.urlopen(url, timeout=10).read().decode())

    cfg = DemoConfig.from_dict(SMALL | {"metrics_port": 0, "out": str(tmp_path)})
    report = run_demo(cfg, log=lambda *a: None, on_metrics=scrape)
    assert len(scraped) == 1
    body = scraped[0]
    for setup in ("L1 only", "L1+L2", "L1+L2+L3"):
        assert f'kvtier_capacity_pages{{setup="{setup}",tier="l2"}}' in body
    assert report.runs and all(r.results for r in report.runs)
