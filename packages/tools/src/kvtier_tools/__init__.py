"""kvtier-tools: what a user runs beside the library, as ``kvtier`` sub-commands: the demo
(``kvtier demo``), the benchmarks (``kvtier bench ...``) and the trace simulator
(``kvtier simulate``). Importing this package imports none of them (nor torch)."""

from ._version import __version__

__all__ = ["__version__"]
