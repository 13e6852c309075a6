"""The demo's PNG: hit rate and mean TTFT per round for every setup (matplotlib, Agg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run import DemoReport

_STYLE = {"L1 only": ("tab:red", "o"), "L1+L2": ("tab:orange", "s"),
          "L1+L2+L3": ("tab:green", "^")}


def plot_rounds(report: "DemoReport", path: str) -> str:
    """Write a two-panel figure (hit rate %, mean TTFT ms; x = round) to ``path``."""
    import matplotlib.pyplot as plt
    fig = figure(report)
    fig.savefig(path)
    plt.close(fig)
    return path


def figure(report: "DemoReport"):
    """The demo's matplotlib figure (Agg backend)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rounds = list(range(report.workload.num_rounds))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=100)
    for run in report.runs:
        color, marker = _STYLE.get(run.name, (None, "x"))
        pr = run.per_round(len(rounds))
        ax_hit.plot(rounds, pr["hit_rate_pct"], marker=marker, color=color, label=run.name)
        ax_ttft.plot(rounds, pr["ttft_mean_ms"], marker=marker, color=color, label=run.name)
    ax_hit.set(xlabel="round", ylabel="token hit rate (%)", ylim=(-2, 102),
               title="prefix hit rate per round")
    ax_ttft.set(xlabel="round", ylabel="mean TTFT (ms)", title="time to first token per round")
    ax_ttft.set_ylim(bottom=0)
    for ax in (ax_hit, ax_ttft):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    m = report.model
    label = m.get("label") or f"Llama-{m['size']}"
    fig.suptitle(f"kvtier demo: {report.workload.name}; {label}, {m['dtype']}, "
                 f"on {m['device']}", fontsize=10)
    # one legend for both panels, below them: it never hides a data point
    handles, labels = ax_hit.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(labels)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
