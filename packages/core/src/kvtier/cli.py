"""The ``kvtier`` command line.

Every sub-command, core's included, is an entry point of the group ``kvtier.commands`` that
points at a `Command`: its one-line help and the module that implements it. ``kvtier --help``
reads only those records and ``--version`` none of them; a command's module is imported when
that command runs or its ``--help`` is asked, so the tools (and torch) stay off the import
path. A name with a dot is a sub-command of a group: ``bench.limits`` is ``kvtier bench
limits``. A vendor package adds its own commands the same way::

    [project.entry-points."kvtier.commands"]
    "bench.limits" = "kvtier_nvidia_tma.commands:LIMITS"

The demo, the benchmarks and the simulator are kvtier-tools' commands (``TOOL_COMMANDS``);
asked for without it, ``kvtier`` says in one line how to install it.

The module defines ``add_arguments(parser)`` and ``run(args) -> int``. A `KVTierError` raised
by ``run`` is a one-line error and exit status 2. A module whose command builds no cache sets
``BUILDS_CACHE = False``: ``kvtier --config FILE`` then says the file does not apply to it.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

#: Entry-point group of the sub-commands.
COMMAND_GROUP = "kvtier.commands"


@dataclass(frozen=True)
class Command:
    """A sub-command: its help and the module (``add_arguments``, ``run``) behind it. A
    group's own record (``bench``) has no module."""

    help: str
    module: str | None = None


@dataclass
class _Found:
    name: str
    command: Command | None
    distribution: str
    error: str = ""


# ----- core's command (registered in kvtier-core's pyproject.toml) ------------------------------
BACKENDS = Command("list every discovered backend and whether it can run here",
                   "kvtier.backends_cli")
#: The commands kvtier-tools adds: asked for without it, they say how to install it.
TOOL_COMMANDS = ("demo", "simulate", "bench", "bench.keys", "bench.transfer", "bench.store",
                 "bench.control", "bench.mooncake", "bench.vllm", "bench.prefill",
                 "bench.serve")
TOOLS_HINT = ('kvtier-tools: pip install "kvtier[demo]" (from a clone: pip install '
              '"packages/tools[demo]")')


def discover_commands() -> dict[str, _Found]:
    """Every registered command by its dotted name. A broken entry point or a name two
    distributions claim is kept with its error (shown when it is run), never hiding others."""
    import importlib.metadata as md
    found: dict[str, _Found] = {}
    seen: set[tuple[str, str]] = set()
    for ep in md.entry_points(group=COMMAND_GROUP):
        dist = ep.dist.name if ep.dist is not None else "<unknown>"
        if (ep.name, ep.value) in seen:           # the same distribution twice on sys.path
            continue
        seen.add((ep.name, ep.value))
        if ep.name in found:
            other = found[ep.name]
            other.error = (f"registered by two distributions: {other.distribution} and "
                           f"{dist}; uninstall one")
            other.command = None
            continue
        try:
            cmd = ep.load()
        except Exception as exc:          # one broken plugin must not break the others
            found[ep.name] = _Found(ep.name, None, dist, f"entry point {ep.value!r} failed to "
                                    f"load: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(cmd, Command):
            found[ep.name] = _Found(ep.name, None, dist,
                                    f"entry point {ep.value!r} is not a kvtier.cli.Command")
            continue
        found[ep.name] = _Found(ep.name, cmd, dist)
    return dict(sorted(found.items()))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it or there is none."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (
            None, False, True, argparse.SUPPRESS, "", [], {})

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not self._shows_default(action):
            return text
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):     # no help text: the default
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line and exit status 2 (no usage dump)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _help(f: _Found | None) -> str:
    if f is None:
        return ""
    if f.command is None:
        return f"(unusable: {f.error})"
    return f.command.help


#: Root options that take a value (so their value is not taken for a command name).
_ROOT_VALUED = ("--config",)


