"""py-spy's raw (collapsed stack) output, for spy-summary.py and gil-summary.py: one
``frame;frame;... count`` line per distinct stack."""
import re


def samples(path: str):
    """(frames, count) of every stack in ``path``, the thread first with ``--threads``."""
    for line in open(path):
        line = line.rstrip("\n")
        if line:
            stack, count = line.rsplit(" ", 1)
            yield stack.split(";"), int(count)


def where(frame: str) -> str:
    """A frame without its line number: ``f (file.py)``."""
    return re.sub(r":\d+\)$", ")", frame)
