"""``kvtier backends``: every discovered backend and whether it can run here."""

from __future__ import annotations

import argparse
import json
import textwrap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kind", choices=["host_allocator", "l3_store", "transfer_engine"],
                   help="only this kind of backend (default: all)")


def run(args: argparse.Namespace) -> int:
    from .registry import probe_all
    from .report import output_width, table
    rows = [r.as_dict() for r in probe_all()]
    if args.kind:
        rows = [r for r in rows if r["kind"] == args.kind]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    body = [[r["kind"], r["name"], f"{r['distribution']} {r['version']}",
             "yes" if r["available"] else "no",
             "-" if r.get("auto_priority") is None else str(r["auto_priority"])] for r in rows]
    print(table(["kind", "name", "package", "available", "auto rank"], body))
    width = output_width() or 100
    lines = []
    for r in rows:
        if not (r["reason"] or r["hint"]):
            continue
        lines += textwrap.wrap(f"{r['name']} ({r['kind']}): {r['reason']}", width,
                               break_on_hyphens=False,
                               initial_indent="  ", subsequent_indent="      ")
        if r["hint"] and not r["available"]:
            lines += textwrap.wrap(f"hint: {r['hint']}", width, break_on_hyphens=False,
                                   initial_indent="      ",
                                   subsequent_indent="        ")
    if lines:
        print("\nwhy / how:\n" + "\n".join(lines))
    return 0
