"""Model-based test of the cache's two halves: after any sequence of saves, lookups, loads,
evictions and failed plans -- submitted to the executor and completed in any order -- every
page loaded into a device page is bitwise what was saved for its key, the planner's index
keeps its invariants and no host page is lost or shared.

Plans cross a pickle boundary both ways, as they would between processes.
"""

from __future__ import annotations

import pickle

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import KVSpec
from kvtier.cache import CacheExecutor, CachePlanner, Plan, PlanResult
from kvtier.device_pool import DeviceKVPool
from kvtier.testing import fill_random
from test_cache_stateful import device_page_bytes, write_device_page

DEVICE_PAGES = 16
HOST_PAGES = 5

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5)


def wire(obj):
    return pickle.loads(pickle.dumps(obj))


class SplitMachine(RuleBasedStateMachine):
    spec = KVSpec.mha(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float16")
    write_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(99)
        self.dpool = DeviceKVPool.empty(self.spec, DEVICE_PAGES)
        cfg = {"model_id": "split-model", "host_pool_pages": HOST_PAGES, "l3_io_threads": 1,
               "write_policy": self.write_policy, "l3_store": "memory",
               "l3_config": {"capacity_bytes": 12 * self.spec.page_bytes}}
        self.ex = CacheExecutor.from_config(cfg, device_pool=self.dpool)
        self.pl = CachePlanner(cfg, spec=self.spec, device_layout="nhd", num_host_pages=HOST_PAGES,
                               l3_exists=self.ex.store.batch_exists)
        self.ref: dict[bytes, torch.Tensor] = {}
        self.outstanding: dict[int, tuple] = {}     # plan id -> (plan, loads to verify)
        self.busy: set[int] = set()                 # device pages a plan still uses
        self.arrived: dict[int, object] = {}        # results not booked yet

    def keys_of(self, symbols: list[int]) -> list[bytes]:
        tokens = [t for s in symbols for t in (s, s + 10)]
        return self.pl.keys(tokens)

    def settle_l3(self) -> None:
        """Let the executor finish what it was sent before the planner asks L3 what exists:
        its writes land in the background, and a lookup racing them would make the rules'
        outcome (and Hypothesis's replay of them) depend on thread timing."""
        assert self.ex.wait_idle(10)

    def free_device(self, n: int) -> list[int] | None:
        free = [p for p in range(DEVICE_PAGES) if p not in self.busy]
        return free[:n] if len(free) >= n else None

    def finish(self, pid: int) -> None:
        """Complete plan ``pid`` in the planner. Results the executor hands back early wait
        in ``arrived``: the planner books plans in the order the rules say (deterministic)."""
        assert self.ex.wait(pid, 10)
        for res in self.ex.poll():
            self.arrived[res.plan_id] = wire(res)
        res = self.arrived.pop(pid)
        if pid < 0:          # the L3 writes of a save booked in two parts (as vLLM's worker)
            res = PlanResult(-pid, l3_writes=res.l3_writes, held_host_pages=res.held_host_pages)
        self.pl.complete(res)
        plan, verify = self.outstanding.pop(pid)
        for (_hp, d), ok, key in zip(plan.loads, res.loads, verify):
            if ok:
                assert torch.equal(device_page_bytes(self.dpool, d), self.ref[key]), \
                    "a loaded page differs from what was saved for its key"
        self.busy -= set(plan.device_pages)

    # ----- rules ------------------------------------------------------------------------------
    @rule(symbols=prompts, complete_now=st.booleans(), two_part=st.booleans())
    def save(self, symbols, complete_now, two_part):
        keys = self.keys_of(symbols)
        dev = self.free_device(len(keys))
        if dev is None:
            return
        for key, d in zip(keys, dev):                # "prefill": same key, same bytes
            if key not in self.ref:
                for layer in range(self.spec.num_layers):
                    for c in range(self.spec.num_components):
                        fill_random(self.dpool.page(c, layer, d), self.gen)
                self.ref[key] = device_page_bytes(self.dpool, d).clone()
            else:
                write_device_page(self.dpool, d, self.ref[key])
        plan = self.pl.plan_save(keys, dev)
        if two_part and plan.l3_writes and not set(plan.device_pages) & self.busy:
            # the backups now, booked with their writes pending (the pages hit from here),
            # the writes as a plan of their own, booked whenever the rules say
            pid = plan.plan_id
            self.ex.submit(wire(Plan(pid, backups=plan.backups)))
            assert self.ex.wait(pid, 10)
            for res in self.ex.poll():
                self.arrived[res.plan_id] = wire(res)
            bres = self.arrived.pop(pid)
            self.pl.complete(wire(PlanResult(pid, backups=bres.backups, writes_pending=True)))
            assert all(bres.backups)       # (vLLM's worker writes the backed-up ones only)
            writes = Plan(-pid, l3_writes=plan.l3_writes)
            self.ex.submit(wire(writes))
            self.outstanding[-pid] = (writes, [])
            if complete_now:
                self.finish(-pid)
            return
        self.ex.submit(wire(plan))
        self.busy |= set(plan.device_pages)
        self.outstanding[plan.plan_id] = (plan, [])
        if complete_now:
            self.finish(plan.plan_id)

    @rule(symbols=prompts, start=st.integers(0, 2), complete_now=st.booleans())
    def load(self, symbols, start, complete_now):
        self.settle_l3()
        keys = self.keys_of(symbols)
        start = min(start, len(keys))
        hit = self.pl.lookup(keys, start)
        dev = self.free_device(hit.pages)
        if dev is None or not hit.pages:
            return
        for d in dev:                                # garbage in the target pages
            write_device_page(self.dpool, d, torch.zeros(self.spec.page_bytes,
                                                         dtype=torch.uint8))
        plan = self.pl.plan_load(keys, dev, start)
        self.ex.submit(wire(plan))
        self.busy |= set(plan.device_pages)
        self.outstanding[plan.plan_id] = (plan, keys[start:start + len(plan.loads)])
        if complete_now:
            self.finish(plan.plan_id)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def complete_one(self, data):
        pid = data.draw(st.sampled_from(sorted(self.outstanding)))
        self.finish(pid)

    @rule(n=st.integers(0, HOST_PAGES))
    def evict(self, n):
        plan = self.pl.plan_evict(n)
        self.ex.submit(wire(plan))
        self.outstanding[plan.plan_id] = (plan, [])

    @rule(symbols=prompts)
    def plan_lost(self, symbols):
        """A plan made but never sent (its worker gone): failed, everything comes back."""
        self.settle_l3()
        keys = self.keys_of(symbols)
        dev = self.free_device(len(keys))
        if dev is None:
            return
        self.pl.fail(self.pl.plan_load(keys, dev).plan_id)

    # ----- invariants -------------------------------------------------------------------------
    @invariant()
    def index_is_consistent(self):
        self.pl.check()

    @invariant()
    def host_pages_are_accounted_for(self):
        # every host page is free, in L2, or named by a plan still outstanding
        inflight = set()
        for plan, _ in self.outstanding.values():
            inflight |= {hp for _, hp in plan.l3_reads} | {hp for _, hp in plan.backups}
        l2 = set(self.pl.l2_pages().values())
        assert not (l2 & inflight)
        assert self.pl.host.free_count + len(l2) + len(inflight) == HOST_PAGES

    def teardown(self) -> None:
        while self.outstanding:
            self.finish(min(self.outstanding))
        self.pl.check()
        assert self.pl.pending_plans() == []
        pinned = [nd for nd in self.pl.index.nodes.values() if nd.l2_pins]
        assert not pinned, f"pages still pinned with no plan outstanding: {pinned}"
        self.ex.close()


class WriteBackSplitMachine(SplitMachine):
    write_policy = "write_back"


_settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestSplitWriteThrough = SplitMachine.TestCase
TestSplitWriteThrough.settings = _settings
TestSplitWriteBack = WriteBackSplitMachine.TestCase
TestSplitWriteBack.settings = _settings
