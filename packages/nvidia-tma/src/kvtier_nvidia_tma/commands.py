"""The ``kvtier`` sub-commands this package adds (entry points of ``kvtier.commands``).
Importing this module is cheap: the command's module loads when the command runs."""

from kvtier.cli import Command

LIMITS = Command("what limits host<->device transfers on this GPU: GEMM vs held SMs, PCIe "
                 "link bytes, read latency, Nsight Compute counters (kvtier-nvidia-tma)",
                 "kvtier_nvidia_tma.limits")
