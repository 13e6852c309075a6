"""The package's backends are discovered and report honestly why they can or cannot run."""

from kvtier.testing import PackageContract


class TestPackage(PackageContract):
    """Discovery with reasons, no vendor import, core imports nothing of the package."""

    distribution = "kvtier-nvidia-tma"
    module = "kvtier_nvidia_tma"
    backends = {("host_allocator", "cuda-host-register"), ("transfer_engine", "nvidia-tma"),
                ("transfer_engine", "nvidia-register"), ("transfer_engine", "nvidia-copy-engine"),
                ("transfer_engine", "nvidia-routed")}
