"""The ``kvtier`` sub-commands this package adds (entry points of ``kvtier.commands``).
Importing this module is cheap: a command's module loads when the command runs."""

from kvtier.cli import Command

DEMO = Command("replay a multi-turn workload through L1 / L1+L2 / L1+L2+L3 with a real model, "
               "against every page kept in L1 (the measured ideal): hit rate, TTFT, bytes "
               "moved", "kvtier_tools.demo.command")
SIMULATE = Command("replay a request trace through the tiers (no model): per-tier hit rates",
                   "kvtier_tools.simulate")
BENCH = Command("run a benchmark (measures its own ceiling in the same run)")
BENCH_KEYS = Command("page-key hashing and chaining throughput", "kvtier_tools.bench.keys")
BENCH_TRANSFER = Command("host<->device page transfers vs the pinned-memcpy ceiling",
                         "kvtier_tools.bench.transfer")
BENCH_STORE = Command("file store batch_get/batch_set vs the disk's raw I/O",
                      "kvtier_tools.bench.store")
BENCH_CONTROL = Command("controller match/fetch/commit overhead per page",
                        "kvtier_tools.bench.control")
BENCH_MOONCAKE = Command("mooncake store batch_get/batch_set over loopback vs TCP and the file "
                         "store", "kvtier_tools.bench.mooncake_store")
BENCH_PREFILL = Command("the demo model's prefill after a cached prefix vs recomputing all "
                        "tokens (the recompute side of the physics)",
                        "kvtier_tools.bench.prefill")
BENCH_VLLM = Command("a multi-turn workload inside vLLM, alone and with kvtier (needs vllm)",
                     "kvtier_tools.bench.vllm")
BENCH_SERVE = Command("vLLM's OpenAI server under load (fixed concurrency and request rate), "
                      "alone, with kvtier and with peers (needs vllm)",
                      "kvtier_tools.bench.serve")
