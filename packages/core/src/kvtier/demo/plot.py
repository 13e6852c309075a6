"""The demo's PNG: hit rate and mean TTFT per round for every setup (matplotlib, Agg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run import DemoReport

_STYLE = {"L1 only": ("tab:red", "o"), "L1+L2": ("tab:orange", "s"),
          "L1+L2+L3": ("tab:green", "^")}


def plot_rounds(report: "DemoReport", path: str) -> str:
    """Write a two-panel figure (hit rate %, mean TTFT ms; x = round) to ``path``."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rounds = list(range(report.workload.num_rounds))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
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
    ax_hit.legend(loc="lower right", fontsize=8)
    m = report.model
    fig.suptitle(f"kvtier demo: {report.workload.name}, Llama-{m['size']} on {m['device']} "
                 f"{m['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
