"""The L3 store contract's ranged reads (`L3Store.read_groups`, `L3Store.batch_get_layers`),
a part of `L3StoreContract`.

A store whose ``read_groups()`` is empty reads whole pages only: ``batch_get_layers`` is a
typed refusal. A store with groups reads each group into the host page's bytes of those
layers, bitwise, leaving the page's other bytes alone; a miss leaves the page alone; bad
arguments are typed errors before anything is touched; a page read group by group while
another thread overwrites the key is one version written, never a mix. Consecutive groups
read as one range (``through``) are the same bytes, verified as one.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, Callable

import pytest
import torch

from ..cache.stream import read_spans
from ..errors import InvalidArgumentError, PageIndexError
from .data import fill_random


def _keys(n: int, tag: str = "") -> list[bytes]:
    salt = os.urandom(6).hex() + tag
    return [f"g-{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


def _page(pool: Any, page: int) -> torch.Tensor:
    """One host page's bytes in logical order, whatever the pool's layout."""
    return torch.cat(pool.page_segments(page)).clone()


def _byte_range(spec: Any, group: tuple[int, int]) -> tuple[int, int]:
    per_layer = spec.page_bytes // spec.num_layers
    return group[0] * per_layer, group[1] * per_layer


def _groups_or_refusal(store: Any, pool: Any) -> tuple[tuple[int, int], ...]:
    """The store's groups; where it has none (whole pages only), check instead that a ranged
    read is a typed refusal that touches nothing -- all these tests ask of such a store --
    and return none."""
    groups = tuple(store.read_groups())
    if not groups:
        raw = pool.raw.clone()
        with pytest.raises(InvalidArgumentError):
            store.batch_get_layers(_keys(1), [0], 0)
        assert torch.equal(pool.raw, raw), "a refused ranged read touched the pool"
    return groups


class ReadGroupsContract:
    """Ranged reads, for every store (mixed into `L3StoreContract`, whose fixtures these
    tests use)."""

    def test_read_groups_cover_the_layers_in_order(self, store, spec):
        groups = tuple(store.read_groups())
        at = 0
        for lo, hi in groups:
            assert isinstance(lo, int) and isinstance(hi, int), groups
            assert lo == at and hi > lo, f"groups {groups} are not consecutive layer ranges"
            at = hi
        assert not groups or at == spec.num_layers, f"groups {groups} miss layers"

    def test_layer_groups_read_back_bitwise_and_touch_nothing_else(self, store, pool, spec):
        groups = _groups_or_refusal(store, pool)
        if not groups:
            return
        rng = random.Random(7)
        n = 5
        src = rng.sample(range(pool.num_pages), n)
        dst = rng.sample([p for p in range(pool.num_pages) if p not in src], n + 1)
        keys = _keys(n)
        want = [_page(pool, p) for p in src]
        assert store.batch_set(keys, src) == [True] * n
        fill_random(pool.raw)
        before = store.stats()
        for g, group in enumerate(groups):
            a, b = _byte_range(spec, group)
            old = [_page(pool, p) for p in dst]
            missing = _keys(1, "missing")
            got = store.batch_get_layers(keys[:2] + missing + keys[2:], dst, g)
            assert got == [True, True, False] + [True] * (n - 2), f"group {g}: {got}"
            for j, p in enumerate(dst):
                now = _page(pool, p)
                if j == 2:
                    assert torch.equal(now, old[j]), f"group {g}: a miss touched host page {p}"
                    continue
                w = want[j if j < 2 else j - 1]
                assert torch.equal(now[a:b], w[a:b]), f"group {g}: wrong bytes in page {p}"
                assert torch.equal(now[:a], old[j][:a]) and torch.equal(now[b:], old[j][b:]), \
                    f"group {g} {group}: bytes of host page {p} outside the layers changed"
        for j, p in enumerate(dst[:2] + dst[3:]):
            assert torch.equal(_page(pool, p), want[j]), "pages read group by group differ"
        after = store.stats()
        assert after["bytes_read"] - before["bytes_read"] == n * spec.page_bytes

    def test_bad_group_is_a_typed_error_before_anything(self, store, pool) -> None:
        """A group that is not an int (bools, floats, strings, None) or out of range is an
        InvalidArgumentError before any byte of the pool is touched."""
        groups = _groups_or_refusal(store, pool)
        if not groups:
            return
        keys = _keys(2)
        assert store.batch_set(keys, [0, 1]) == [True, True]
        fill_random(pool.raw)
        raw = pool.raw.clone()
        for bad in (True, False, -1, len(groups), 2**63, 1.0, "0", None):
            with pytest.raises(InvalidArgumentError):
                store.batch_get_layers(keys, [2, 3], bad)
            assert torch.equal(pool.raw, raw), f"a ranged read of group {bad!r} touched the pool"

    def test_spans_of_groups_read_back_bitwise_as_one_range(self, store, pool, spec):
        """``through``: groups ``group`` through ``through`` read as one range, into those
        layers' bytes only, counted as their bytes; the doubling spans of a streamed read and
        a random span each give the page back bitwise."""
        groups = _groups_or_refusal(store, pool)
        if len(groups) < 2:
            return
        rng = random.Random(17)
        n = 4
        src = rng.sample(range(pool.num_pages), n)
        dst = rng.sample([p for p in range(pool.num_pages) if p not in src], n)
        keys = _keys(n, "span")
        want = [_page(pool, p) for p in src]
        assert store.batch_set(keys, src) == [True] * n
        g0 = rng.randrange(len(groups) - 1)
        g1 = rng.randrange(g0 + 1, len(groups))
        for spans in (read_spans(len(groups)), [(0, g0 - 1)] * (g0 > 0) + [(g0, g1)]
                      + [(g1 + 1, len(groups) - 1)] * (g1 + 1 < len(groups))):
            fill_random(pool.raw)
            before = store.stats()
            for g, h in spans:
                a, b = _byte_range(spec, (groups[g][0], groups[h][1]))
                old = [_page(pool, p) for p in dst]
                got = store.batch_get_layers(keys, dst, g, through=h)
                assert got == [True] * n, f"span {g}-{h}: {got}"
                for j, p in enumerate(dst):
                    now = _page(pool, p)
                    assert torch.equal(now[a:b], want[j][a:b]), f"span {g}-{h}: wrong bytes"
                    assert torch.equal(now[:a], old[j][:a]) and \
                        torch.equal(now[b:], old[j][b:]), \
                        f"span {g}-{h}: bytes of host page {p} outside its layers changed"
            for j, p in enumerate(dst):
                assert torch.equal(_page(pool, p), want[j]), f"pages read in {spans} differ"
            assert store.stats()["bytes_read"] - before["bytes_read"] == n * spec.page_bytes

    def test_bad_through_is_a_typed_error_before_anything(self, store, pool) -> None:
        """``through`` before ``group``, out of range or not an int: InvalidArgumentError,
        nothing touched."""
        groups = _groups_or_refusal(store, pool)
        if len(groups) < 2:
            return
        keys = _keys(2)
        assert store.batch_set(keys, [0, 1]) == [True, True]
        fill_random(pool.raw)
        raw = pool.raw.clone()
        for group, bad in ((1, 0), (0, len(groups)), (0, -1), (0, True), (0, 1.0), (0, "1")):
            with pytest.raises(InvalidArgumentError):
                store.batch_get_layers(keys, [2, 3], group, through=bad)
            assert torch.equal(pool.raw, raw), f"a ranged read through {bad!r} touched the pool"

    def test_bad_keys_and_pages_of_a_ranged_read_are_typed_errors(self, store, pool) -> None:
        if not _groups_or_refusal(store, pool):
            return
        keys = _keys(2)
        assert store.batch_set(keys, [0, 1]) == [True, True]
        fill_random(pool.raw)
        raw = pool.raw.clone()
        cases: list[tuple[str, Callable[[], Any], tuple[type[Exception], ...]]] = [
                ("page twice", lambda: store.batch_get_layers(keys, [4, 4], 0),
                 (InvalidArgumentError,)),
                ("page out of range", lambda: store.batch_get_layers(keys, [4, pool.num_pages],
                                                                     0), (PageIndexError,)),
                ("lengths", lambda: store.batch_get_layers(keys, [4], 0),
                 (InvalidArgumentError,)),
                ("str key", lambda: store.batch_get_layers(["k", keys[1]], [4, 5], 0),
                 (InvalidArgumentError,))]
        for what, call, types in cases:
            with pytest.raises(types):
                call()
            assert torch.equal(pool.raw, raw), f"{what}: a refused ranged read touched the pool"
        assert store.batch_get_layers([], [], 0) == []

    def test_group_reads_during_overwrite_are_one_version(self, store, pool, spec) -> None:
        """A thread overwrites a key from pages of random bytes while another reads it group
        by group (every other turn: group 0, then the rest as one range) into its own page:
        every range that comes back True holds those bytes of a version written, and a page
        whose every range came back True is one version."""
        groups = _groups_or_refusal(store, pool)
        if not groups:
            return
        versions = [0, 1, 2, 3]
        fill_random(pool.raw)
        want = [_page(pool, p) for p in versions]
        key = _keys(1, "race")[0]
        dst = 10
        assert store.batch_set([key], [versions[0]]) == [True]
        stop = threading.Event()
        errors: list[str] = []
        pages = [0]
        spans = [(0, 0)] + [(1, len(groups) - 1)] * (len(groups) > 1)   # a page in two reads

        def writer() -> None:
            i = 1
            try:
                while not stop.is_set():
                    store.batch_set([key], [versions[i % len(versions)]])
                    i += 1
            except BaseException as exc:        # noqa: BLE001 -- reported below
                errors.append(f"writer: {type(exc).__name__}: {exc}")

        def reader() -> None:
            try:
                end = time.monotonic() + 0.5
                turn = 0
                while time.monotonic() < end and not errors:
                    whole = True
                    turn += 1
                    for g, h in (spans if turn % 2 else [(g, g) for g in range(len(groups))]):
                        a, b = _byte_range(spec, (groups[g][0], groups[h][1]))
                        got_ok = store.batch_get_layers([key], [dst], g) if g == h else \
                            store.batch_get_layers([key], [dst], g, through=h)
                        if got_ok != [True]:
                            whole = False
                            break
                        got = _page(pool, dst)[a:b]
                        if not any(torch.equal(got, w[a:b]) for w in want):
                            errors.append(f"groups {g}-{h} hold bytes of no version written")
                            return
                    if whole:
                        pages[0] += 1
                        if not any(torch.equal(_page(pool, dst), w) for w in want):
                            errors.append("a page read group by group mixes versions")
                            return
            except BaseException as exc:        # noqa: BLE001 -- reported below
                errors.append(f"reader: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=writer, daemon=True),
                   threading.Thread(target=reader, daemon=True)]
        for t in threads:
            t.start()
        threads[1].join(30.0)
        stop.set()
        threads[0].join(30.0)
        assert not any(t.is_alive() for t in threads), "a racing call hung"
        assert not errors, errors[:3]
