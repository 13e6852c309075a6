"""The demo's outputs: the report as markdown tables (the comparison with its verdict lines,
the physics with the modelled split, the details), results.json and the PNG."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

from .run import IDEAL, LOAD_ALL, DemoReport, has_l3, loads_below_l1


def _ratio(x: float | None) -> str:
    return "" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _rate(bps: float | None, per_token: float) -> str:
    if not bps:
        return "-"
    return f"{bps / 1e9:.2f} GB/s ({bps / per_token / 1e3:,.0f}K tok/s)"


def physics(report: DemoReport) -> str:
    """What the run measured: recompute rate, each setup's load rates per tier/engine, and
    the modelled split at those rates (a diagnostic: a real run can beat the model)."""
    from kvtier.report import table
    rows = report.summaries()
    per_token = report.model["page_bytes"] / report.model["page_size"]
    cfg = report.config
    used = sorted({str(r.metrics.get("transfer_engine")) for r in report.runs
                   if r.metrics.get("transfer_engine")}) or [cfg.transfer_engine]
    return table(
        ["setup", "recompute tok/s", f"L2->L1 ({', '.join(used)})",
         f"L3 read ({cfg.l3_store})", "restored pages checked (digest)",
         "modelled split speedup", "achieved/modelled"],
        [[s["setup"], f"{s['recompute_tokens_per_s']:,.0f}"
          if s["recompute_tokens_per_s"] else "-",
          _rate(s["l2_load_bytes_per_s"], per_token) if loads_below_l1(s["setup"]) else "-",
          ("in place" + (f" ({s['l3_in_place_pages']} pages)")
           if s.get("l3_in_place_pages") else
           _rate(s["l3_read_bytes_per_s"], per_token)
           + (f", streamed ({s['l3_streamed_pages']} pages)"
              if s.get("l3_streamed_pages") else "")) if has_l3(s["setup"]) else "-",
          s["restored_pages_checked"], _ratio(s["modelled_speedup"]),
          "" if s["achieved_of_modelled"] is None
          else f"{100 * s['achieved_of_modelled']:.0f}%"] for s in rows])


def verdicts(report: DemoReport) -> str:
    """The measured ideal, and the cost-aware split against its alternatives (one line each;
    empty for a setup that did not run)."""
    lines = []
    ideal = report.ideal()
    if ideal is not None:
        over = "" if ideal["speedup"] is None else f", {_ratio(ideal['speedup'])} over L1 only"
        lines.append(
            f"Measured ideal, every page kept in L1 ({ideal['l1_pages']} L1 pages, "
            f"{ideal['l1_evictions']} evicted): mean TTFT {ideal['ttft_mean_ms']:.1f} ms{over}"
            f", hit rate {ideal['hit_rate_pct']:.1f}%; \"% of ideal\" = a setup's mean speedup "
            f"over L1 only as a share of the ideal's.")
    sp = report.split()
    if sp is not None:
        best = "loading every L3 hit" if sp["best_alternative"] == LOAD_ALL else \
            "loading none"
        verdict = f"MORE THAN {100 * sp['margin']:.0f}% WORSE" if sp["flagged"] else \
            f"within {100 * sp['margin']:.0f}%"
        lines.append(
            f"Cost-aware split (L1+L2+L3): mean TTFT {sp['ttft_mean_ms']:.1f} ms against "
            f"{sp['load_all_ttft_mean_ms']:.1f} ms loading every L3 hit ({LOAD_ALL}) and "
            f"{sp['load_none_ttft_mean_ms']:.1f} ms loading none (L1+L2): {sp['ratio']:.2f}x "
            f"the better ({best}), {verdict}.")
    return "\n".join(lines)


def tables(report: DemoReport) -> str:
    """The comparison table, its verdicts, the physics and the details table (markdown)."""
    from kvtier.report import table
    rows = report.summaries()
    pct = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
    main = table(
        ["setup", "hit rate %", "L1 %", "L2 %", "L3 %", "vs L1 only (pts)", "TTFT mean ms",
         "TTFT p90 ms", "mean speedup", "p90 speedup", "% of ideal",
         ">5% slower than L1 only: all / loading / same work %", "computed tok", "loaded tok",
         "skipped tok"],
        [[s["setup"], f"{s['hit_rate_pct']:.1f}", f"{s['l1_hit_pct']:.1f}",
          f"{s['l2_hit_pct']:.1f}", f"{s['l3_hit_pct']:.1f}",
          "" if s["hit_gain_pts"] is None else f"{s['hit_gain_pts']:+.1f}",
          f"{s['ttft_mean_ms']:.1f}", f"{s['ttft_p90_ms']:.1f}", _ratio(s["ttft_speedup"]),
          _ratio(s["p90_speedup"]),
          "" if s["of_ideal_pct"] is None else f"{s['of_ideal_pct']:.0f}%",
          f"{pct(s['slower_pct'])} / {pct(s['slower_loading_pct'])} / "
          f"{pct(s['slower_same_work_pct'])}" if s["setup"] != "L1 only" else "",
          s["computed_tokens"], s["loaded_tokens"], s["skipped_tokens"]] for s in rows])
    details = table(
        ["setup", "L1 pages", "L2 pages", "load ms (mean)", "prefill ms (mean)",
         "L2->L1 MiB", "L1->L2 MiB", "L3 read MiB", "L3 written MiB", "store errors",
         "skipped pages L2/L3", "L1 evictions", "checked ok", "busy s"],
        [[s["setup"], s["l1_pages"], s["l2_pages"] or "-", f"{s['load_mean_ms']:.2f}",
          f"{s['prefill_mean_ms']:.1f}", _mib(s["bytes_h2d"]), _mib(s["bytes_d2h"]),
          _mib(s["bytes_l3_read"]), _mib(s["bytes_l3_written"]), s["store_errors"],
          f"{s['skipped_pages_l2']}/{s['skipped_pages_l3']}", s["l1_evictions"],
          s["checks_passed"], f"{s['busy_s']:.1f}"] for s in rows])
    rate, attn, over = getattr(report, "prefill_fit", (math.nan, 0.0, 0.0))
    fit = "" if not rate > 0 else (
        f"\n\nPrefill cost fitted to every prefill of the run (for the modelled split, a "
        f"diagnostic): {over * 1e3:.1f} ms + tokens / {rate:,.0f} per s + {attn * 1e9:.3g} ns x "
        f"(n^2 - s^2)/2 for positions s..n.")
    lines = verdicts(report)
    load = load_table(report)
    return main + ("\n\n" + lines if lines else "") + "\n\n" + physics(report) + fit + \
        "\n\n" + details + ("\n\n" + load if load else "")


def load_table(report: DemoReport) -> str:
    """The runs under load: one row per setup and level, the serial replay first (the
    zero-load point); an overloaded row says so instead of giving a mean."""
    from kvtier.report import table
    sweep = report.load
    if sweep is None:
        return ""
    rows = sweep.table(IDEAL)
    ms = lambda r, k: "overloaded" if r["overloaded"] else f"{r[k]:.1f}"  # noqa: E731
    body = table(
        ["load", "setup", "util", "TTFT mean ms", "p50", "p90", "p99", "wait mean ms",
         "req/s", "prompt tok/s", "L1 %", "L2 %", "L3 % (prefetched)", "L3 wait ms",
         "mean speedup", "p99 speedup", "% of ideal"],
        [[r["level"], r["setup"], f"{r['utilisation']:.2f}", ms(r, "ttft_mean_ms"),
          ms(r, "ttft_p50_ms"), ms(r, "ttft_p90_ms"), ms(r, "ttft_p99_ms"),
          ms(r, "wait_mean_ms"), f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
          f"{r['l1_hit_pct']:.1f}", f"{r['l2_hit_pct']:.1f}",
          f"{r['l3_hit_pct']:.1f} ({r['l3_prefetched_pct']:.1f})",
          f"{r['l3_wait_mean_ms']:.1f}", _ratio(r["ttft_speedup"]), _ratio(r["p99_speedup"]),
          "" if r["of_ideal_pct"] is None else f"{r['of_ideal_pct']:.0f}%"] for r in rows])
    parts = table(
        ["load", "setup", "match ms", "load ms", "prefill ms", "commit ms", "preloaded %"],
        [[r["level"], r["setup"]] + [f"{r[k]:.1f}" for k in
                                     ("match_mean_ms", "load_mean_ms", "prefill_mean_ms",
                                      "commit_mean_ms")]
         + [f"{r.get('preloaded_pct', 0.0):.0f}"] for r in rows])
    cap = "" if sweep.capacity_per_s is None else (
        f"L1-only capacity {sweep.capacity_per_s:.2f} requests/s (saturated: every "
        "conversation at once); ")
    return (f"Under load ({cap}FIFO, one request at a time; util = arrival rate x mean "
            f"service, >= 1 is overloaded: the queue grows without bound):\n\n" + body +
            "\n\nWhere a request's service went (mean per request; loads: what the prefill "
            "waited for; preloaded: requests whose hits were loaded while the request ahead "
            "prefilled):\n\n" + parts)


def write_outputs(report: DemoReport, out_dir: str) -> dict[str, str]:
    """results.json, tables.md and (if enabled) demo.png under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    data = {
        "config": asdict(report.config), "model": report.model,
        "workload": {"name": report.workload.name, "description": report.workload.description,
                     "requests": len(report.workload), "rounds": report.workload.num_rounds,
                     "prompt_tokens": report.workload.total_tokens,
                     "distinct_pages": report.distinct_pages},
        "summary": report.summaries(),
        "ideal": report.ideal(), "split": report.split(),
        "per_round": {r.name: r.per_round(report.workload.num_rounds) for r in report.runs},
        "cache_metrics": {r.name: r.metrics for r in report.runs},
        "requests": {r.name: [{k: v for k, v in asdict(x).items() if k != "check"}
                              for x in r.results] for r in report.runs},
        "l3_store_stats": {r.name: r.store_stats for r in report.runs if r.store_stats},
    }
    if report.load is not None:
        cal = report.load.calibration
        data["load"] = {"capacity_per_s": report.load.capacity_per_s,
                        "capacity_run": None if cal is None else cal.summary(),
                        "levels": [asdict(lv) | {"label": lv.label}
                                   for lv in report.load.levels],
                        "table": report.load.table(IDEAL),
                        "engine_stats": [{"setup": r.setup, "level": r.level.label,
                                          **r.engine_stats}
                                         for r in report.load.runs if r.engine_stats]}
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    files["json"] = path
    path = os.path.join(out_dir, "tables.md")
    with open(path, "w") as fh:
        fh.write(tables(report) + "\n")
    files["tables"] = path
    if report.config.plot:
        from .plot import plot_rounds
        files["plot"] = plot_rounds(report, os.path.join(out_dir, "demo.png"))
        if report.load is not None:
            from .plot import plot_load
            files["load_plot"] = plot_load(report, os.path.join(out_dir, "load.png"))
    report.files = files
    return files
