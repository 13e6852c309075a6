"""``kvtier backends``: every discovered backend and whether it can run here."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kind", choices=["host_allocator", "l3_store", "transfer_engine"],
                   help="only this kind of backend (default: all)")


def run(args: argparse.Namespace) -> int:
    from .registry import probe_all
    from .report import table
    rows = [r.as_dict() for r in probe_all()]
    if args.kind:
        rows = [r for r in rows if r["kind"] == args.kind]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    body = [[r["kind"], r["name"], r["distribution"], r["version"],
             "yes" if r["available"] else "no",
             r["reason"] + (f" (hint: {r['hint']})" if r["hint"] and not r["available"]
                            else "")] for r in rows]
    print(table(["kind", "name", "package", "version", "available", "reason / hint"], body))
    return 0
