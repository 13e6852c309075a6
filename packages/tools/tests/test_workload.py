"""The demo's multi-turn workload generator: deterministic, growing histories, shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier_tools.demo.workload import WorkloadError, multiturn, round_of
from kvtier.errors import KVTierError


def _by_client(wl):
    out: dict[int, list] = {}
    for r in wl.requests:
        out.setdefault(r.client, []).append(r)
    return out


def test_same_seed_same_workload_other_seed_differs():
    a = multiturn(3, 4, first_tokens=50, turn_tokens=20, answer_tokens=10, seed=7)
    b = multiturn(3, 4, first_tokens=50, turn_tokens=20, answer_tokens=10, seed=7)
    c = multiturn(3, 4, first_tokens=50, turn_tokens=20, answer_tokens=10, seed=8)
    assert [(r.client, r.round) for r in a.requests] == [(r.client, r.round) for r in b.requests]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a.requests, b.requests))
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a.requests, c.requests))


def test_shapes_rounds_and_every_client_once_per_round():
    wl = multiturn(5, 3, first_tokens=40, turn_tokens=10, answer_tokens=5, vocab_size=100)
    assert len(wl) == 15 and wl.num_rounds == 3
    assert [r.index for r in wl.requests] == list(range(15))
    for rnd in range(3):
        reqs = wl.requests[rnd * 5:(rnd + 1) * 5]       # replayed round by round
        assert {r.round for r in reqs} == {rnd}
        assert sorted(r.client for r in reqs) == list(range(5))
    for r in wl.requests:
        assert r.tokens.dtype == np.int64 and r.tokens.ndim == 1
        assert 0 <= r.tokens.min() and r.tokens.max() < 100
        assert not r.tokens.flags.writeable
    assert wl.total_tokens == sum(r.num_tokens for r in wl.requests)
    assert wl.max_tokens == max(r.num_tokens for r in wl.requests)


def test_histories_grow_by_answer_and_turn():
    wl = multiturn(4, 5, first_tokens=64, turn_tokens=16, answer_tokens=8, jitter=0.25, seed=3)
    for reqs in _by_client(wl).values():
        assert [r.round for r in reqs] == list(range(5))
        for prev, cur in zip(reqs, reqs[1:]):
            n = prev.num_tokens
            # the previous prompt is a strict prefix; then the answer, then the new user turn
            assert np.array_equal(cur.tokens[:n], prev.tokens)
            grown = cur.num_tokens - n
            assert 6 + 12 <= grown <= 10 + 20, grown        # answer 8+-2, turn 16+-4
            assert prev.output_len >= 6
    # clients do not share content (no system prompt)
    firsts = [reqs[0].tokens[:32] for reqs in _by_client(wl).values()]
    assert len({f.tobytes() for f in firsts}) == 4


def test_shared_system_prompt_and_exact_lengths_without_jitter():
    wl = multiturn(3, 2, first_tokens=30, turn_tokens=10, answer_tokens=5, system_tokens=12,
                   jitter=0.0, seed=1)
    r0 = [r for r in wl.requests if r.round == 0]
    assert all(r.num_tokens == 42 for r in r0)
    assert all(np.array_equal(r.tokens[:12], r0[0].tokens[:12]) for r in r0)
    assert all(r.num_tokens == 42 + 5 + 10 for r in wl.requests if r.round == 1)


def test_round_order_is_shuffled_but_can_be_fixed():
    wl = multiturn(8, 4, first_tokens=8, turn_tokens=4, answer_tokens=2, seed=0)
    orders = [[r.client for r in wl.requests if r.round == k] for k in range(4)]
    assert len({tuple(o) for o in orders}) > 1
    fixed = multiturn(8, 2, first_tokens=8, turn_tokens=4, answer_tokens=2, shuffle=False)
    assert [r.client for r in fixed.requests] == list(range(8)) * 2


@pytest.mark.parametrize("kwargs, field", [
    ({"clients": 0}, "clients"), ({"rounds": -1}, "rounds"), ({"clients": True}, "clients"),
    ({"first_tokens": 0}, "first_tokens"), ({"answer_tokens": -1}, "answer_tokens"),
    ({"jitter": 1.0}, "jitter"), ({"vocab_size": 1}, "vocab_size"),
])
def test_bad_parameters_are_typed_errors(kwargs, field):
    args = {"clients": 2, "rounds": 2} | kwargs
    with pytest.raises(WorkloadError) as ei:
        multiturn(args.pop("clients"), args.pop("rounds"), **args)
    assert isinstance(ei.value, KVTierError) and ei.value.field == field


def test_round_of_splits_evenly():
    assert [round_of(i, 10, 3) for i in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [round_of(i, 2, 2) for i in range(2)] == [0, 1]


def test_long_context_documents_are_asked_every_round():
    from kvtier_tools.demo.workload import long_context
    w = long_context(3, 4, min_tokens=500, max_tokens=900, question_tokens=40, jitter=0.0,
                     seed=2)
    assert w.name == "long" and len(w) == 12 and w.num_rounds == 4
    docs: dict[int, np.ndarray] = {}
    for r in range(4):
        rs = [q for q in w.requests if q.round == r]
        assert sorted(q.client for q in rs) == [0, 1, 2]       # each document once a round
    for q in w.requests:
        n = q.num_tokens
        assert 500 + 40 <= n <= 900 + 40
        d = docs.setdefault(q.client, q.tokens[:n - 40])
        assert np.array_equal(q.tokens[:n - 40], d)   # every ask: the whole document first
    assert len({len(d) for d in docs.values()}) > 1
    again = long_context(3, 4, min_tokens=500, max_tokens=900, question_tokens=40, jitter=0.0,
                         seed=2)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(w.requests, again.requests))
    with pytest.raises(WorkloadError, match="max_tokens"):
        long_context(2, 2, min_tokens=100, max_tokens=50)
