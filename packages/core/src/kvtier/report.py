"""Plain-text tables and a progress helper for commands people read."""

from __future__ import annotations

import sys
from typing import Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table (readable in a terminal, pasteable into docs)."""
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    lines = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def progress(iterable, total: int | None = None, desc: str = "", disable: bool = False):
    """A tqdm progress bar on stderr (quiet when not a terminal and ``disable``)."""
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=False)
