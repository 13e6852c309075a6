"""Policies on their own: write flags, prefetch budgets, leaf-first LRU selection."""

from __future__ import annotations

import math

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import (PREFETCH_POLICIES, WRITE_POLICIES, LRUOrder, make_prefetch_policy,
                             make_write_policy)


def test_write_policies():
    wt = make_write_policy("write_through")
    assert wt.backup_on_commit(0) and wt.l3_on_backup and not wt.demote_on_l1_evict
    sel = make_write_policy("write_through_selective", selective_threshold=3)
    assert [sel.backup_on_commit(h) for h in (0, 2, 3, 9)] == [False, False, True, True]
    assert [sel.backup_on_hit(h) for h in (1, 2, 3)] == [False, False, True]
    assert sel.l3_on_backup
    wb = make_write_policy("write_back")
    assert not wb.backup_on_commit(99) and not wb.backup_on_hit(99)
    assert wb.demote_on_l1_evict and wb.l3_on_l2_evict and not wb.l3_on_backup
    assert set(WRITE_POLICIES) == {"write_through", "write_through_selective", "write_back"}
    with pytest.raises(ConfigError):
        make_write_policy("write_around")
    with pytest.raises(ConfigError):
        make_write_policy("write_through_selective", selective_threshold=0)


def test_prefetch_budgets():
    assert make_prefetch_policy("best_effort").wait_budget_s(10**6) == 0.0
    assert math.isinf(make_prefetch_policy("wait_complete").wait_budget_s(1))
    t = make_prefetch_policy("timeout", base_s=0.1, per_1k_tokens_s=0.02, cap_s=0.5)
    assert t.wait_budget_s(0) == pytest.approx(0.1)
    assert t.wait_budget_s(2048) == pytest.approx(0.14)
    assert t.wait_budget_s(10**7) == pytest.approx(0.5)          # capped
    p = make_prefetch_policy("best_effort", min_tokens=256)
    assert not p.consult_l3(255) and p.consult_l3(256) and not p.consult_l3(0)
    assert make_prefetch_policy("wait_complete").consult_l3(1)
    assert set(PREFETCH_POLICIES) == {"best_effort", "wait_complete", "timeout"}
    with pytest.raises(ConfigError):
        make_prefetch_policy("eager")
    with pytest.raises(ConfigError):
        make_prefetch_policy("timeout", base_s=-1)
    with pytest.raises(ConfigError):
        make_prefetch_policy("best_effort", min_tokens=-5)


class Item:
    def __init__(self, key, parent=None):
        self.key, self.parent, self.kids, self.pinned = key, parent, 0, False
        if parent is not None:
            parent.kids += 1


def select(order, n, leaves=True):
    return [i.key for i in order.select(
        n, evictable=lambda i: not i.pinned, blockers=lambda i: i.kids,
        parent=lambda i: i.parent.key if i.parent else None, leaves=lambda i: leaves)]


def chain(order, keys, parent=None):
    items = []
    for k in keys:
        parent = Item(k, parent)
        items.append(parent)
    for it in reversed(items):            # leaf first: prefixes newer than extensions
        order.touch(it.key, it)
    return items


def test_lru_takes_oldest_leaves_then_their_parents():
    o = LRUOrder()
    a = chain(o, ["a0", "a1", "a2"])
    chain(o, ["b1", "b2"], parent=a[0])
    assert select(o, 1) == ["a2"]                     # a's branch is older
    assert select(o, 3) == ["a2", "a1", "b2"]
    assert select(o, 10) == ["a2", "a1", "b2", "b1", "a0"]


def test_lru_never_selects_pinned_or_their_ancestors():
    o = LRUOrder()
    a = chain(o, ["a0", "a1", "a2"])
    a[2].pinned = True
    assert select(o, 10) == []                        # a1, a0 still have a child
    a[2].pinned = False
    a[1].pinned = True
    assert select(o, 10) == ["a2"]


def test_lru_copes_with_a_parent_older_than_its_child():
    o = LRUOrder()
    items = chain(o, ["x0", "x1"])
    child = Item("x2", items[1])
    o.touch("x2", child)                              # touched after its parent
    assert select(o, 3) == ["x2", "x1", "x0"]         # a second pass picks the parents
    o.touch("x1", items[1])
    assert "x1" in o and len(o) == 3
    o.discard("x1")
    assert "x1" not in o and list(o) == ["x0", "x2"]


def test_lru_items_that_stay_do_not_free_their_parent():
    o = LRUOrder()
    chain(o, ["y0", "y1"])
    assert select(o, 5, leaves=False) == ["y1"]       # y1 stays in the index: y0 not a leaf
    assert select(o, 0) == []
