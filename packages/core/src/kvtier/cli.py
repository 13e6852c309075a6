"""The ``kvtier`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

#: Sub-commands other modules add: name -> (help, run(args) -> int).
COMMANDS: dict[str, tuple[str, Callable]] = {}


def command(name: str, help: str):
    """Register a sub-command: decorate ``run(args)``; ``run.arguments(parser)``, if set
    (before or after decorating), adds its flags."""
    def deco(run):
        COMMANDS[name] = (help, run)
        return run
    return deco


def _backends_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kind", choices=["host_allocator", "l3_store", "transfer_engine"],
                   help="only this kind of backend")


def _backends(args: argparse.Namespace) -> int:
    from .registry import probe_all
    rows = [r.as_dict() for r in probe_all()]
    if args.kind:
        rows = [r for r in rows if r["kind"] == args.kind]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from .report import table
    body = [[r["kind"], r["name"], r["distribution"], r["version"],
             "yes" if r["available"] else "no",
             "-" if r.get("auto_priority") is None else r["auto_priority"],
             r["reason"] + (f" (hint: {r['hint']})" if r["hint"] and not r["available"]
                            else "")] for r in rows]
    print(table(["kind", "name", "package", "version", "available", "auto rank",
                 "reason / hint"], body))
    return 0


_backends.arguments = _backends_arguments  # type: ignore[attr-defined]
command("backends", "list every discovered backend and whether it can run here")(_backends)


def _load_plugins() -> None:
    """Import the modules that add sub-commands (kept out of ``import kvtier``)."""
    import importlib
    for mod in ("kvtier.bench", "kvtier.demo", "kvtier.simulate"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    _load_plugins()
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offloading.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        getattr(run, "arguments", lambda _p: None)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import KVTierError
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(COMMANDS[args.command][1](args) or 0)
    except KVTierError as exc:
        print(f"kvtier {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # Run as a script this module is ``__main__``, and the sub-command modules would register
    # into the other copy, ``kvtier.cli``: hand over to that one.
    from kvtier.cli import main as _main
    sys.exit(_main())
