"""kvtier's contract suites against this package: the L3 store behaviour every store owes, and
what every backend package promises (discovery with a reason, no vendor import)."""

from __future__ import annotations

import pytest
from kvtier.errors import ConfigError
from kvtier.testing import L3StoreContract, PackageContract
from kvtier.testing.contracts import assert_bitwise_equal
from kvtier.testing.data import make_host_pool, random_specs

from kvtier_example_sqlite.l3_store import SqliteStore

DIST = "kvtier-example-sqlite"


class TestSqliteStore(L3StoreContract):
    distribution = DIST


class TestPackage(PackageContract):
    distribution = DIST
    module = "kvtier_example_sqlite"
    backends = {("l3_store", "example-sqlite")}


# Beyond the contract: what is particular to this store.
def test_path_is_required():
    with pytest.raises(ConfigError, match="path"):
        SqliteStore({}, spec=random_specs()[0])


def test_pages_survive_a_new_instance(tmp_path):
    spec = random_specs()[0]
    cfg = SqliteStore.example_config(str(tmp_path))
    with make_host_pool(spec, 4) as pool:
        want = pool.view[1].clone()
        with SqliteStore(cfg, spec=spec) as s:
            s.attach(pool)
            assert s.batch_set([b"k1"], [1]) == [True]
        with SqliteStore(cfg, spec=spec) as s:
            s.attach(pool)
            assert s.batch_get([b"k1"], [3]) == [True]
        assert_bitwise_equal(pool.view[3], want, "page read back by a new instance")


def test_a_row_of_the_wrong_size_is_a_counted_miss(tmp_path):
    spec = random_specs()[1]
    with make_host_pool(spec, 2) as pool, \
            SqliteStore(SqliteStore.example_config(str(tmp_path)), spec=spec) as s:
        s.attach(pool)
        s.batch_set([b"k"], [0])
        s._execute("update pages set data = ?", (b"short",))
        before = pool.view[1].clone()
        assert s.batch_get([b"k"], [1]) == [False]
        assert s.stats()["corrupted"] == 1
        assert_bitwise_equal(pool.view[1], before, "a corrupted row must not touch the page")
