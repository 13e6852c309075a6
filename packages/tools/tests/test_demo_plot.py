"""The demo's plot: the legend sits outside both panels (it never hides a point), the title
names model, dtype and device apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib")

from kvtier_tools.demo.plot import figure  # noqa: E402


class _Run:
    def __init__(self, name: str, base: float):
        self.name = name
        self.base = base

    def per_round(self, n: int) -> dict:
        return {"hit_rate_pct": [min(100.0, self.base * i) for i in range(n)],
                "ttft_mean_ms": [100.0 - self.base * i for i in range(n)]}


SETUPS = ["L1 only", "L1+L2", "L1+L2+L3", "L1+L2+L3 load all", "ideal (all in L1)"]


def test_legend_outside_the_data_and_a_readable_title() -> None:
    import matplotlib.pyplot as plt
    report = SimpleNamespace(
        workload=SimpleNamespace(num_rounds=6, name="multi-turn"),
        runs=[_Run(name, 1 + 5 * i) for i, name in enumerate(SETUPS)],
        model={"size": "small", "device": "cuda", "dtype": "float32"})
    fig = figure(report)
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        legends = fig.legends
        assert len(legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
        box = legends[0].get_window_extent(r)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(r))
        assert [t.get_text() for t in legends[0].get_texts()] == SETUPS
        title = fig._suptitle.get_text()
        assert "float32, on cuda" in title and "cudafloat32" not in title
    finally:
        plt.close(fig)


def test_the_measured_ideal_is_drawn_dashed_and_the_legend_gives_the_share_of_it() -> None:
    import matplotlib.pyplot as plt
    from kvtier_tools.demo.run import IDEAL, SETUPS as RUN_SETUPS
    assert list(RUN_SETUPS) == SETUPS and IDEAL == SETUPS[-1]
    rows = [{"setup": n, "ttft_speedup": sp, "of_ideal_pct": 100 * sp / 4.0}
            for n, sp in zip(SETUPS, (1.0, 1.5, 3.0, 2.5, 4.0))]
    report = SimpleNamespace(
        workload=SimpleNamespace(num_rounds=4, name="multi-turn"),
        runs=[_Run(name, 1 + 5 * i) for i, name in enumerate(SETUPS)],
        model={"size": "small", "device": "cpu", "dtype": "float32"},
        summaries=lambda: rows)
    fig = figure(report)
    try:
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "L1+L2+L3 (3.00x, 75% of ideal)" in texts
        assert "ideal (all in L1) (4.00x)" in texts
        ideal = [ln for ln in fig.axes[1].get_lines() if ln.get_label().startswith(IDEAL)]
        assert len(ideal) == 1 and ideal[0].get_linestyle() == "--"
    finally:
        plt.close(fig)


def test_transformers_outside_the_tested_range_is_refused_up_front() -> None:
    from kvtier_tools.demo.model import check_transformers
    from kvtier.errors import ConfigError
    check_transformers("5.24.0")
    check_transformers("5.24.3.dev0")
    for bad in ("5.17.0", "5.23.9", "5.25.0", "6.0.0", "4.57.1", "garbage"):
        with pytest.raises(ConfigError, match="tested with transformers >=5.24,<5.25"):
            check_transformers(bad)