def _positionals(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _ROOT_VALUED:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def setup_logging(verbosity: int) -> None:
    """kvtier's loggers (``kvtier.*``) to stderr: warnings by default, ``-v`` info, ``-vv``
    debug, ``-q`` errors only. Leaves other libraries' loggers alone."""
    import logging
    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(
        max(-1, min(verbosity, 2)), logging.DEBUG)
    log = logging.getLogger("kvtier")
    if not any(getattr(h, "_kvtier_cli", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        h._kvtier_cli = True  # type: ignore[attr-defined]
        log.addHandler(h)
    log.setLevel(level)


def _attach(p: argparse.ArgumentParser, path: str, f: _Found | None) -> None:
    """Import the module behind one command and let it add its flags."""
    if f is None or f.command is None or f.command.module is None:
        p.set_defaults(_error=f"{path}: {f.error if f else 'not a command'}")
        return
    try:
        mod = importlib.import_module(f.command.module)
    except ImportError as exc:
        p.set_defaults(_error=f"{path} ({f.distribution}) cannot be loaded: "
                              f"{type(exc).__name__}: {exc}")
        return
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run, _builds_cache=getattr(mod, "BUILDS_CACHE", True))


def missing_tool(words: list[str], commands: dict[str, _Found]) -> str | None:
    """The tool command ``words`` asks for when kvtier-tools, which adds it, is not installed
    (``"demo"``, ``"bench keys"``); None otherwise."""
    for n in (2, 1):
        name = ".".join(words[:n])
        if len(words) >= n and name in TOOL_COMMANDS and not any(
                c == name or c.startswith(name + ".") for c in commands):
            return " ".join(words[:n])
    return None


def build_parser(argv: list[str] | None = None,
                 commands: dict[str, _Found] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command is listed, only the one ``argv`` names (if any)
    gets its flags, which imports its module."""
    from ._version import __version__
    words = _positionals(list(sys.argv[1:] if argv is None else argv))
    if commands is None:
        commands = discover_commands()
    tools = "" if "demo" in commands else f"demo, simulate and bench come with {TOOLS_HINT}"
    parser = _Parser(prog="kvtier", description="Tiered KV-cache offloading.",
                     epilog=tools or None)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-v: info, -vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="errors only")
    parser.add_argument("--config", metavar="FILE", default=None, dest="_kvtier_config",
                        help="a TOML config file whose [cache] table configures every cache "
                        "the command builds (also $KVTIER_CONFIG); docs/config.md lists the "
                        "fields")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    tops = sorted({n.split(".")[0] for n in commands})
    for top in tops:
        children = {n.split(".", 1)[1]: f for n, f in commands.items()
                    if n.startswith(top + ".")}
        h = _help(commands.get(top))
        p = sub.add_parser(top, help=h, description=h)
        if not words or words[0] != top:
            continue
        if not children:
            _attach(p, top, commands.get(top))
            continue
        gsub = p.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
        for child, f in children.items():
            ch = _help(f)
            cp = gsub.add_parser(child, help=ch, description=ch)
            if len(words) > 1 and words[1] == child:
                _attach(cp, f"{top} {child}", f)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import KVTierError
    argv = list(sys.argv[1:] if argv is None else argv)
    words = _positionals(argv)
    if "--version" in (argv[:argv.index(words[0])] if words else argv):
        from ._version import __version__
        print(f"kvtier {__version__}")            # loads no command's entry point
        return 0
    commands = discover_commands()
    tool = missing_tool(words, commands)
    if tool is not None:
        print(f"kvtier {tool}: error: not installed; it comes with {TOOLS_HINT}", file=sys.stderr)
        return 2
    args = build_parser(argv, commands).parse_args(argv)
    name = " ".join(x for x in (args.command, getattr(args, "subcommand", None)) if x)
    run: Any = getattr(args, "_run", None)
    if run is None:
        print(f"kvtier: error: {getattr(args, '_error', name + ': not runnable')}",
              file=sys.stderr)
        return 2
    setup_logging(-1 if args.quiet else args.verbose)
    try:
        path = getattr(args, "_kvtier_config", None)
        if path is not None:
            from .config import read_config_file
            read_config_file(path, "cache")            # a bad file: one line, exit 2
            os.environ["KVTIER_CONFIG"] = path
            if not getattr(args, "_builds_cache", True):
                print(f"kvtier {name}: note: this command builds no cache; the [cache] table "
                      f"of {path} does not apply to it", file=sys.stderr)
        return int(run(args) or 0)
    except KVTierError as exc:
        print(f"kvtier {name}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
