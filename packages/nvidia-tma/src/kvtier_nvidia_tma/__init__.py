"""kvtier-nvidia-tma: NVIDIA Hopper/Blackwell page transfers (TMA bulk copies) and pinned
host pools. Importing this package loads no CUDA library; backends do it in probe()."""

from ._version import __version__

#: kvtier interface version these backends implement.
KVTIER_INTERFACE_VERSION = 1

__all__ = ["__version__", "KVTIER_INTERFACE_VERSION"]
