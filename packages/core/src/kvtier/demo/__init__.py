"""``kvtier demo``: what kvtier is for, end to end and measured.

A Llama-architecture model (random weights, nothing downloaded) serves a multi-turn workload
(or a Mooncake trace) three times -- L1 only, L1+L2, L1+L2+L3 -- through `TieredKVCache`;
every prefill runs on KV restored from the tiers, is checked against a full recompute, and
the run ends with a table (hit rate per tier, TTFT mean/P90, tokens computed vs loaded, bytes
moved) and a PNG of hit rate and TTFT per round. Modules: `model` (the model and its paged
prefill), `workload` and `trace` (what is replayed), `engine` (the device pool and request
loop), `run` (setups, results, tables), `plot`.

Importing this package is cheap: the model and the cache are imported when the command runs.
"""

from __future__ import annotations

from .command import add_arguments, config_from_args
from .command import run as main

__all__ = ["add_arguments", "config_from_args", "main"]
