"""``kvtier demo``: what kvtier is for, end to end and measured.

A Llama-architecture model (or DeepSeek-V2 with MLA, whose latent cache is what the tiers
hold: ``--model-size mla-*``; random weights, nothing downloaded) serves a multi-turn workload
(or a long-context one, or a Mooncake trace) through `TieredKVCache` once per setup -- L1
only, L1+L2, L1+L2+L3, L1+L2+L3 loading every hit (what the cost-aware split is judged
against) and every page kept in L1 (the measured ideal); prefills run as a real engine's (the
uncached suffix in one forward, layer i waiting only for layer i of the restored prefix),
every restored page is checked against its digest at commit and sampled requests against a
full recompute, and the run ends with tables (hit rate per tier, TTFT mean/P90, speedups over
L1 only and as a % of the measured ideal's, the split against its alternatives, the measured
rates and the modelled split at them, tokens computed/loaded/skipped, bytes moved) and a PNG
of hit rate and TTFT per round. Modules: `model` (the model and its prefills), `mla` (the
MLA sizes and their latent pages), `digest`, `workload` and `trace` (what is replayed),
`engine` (the device pool and request loop), `run` (setups, results), `load` (the same
setups under load: arrivals, a FIFO queue, prefetch from arrival), `output` (tables,
results.json), `plot`.

Importing this package is cheap: the model and the cache are imported when the command runs.
"""

from __future__ import annotations

from .command import add_arguments, config_from_args
from .command import run as main

__all__ = ["add_arguments", "config_from_args", "main"]
