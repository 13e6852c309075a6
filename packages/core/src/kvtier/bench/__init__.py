"""``kvtier bench <what>``: benchmarks as commands, each in its own module here.

A benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int`` and is listed in
``BENCHMARKS`` (module name -> help). Benchmarks measure the ceiling they compare against in
the same run and print a table of ratios.
"""

from __future__ import annotations

import argparse
import importlib

from ..cli import command

#: sub-command -> (module under kvtier.bench, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "keys": ("kvtier.bench.keys", "page-key hashing and chaining throughput"),
    "transfer": ("kvtier.bench.transfer",
                 "host<->device page transfers vs the pinned-memcpy ceiling"),
    "store": ("kvtier.bench.store", "file store batch_get/batch_set vs the disk's raw I/O"),
    "control": ("kvtier.bench.control", "controller match/fetch/commit overhead per page"),
    "mooncake": ("kvtier.bench.mooncake_store",
                 "mooncake store batch_get/batch_set over loopback vs TCP and the file store"),
}


def _arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHMARKS.items():
        bp = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_arguments(bp)
        bp.set_defaults(_bench_run=mod.run)


@command("bench", "run a benchmark (measures its own ceiling in the same run)")
def _bench(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)


_bench.arguments = _arguments  # type: ignore[attr-defined]
