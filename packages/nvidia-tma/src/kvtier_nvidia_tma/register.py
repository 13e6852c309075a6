"""``nvidia-register``: register copies of KV pages by SM threads (any CUDA GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier import Availability

from ._engine import _NvidiaEngine
from ._plan import plan_register
from ._probe import probe_cuda


class RegisterTransferEngine(_NvidiaEngine):
    """``nvidia-register``: 16-byte register copies by a small grid (any sm_70+ GPU; the
    baseline the TMA engine is measured against)."""

    name = "nvidia-register"
    _min_cc = 70
    _auto_priority = 5

    @dataclass(frozen=True)
    class Config:
        ctas: int = 2
        threads: int = 1024
        #: Independent 16-byte loads in flight per thread (2, 4 or 8).
        unroll: int = 8
        layerwise_load: bool = True
        layerwise_backup: bool = False
        side_stream: bool = False
        debug: bool = False
        device: int | None = None

    @classmethod
    def probe(cls) -> Availability:
        return probe_cuda((7, 0), "the register-copy kernel")

    def __init__(self, device_pool, host_pool, config: Any = None):
        super().__init__(device_pool, host_pool, config)
        from . import _driver
        c = self.config
        plan = plan_register(self._geo, 1, 1, ctas=c.ctas, threads=c.threads, unroll=c.unroll)
        self._kernel = _driver.load_kernel(self._dev, "register_copy.cu", plan.kernel)
        self.ctas = c.ctas

    def _launch(self, h, d, d2h, layer0, layers, stream) -> None:
        from . import _driver
        c = self.config
        plan = plan_register(self._geo, h.numel(), layers, ctas=c.ctas, threads=c.threads,
                             unroll=c.unroll)
        for first, count in plan.batches:
            p = self._params(h, d, d2h, layer0, layers)
            p.host_idx += first * 8
            p.dev_idx += first * 8
            p.n = count
            _driver.launch(self._kernel, plan.grid, plan.threads, 0, stream, p)
