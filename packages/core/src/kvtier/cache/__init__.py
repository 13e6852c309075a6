"""The tiered KV cache: `TieredKVCache` (one process) and its two halves (two processes).

Modules, one concept each:

* `config`     -- `CacheConfig` and its dict / environment / CLI glue;
* `keying`     -- the one page keyer of a config, the store opened in its namespace, the
                  per-rank store view (every path keys and opens its store here);
* `parts`      -- the data path's parts (host pool, transfer engine, store) built from a config;
* `unreadable` -- keys whose L3 read failed: not offered again until rewritten;
* `index`      -- the prefix tree of page keys with per-tier residency and pins (`PageIndex`),
                  the host page id list `PageIdPool`, the invariant check;
* `eviction`   -- two-tier leaf-first LRU eviction over an index;
* `handles`    -- `Match`, `FetchHandle`, `CommitResult`: what a request holds;
* `transfers`  -- L1 <-> L2 transfer bookkeeping and the completion thread;
* `l3io`       -- the L3 worker pool, call deadlines and the L3 health state machine;
* `l3tasks`    -- the controller's L3 reads (prefetch into L2) and writes, booked in its index;
* `lifecycle`  -- the controller's tier-failure reporting and shutdown (close, close at exit);
* `controller` -- `TieredKVCache`, composing all of the above in one process;
* `plans`      -- `Lookup`, `Offer`, `Plan`, `PlanResult`: the plain data of the two halves;
* `planner`    -- `CachePlanner`, the index/policy half (no tensors, no I/O: a scheduler):
                  what to offer, the cost split, what to save and write;
* `executor`   -- `CacheExecutor`, the data-path half (buffers, engine, store: a worker).
"""

from .config import CacheConfig
from .controller import CommitResult, FetchHandle, Match, TieredKVCache
from .executor import CacheExecutor
from .index import PageIdPool
from .planner import CachePlanner
from .plans import Lookup, Offer, Plan, PlanResult

__all__ = ["TieredKVCache", "CacheConfig", "Match", "FetchHandle", "CommitResult",
           "CachePlanner", "CacheExecutor", "Lookup", "Offer", "Plan", "PlanResult",
           "PageIdPool"]
