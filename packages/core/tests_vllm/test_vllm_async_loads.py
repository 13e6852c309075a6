"""kvtier's L3 loads are asynchronous inside vLLM: a request whose prefix loads from the L3
waits in vLLM's own accounting of asynchronous KV fetches (the scheduler's counts by fetch
stage, behind its ``num_requests_kv_fetch_by_stage`` gauge) while vLLM runs other requests,
and its output is the one a full recompute gives."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import make_llama, run_in_subprocess  # noqa: E402

rng = random.Random(71)
PREFIX = [rng.randrange(1, 500) for _ in range(320)]
HITS = [PREFIX + [rng.randrange(1, 500) for _ in range(24)] for _ in range(2)]
FRESH = [[rng.randrange(1, 500) for _ in range(200)] for _ in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(str(tmp_path_factory.mktemp("async") / "llama"))


def _run(model, ktc, phases):
    res = run_in_subprocess({"model": model, "kv_transfer_config": ktc, "phases": phases,
                             "max_tokens": 8}, timeout=300)
    assert "start_error" not in res, res["start_error"]
    return res


def test_l3_loads_wait_in_vllms_fetch_accounting_while_others_run(model, tmp_path):
    ktc = kv_transfer_config({"host_pool_pages": 64, "cost_aware_fetch": False,
                              "l3_store": "file", "l3_config": {"root": str(tmp_path / "l3")}})
    ref = _run(model, None, [{"prompts": HITS}])["phases"][0]["requests"]
    _run(model, ktc, [{"prompts": [PREFIX]}])                       # fills the L3
    res = _run(model, ktc, [{"beside": {"hits": HITS, "fresh": FRESH}}])  # an empty L2
    ph = res["phases"][0]
    assert not ph["unfinished"]
    assert ph["fetching_max"] >= 1, ph               # vLLM counted the loads as async fetches
    assert ph["steps_fetching_while_others_ran"] >= 1, ph["trace"]  # ... and ran others meanwhile
    assert res["kvtier"]["hit_tokens_l3"] > 0, res["kvtier"]
    assert ph["hit_outputs"] == [r["output"] for r in ref]


def test_l2_loads_run_inside_the_step_and_are_no_async_fetch(model):
    """The same requests with the prefix in L2 (the engine that served it): kvtier loads it
    inside the step, so vLLM counts no asynchronous fetch -- the counts above are the L3's."""
    ktc = kv_transfer_config({"host_pool_pages": 64, "cost_aware_fetch": False})
    res = _run(model, ktc, [{"prompts": [PREFIX]}, {"beside": {"hits": HITS, "fresh": FRESH}}])
    ph = res["phases"][1]
    assert not ph["unfinished"] and ph["fetching_max"] == 0, ph
    assert res["kvtier"]["hit_tokens_l2"] > 0, res["kvtier"]
