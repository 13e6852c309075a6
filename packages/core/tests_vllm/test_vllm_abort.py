"""Clients that leave mid-request (vLLM aborts the request) leave nothing of kvtier's behind:
no L2 page pinned, no plan pending -- whether the request was loading from L2 inside the
step (a synchronous load) or waiting for an asynchronous L3 load."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm import kv_transfer_config  # noqa: E402
from kvtier_tools.bench.vllm import make_llama, run_in_subprocess  # noqa: E402

rng = random.Random(53)
PROMPT = [rng.randrange(1, 500) for _ in range(300)]
MORE = [PROMPT + [rng.randrange(1, 500) for _ in range(40)] for _ in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama(str(tmp_path_factory.mktemp("abort") / "llama"))


def _run(model, ktc, phases):
    res = run_in_subprocess({"model": model, "kv_transfer_config": ktc, "phases": phases,
                             "max_tokens": 32}, timeout=300)
    assert "start_error" not in res, res["start_error"]
    return res


def test_aborted_requests_loading_from_l2_leave_no_pins(model):
    ktc = kv_transfer_config({"host_pool_pages": 64, "cost_aware_fetch": False})
    res = _run(model, ktc, [{"prompts": [PROMPT]}, {"abort": MORE, "steps": 1}])
    ab = res["phases"][1]
    assert ab["aborted"] == 3 and not ab["unfinished"]
    assert ab["l2_pinned_pages"] == 0 and ab["plans_pending"] == 0, ab
    assert res["kvtier"]["hit_tokens_l2"] > 0, res["kvtier"]      # the aborts were loading


def test_aborted_requests_waiting_for_l3_leave_no_pins(model, tmp_path):
    ktc = kv_transfer_config({"host_pool_pages": 64, "cost_aware_fetch": False,
                              "l3_store": "file", "l3_config": {"root": str(tmp_path / "l3")}})
    _run(model, ktc, [{"prompts": [PROMPT]}])                       # fills the L3
    res = _run(model, ktc, [{"abort": MORE, "steps": 1}])           # an empty L2: loads wait
    ab = res["phases"][0]
    assert ab["aborted"] == 3 and not ab["unfinished"]
    assert ab["l2_pinned_pages"] == 0 and ab["plans_pending"] == 0, ab
    assert res["kvtier"]["hit_tokens_l3"] > 0, res["kvtier"]
