"""The serving thread's host work on the CPU, without the model's compute: `kvtier demo` on
call 6's workload shape (32 layers, 64-token pages, 16 conversations x 12 rounds, L1 144
pages, L2 479, a chain L3: an shm arena before the file store on tmpfs, two stage helpers),
with the prefill replaced by a 5 ms sleep that waits for each layer's load as the model
does. Prints the demo's tables (match / load / prefill / commit per request) and the CPU
time (of the thread that runs them) of the file member's existence checks.

    python records/l3-staging/host-proxy.py "L1+L2+L3,ideal (all in L1)" --rate 20
"""
import atexit
import collections
import shutil
import sys
import time

import torch

from kvtier.cli import main
from kvtier.l3_stores.file import segment_reads
from kvtier_tools.demo import model as M

M.MODEL_SIZES["proxy32"] = M.ModelSize("proxy32", hidden=64, layers=32, intermediate=64,
                                       heads=2, kv_heads=1, vocab=512, about="host proxy")


def prefill(self, tokens, pool, prefix, new_pages, *, wait_layer=None, mode="fast"):
    for i in range(self.size.layers):
        if wait_layer is not None:
            wait_layer(i)
    time.sleep(0.005)
    return torch.zeros(self.size.vocab)


M.DemoModel.prefill = prefill
acc = collections.Counter()
_exists = segment_reads.SegmentReads.exists


def exists(self, keys):
    t = time.thread_time()
    try:
        return _exists(self, keys)
    finally:
        acc["calls"] += 1
        acc["cpu_s"] += time.thread_time() - t


segment_reads.SegmentReads.exists = exists
atexit.register(lambda: print(f"file member existence checks: {acc['calls']} calls, "
                              f"{1e3 * acc['cpu_s'] / max(1, acc['calls']):.3f} ms CPU each"))
root = "/dev/shm/kvtier-host-proxy"
shutil.rmtree(root, ignore_errors=True)
chain = ('{"stores":[{"store":"shm","config":{"name":"kvproxy","capacity_bytes":1073741824,'
         '"remove_when_unused":true}},{"store":"file","config":{"root":"%s","io_threads":8}}],'
         '"stage_processes":2}' % root)
try:
    main(["demo", "--model-size", "proxy32", "--clients", "16", "--rounds", "12",
          "--l1-pages", "144", "--l2-pages", "479", "--setups", sys.argv[1],
          "--l3-store", "chain", "--l3-config", chain, "--recompute-tokens-per-s", "20000",
          *sys.argv[2:], "--no-plot",
          "--no-progress", "--check", "none", "--out", root + "-out"])
except SystemExit:
    pass
finally:
    import json
    for r in json.load(open(root + "-out/results.json"))["load"]["table"]:
        if r["kind"] != "serial" and r.get("preload_skips") is not None:
            print(r["level"], r["setup"], f"preloaded {r['preloaded_pct']:.0f}%",
                  r["preload_skips"])
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + "-out", ignore_errors=True)
