"""Plain-text tables, byte sizes and a progress helper for commands people read."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import Any, Iterable, Sequence

#: The narrowest a wrapped column gets, and the widest that is never wrapped (characters).
MIN_COLUMN = 8
SHORT_COLUMN = 20


def output_width(stream: Any = None) -> int | None:
    """Columns a table printed to ``stream`` (stdout) must fit: the terminal's width, or
    ``$COLUMNS`` when set; None (no limit) when the output is not a terminal, so that tables
    piped into files stay one row per line."""
    stream = sys.stdout if stream is None else stream
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size().columns if tty else None


def _fit(widths: list[int], budget: int, floors: list[int]) -> list[int]:
    """Column widths summing to at most ``budget``: the widest columns are capped first,
    none below its floor."""
    widths = list(widths)
    while sum(widths) > budget:
        widest = max(range(len(widths)), key=lambda i: widths[i] - floors[i])
        if widths[widest] <= floors[widest]:
            break                                   # cannot shrink further: overflow
        widths[widest] -= 1
    return widths


def table(header: Sequence[str], rows: Iterable[Sequence[object]],
          width: int | None | str = "auto") -> str:
    """A GitHub-flavoured markdown table, readable in a terminal and pasteable into docs.

    Where the rows are wider than ``width`` (default: `output_width()`; None: no limit), the
    widest columns wrap inside their cells onto continuation lines."""
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    natural = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    limit = output_width() if width == "auto" else width
    widths = natural
    if isinstance(limit, int):
        # short columns (names, numbers) keep their width; long text wraps
        floors = [n if n <= SHORT_COLUMN else max(MIN_COLUMN, min(len(h), SHORT_COLUMN))
                  for n, h in zip(natural, header)]
        widths = _fit(natural, limit - (3 * len(header) + 1), floors)

    def lines_of(row: Sequence[str]) -> list[str]:
        parts = [textwrap.wrap(c, w, break_long_words=True, break_on_hyphens=False) or [""]
                 if len(c) > w else [c] for c, w in zip(row, widths)]
        depth = max(len(p) for p in parts)
        return ["| " + " | ".join((p[k] if k < len(p) else "").ljust(w)
                                  for p, w in zip(parts, widths)) + " |" for k in range(depth)]

    out = lines_of(list(header))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        out += lines_of(r)
    return "\n".join(out)


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """``"512M"``, ``"1.5G"``, ``"4KiB"``, ``"4096"`` -> bytes; anything else is an
    InvalidArgumentError naming ``what`` (the command prints it as one line, exit 2)."""
    from .errors import InvalidArgumentError
    raw = str(text)
    t = raw.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in _UNITS:
        t, mult = t[:-1], _UNITS[t[-1]]
    try:
        value = float(t) if "." in t else int(t)
    except ValueError:
        value = None
    if value is None or value <= 0 or int(value * mult) <= 0:
        raise InvalidArgumentError(f"{what}: {raw!r} is not a size (examples: 4096, 256K, "
                                   "1.5M, 1G)", argument=what, value=raw)
    return int(value * mult)


def progress(iterable, total: int | None = None, desc: str = "", disable: bool = False):
    """A tqdm progress bar on stderr that stays on screen when done (none with ``disable``)."""
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=True)
