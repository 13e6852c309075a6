"""NVIDIA transfer engines: TMA bulk copies, register copies, the copy engine and the router,
one module each (`tma`, `register`, `copy_engine`, `routed`; what they share in `_engine`,
copy runs in `_runs`); this module names them all in one place.


All three move KV pages between a CUDA ``DeviceKVPool`` (layer_first) and a ``HostKVPool``
(page_first or layer_first) in pinned/registered host memory, on the caller's current torch
stream (or a side stream ordered after it), with no host synchronisation: page indices are
int64 tensors read on the device. Loads run one launch per layer by default and record one CUDA
event per layer, so ``handle.wait_layer(i)`` makes the caller's stream wait for layer ``i``
only; backups run one launch for all layers. A load of a range of layers (``layers=(lo, hi)``)
runs one launch per layer of the range (one for the range without ``layerwise_load``), an
event after each, and touches no other layer of the pages.

Index checking: Python lists and CPU tensors are checked on the host (no cost to the device).
Device tensors are checked before launch only with ``debug=True`` (a check needs a host
sync); without it the kernels still skip out-of-range pairs, never writing through them, and
count them (``bad_pairs()``). Two pairs with the same destination page race (undefined which
lands); ``debug=True`` rejects them.
"""

from __future__ import annotations

from ._engine import CudaEventHandle, LayerSignalHandle
from ._runs import chunk_runs, merge_runs
from .copy_engine import (CopyEngineTransferEngine, copy_list, layer_copy_lists, runs_per_layer,
                          strided_ops, strided_runs, strided_self_test)
from .register import RegisterTransferEngine
from .routed import (CALIBRATION_CHUNKS, CALIBRATION_VERSION, RoutedHandle,
                     RoutedTransferEngine, calibrate, calibration_entry)
from .tma import TmaTransferEngine

__all__ = ["CudaEventHandle", "LayerSignalHandle", "TmaTransferEngine", "RegisterTransferEngine",
           "CopyEngineTransferEngine", "RoutedTransferEngine", "RoutedHandle", "chunk_runs",
           "merge_runs", "copy_list", "layer_copy_lists", "runs_per_layer", "strided_ops",
           "strided_runs", "strided_self_test", "calibrate", "calibration_entry",
           "CALIBRATION_CHUNKS", "CALIBRATION_VERSION"]
