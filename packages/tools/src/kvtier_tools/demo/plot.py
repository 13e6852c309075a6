"""The demo's PNG: hit rate and mean TTFT per round for every setup (matplotlib, Agg); the
measured ideal (every page kept in L1) dashed, each setup's mean speedup and % of it in the
legend."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run import DemoReport

#: setup -> (colour, marker, line style); the names are `kvtier_tools.demo.run.SETUPS`
_STYLE = {"L1 only": ("tab:red", "o", "-"), "L1+L2": ("tab:orange", "s", "-"),
          "L1+L2+L3": ("tab:green", "^", "-"), "L1+L2+L3 load all": ("tab:blue", "v", ":"),
          "ideal (all in L1)": ("black", "", "--")}


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
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(9, 4.2), dpi=100)
    labels = _labels(report)
    for run in report.runs:
        color, marker, line = _STYLE.get(run.name, (None, "x", "-"))
        pr = run.per_round(len(rounds))
        label = labels.get(run.name, run.name)
        for ax, y in ((ax_hit, pr["hit_rate_pct"]), (ax_ttft, pr["ttft_mean_ms"])):
            ax.plot(rounds, y, marker=marker or None, color=color, linestyle=line,
                    label=label)
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
    ncol = len(labels) if len(labels) <= 3 else (len(labels) + 1) // 2
    fig.legend(handles, labels, loc="lower center", ncol=max(1, ncol), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.08 if ncol == len(labels) else 0.13, 1, 1))
    return fig


def _labels(report: "DemoReport") -> dict[str, str]:
    """setup -> legend label: the name, its mean speedup over L1 only and % of the measured
    ideal where the report has them."""
    summaries = getattr(report, "summaries", None)
    if summaries is None:
        return {}
    out = {}
    for s in summaries():
        parts = []
        if s.get("ttft_speedup") is not None:
            parts.append(f"{s['ttft_speedup']:.2f}x")
        if s.get("of_ideal_pct") is not None and s["setup"] != "ideal (all in L1)":
            parts.append(f"{s['of_ideal_pct']:.0f}% of ideal")
        out[s["setup"]] = s["setup"] + (f" ({', '.join(parts)})" if parts else "")
    return out


def plot_load(report: "DemoReport", path: str) -> str:
    """Mean TTFT against load per setup (x: the fraction of the L1-only capacity, 0 the
    serial replay; closed loops alone: the number of users). An overloaded level is not
    drawn as a point: it is marked with an x at the top of the axis."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from .run import IDEAL
    rows = report.load.table(IDEAL)
    open_loop = any(r["kind"] == "open" and r["load"] is not None for r in rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    top = max((r["ttft_mean_ms"] for r in rows if not r["overloaded"]), default=1.0) * 1.15
    for name in dict.fromkeys(r["setup"] for r in rows):
        color, marker, line = _STYLE.get(name, (None, "x", "-"))
        pts = [r for r in rows if r["setup"] == name and (
            r["kind"] == "serial" or (r["kind"] == "open" and r["load"] is not None)
            if open_loop else r["kind"] == "closed")]
        x = [r["load"] if open_loop else r["users"] for r in pts]
        ok = [(xi, r["ttft_mean_ms"]) for xi, r in zip(x, pts) if not r["overloaded"]]
        ax.plot([a for a, _ in ok], [b for _, b in ok], marker=marker or "o", color=color,
                linestyle=line, label=name)
        over = [xi for xi, r in zip(x, pts) if r["overloaded"]]
        if over:
            ax.plot(over, [top] * len(over), "x", color=color, markersize=10)
    ax.set(xlabel="offered load (fraction of L1-only capacity)" if open_loop else "users",
           ylabel="mean TTFT (ms)", title="mean TTFT under load (x at the top: overloaded)")
    ax.set_ylim(0, top * 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
