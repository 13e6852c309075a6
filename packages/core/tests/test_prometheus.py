"""Prometheus export: families typed and labelled by tier/op/direction, histogram buckets that
agree with kvtier's own counts, the host registry (prometheus_client) and the standalone
exporter on 127.0.0.1 scraped over HTTP from a real controller."""

from __future__ import annotations

import random
import urllib.request

import pytest
import torch

from kvtier import KVSpec
from kvtier.cache import TieredKVCache
from kvtier.device_pool import DeviceKVPool
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.l3_stores.memory import MemoryStore
from kvtier.metrics import Metrics
from kvtier.prometheus import Source, families, register, render, serve
from kvtier.page_allocator import PageAllocator

parser = pytest.importorskip("prometheus_client.parser")


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_gauges_and_text_states_are_typed_and_labelled() -> None:
    m = Metrics()
    m.add_many({"l1_hit_pages": 3, "l3_hit_pages": 5, "bytes_h2d": 4096, "match_calls": 2,
                "store_errors": 1})
    m.gauge("l2_free_pages", lambda: 7)
    m.gauge("l3_state", lambda: "failed")
    fams = {f.name: f for f in families(Source(m, {"rank": "0"}))}
    assert fams["kvtier_hit_pages"].type == "counter"
    assert fams["kvtier_free_pages"].type == "gauge"
    got = _parse(render(Source(m, {"rank": "0"})))
    assert got[("kvtier_hit_pages_total", (("rank", "0"), ("tier", "l1")))] == 3
    assert got[("kvtier_hit_pages_total", (("rank", "0"), ("tier", "l3")))] == 5
    assert got[("kvtier_bytes_total", (("direction", "h2d"), ("rank", "0")))] == 4096
    assert got[("kvtier_calls_total", (("op", "match"), ("rank", "0")))] == 2
    assert got[("kvtier_store_errors_total", (("rank", "0"),))] == 1
    assert got[("kvtier_free_pages", (("rank", "0"), ("tier", "l2")))] == 7
    assert got[("kvtier_state_info", (("rank", "0"), ("state", "failed"), ("tier", "l3")))] == 1


def test_histogram_buckets_are_cumulative_and_match_the_samples() -> None:
    rng = random.Random(3)
    xs = [rng.lognormvariate(-8, 2) for _ in range(3000)]
    m = Metrics()
    for x in xs:
        m.observe("fetch", x)
    got = _parse(render(m))
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in got.items()
                     if k[0] == "kvtier_op_duration_seconds_bucket")
    assert buckets[-1] == (float("inf"), 3000)
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)                       # cumulative
    for le, v in buckets[:-1]:
        assert v == sum(1 for x in xs if x < le)          # exact at every exported bound
    assert got[("kvtier_op_duration_seconds_count", (("op", "fetch"),))] == 3000
    assert got[("kvtier_op_duration_seconds_sum", (("op", "fetch"),))] == pytest.approx(sum(xs))
    assert len(buckets) == 4 * 9 + 1                      # 4 per decade, 1 us .. 1000 s, +Inf


def test_register_into_a_prometheus_client_registry() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    reg = CollectorRegistry()
    m = Metrics()
    m.add("l2_hit_pages", 9)
    collector = register(Source(m, {"setup": "a"}), registry=reg)
    got = _parse(generate_latest(reg).decode())
    assert got[("kvtier_hit_pages_total", (("setup", "a"), ("tier", "l2")))] == 9
    m.add("l2_hit_pages", 1)                              # read at every scrape
    got = _parse(generate_latest(reg).decode())
    assert got[("kvtier_hit_pages_total", (("setup", "a"), ("tier", "l2")))] == 10
    reg.unregister(collector)


def test_standalone_exporter_serves_a_live_cache_on_loopback() -> None:
    spec = KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    dpool = DeviceKVPool.empty(spec, 16)
    for comp in dpool.layers:
        for t in comp:
            t.copy_(torch.randn(t.shape))
    alloc = PageAllocator(16)
    cache = TieredKVCache.from_config(
        {"model_id": "m", "host_pool_pages": 8, "write_policy": "write_through"},
        device_pool=dpool, allocate_device_pages=alloc.alloc, free_device_pages=alloc.free,
        store=MemoryStore(spec=spec))
    tokens = list(range(17))
    with cache, serve(Source(cache.metrics_registry, {"setup": "t"})) as srv:
        assert srv.host == "127.0.0.1" and srv.port > 0
        m = cache.match(tokens)
        cache.commit(tokens, alloc.alloc(4), match=m)
        cache.release(m)
        cache.wait_idle(10)
        m2 = cache.match(tokens)
        cache.release(m2)
        body = urllib.request.urlopen(srv.url, timeout=10).read().decode()
        got = _parse(body)
        snap = cache.metrics()
        assert got[("kvtier_hit_pages_total", (("setup", "t"), ("tier", "l1")))] == \
            snap["l1_hit_pages"] == 4
        assert got[("kvtier_calls_total", (("op", "match"), ("setup", "t")))] == 2
        assert got[("kvtier_capacity_pages", (("setup", "t"), ("tier", "l2")))] == 8
        assert ("kvtier_op_duration_seconds_count", (("op", "match"), ("setup", "t"))) in got
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(srv.url.replace("/metrics", "/nope"), timeout=10)


