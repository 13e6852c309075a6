"""kvtier-amd-umbp: host allocator and L3 store on AMD mori's UMBP. Importing this package
imports no mori module; backends do it in probe()."""

from ._version import __version__

KVTIER_INTERFACE_VERSION = 1

__all__ = ["__version__", "KVTIER_INTERFACE_VERSION"]