def test_bad_exporter_arguments_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="port"):
        serve(Metrics(), port=-1)
    with pytest.raises(InvalidArgumentError, match="port"):
        serve(Metrics(), port="9100")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="source"):
        render([42])  # type: ignore[list-item]
    with serve(Metrics()) as a, pytest.raises(InvalidArgumentError, match="cannot listen"):
        serve(Metrics(), port=a.port)


@pytest.mark.parametrize("name", ["tp-rank", "0rank", "rank 0", "", "__rank", "r\u00e4nk", 3,
                                  "tier", "le"])
def test_bad_constant_label_names_are_config_errors_at_construction(name) -> None:
    """A name Prometheus cannot parse (or kvtier's own label) is refused when the Source is
    built: before anything is registered or served."""
    m = Metrics()
    m.add("l1_hit_pages", 1)
    with pytest.raises(ConfigError, match="label name") as exc:
        Source(m, {"setup": "a", name: "0"})
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError):
        Source(m, ["tp_rank"])  # type: ignore[arg-type]


def _nasty(rng: random.Random) -> str:
    alphabet = 'ab\\"\n{},=# \u00e9\u2603'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))


def test_label_values_and_states_of_any_text_render_parseably() -> None:
    """Constant label values and text states with backslashes, quotes, newlines and braces
    come back unchanged through Prometheus's own parser, from render, the exporter and the
    registry; so do a text state whose stem starts with a digit and a stem with a newline."""
    from prometheus_client import CollectorRegistry, generate_latest
    rng = random.Random(11)
    for _ in range(6):
        labels = {"setup": _nasty(rng), "tp_rank": _nasty(rng), "_x9": _nasty(rng)}
        state = _nasty(rng)
        m = Metrics()
        m.add_many({"l1_hit_pages": rng.randint(1, 99), "odd\nname": 2})
        m.gauge("l3_state", lambda state=state: state)
        m.gauge("l3_2pc_state", lambda: "ok")
        m.observe("fetch", 1e-3)
        src = Source(m, labels)
        const = tuple(sorted(labels.items()))
        reg = CollectorRegistry()
        register(src, registry=reg)
        with serve(src) as srv:
            body = urllib.request.urlopen(srv.url, timeout=10).read().decode()
        for text in (render(src), body, generate_latest(reg).decode()):
            got = _parse(text)
            assert got[("kvtier_hit_pages_total",
                        tuple(sorted(const + (("tier", "l1"),))))] == m.get("l1_hit_pages")
            assert got[("kvtier_state_info",
                        tuple(sorted(const + (("state", state), ("tier", "l3")))))] == 1
            assert got[("kvtier_2pc_state_info",
                        tuple(sorted(const + (("_2pc_state", "ok"), ("tier", "l3")))))] == 1
            assert got[("kvtier_op_duration_seconds_count",
                        tuple(sorted(const + (("op", "fetch"),))))] == 1


def test_mirror_counts_deltas_into_prometheus_client_objects() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from kvtier.prometheus import PrometheusMirror
    reg = CollectorRegistry()
    m = Metrics()
    m.add_many({"get_hits": 2, "l3_hit_pages": 1})
    m.gauge("l2_free_pages", lambda: 5)
    mirror = PrometheusMirror(Source(m, {"store": "file"}), registry=reg)
    mirror.sync()
    m.add("get_hits", 3)
    mirror.sync()
    mirror.sync()                                        # no change, no double count
    got = _parse(generate_latest(reg).decode())
    assert got[("kvtier_get_hits_total", (("store", "file"),))] == 5
    assert got[("kvtier_hit_pages_total", (("store", "file"), ("tier", "l3")))] == 1
    assert got[("kvtier_free_pages", (("store", "file"), ("tier", "l2")))] == 5


MULTIPROC_CHILD = r"""
import os, sys
from kvtier.metrics import Metrics
from kvtier.prometheus import PrometheusMirror, Source
m = Metrics()
mirror = PrometheusMirror(Source(m, {"rank": sys.argv[1]}))
m.add("set_pages", int(sys.argv[2]))
mirror.sync()
"""


def test_mirror_works_in_multiprocess_mode(tmp_path) -> None:
    """Two processes write, a third aggregates, as SGLang's and vLLM's /metrics do."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for rank, n in (("0", 4), ("1", 7)):
        subprocess.run([sys.executable, "-c", MULTIPROC_CHILD, rank, str(n)], env=env,
                       check=True, timeout=120)
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    got = _parse(generate_latest(reg).decode())
    assert got[("kvtier_set_pages_total", (("rank", "0"),))] == 4
    assert got[("kvtier_set_pages_total", (("rank", "1"),))] == 7
