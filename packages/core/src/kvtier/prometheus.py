"""Prometheus export of kvtier's metrics: typed families labelled by tier, operation and
direction, for the host process's registry or a standalone exporter on 127.0.0.1.

kvtier's controller keeps its numbers in a `kvtier.metrics.Metrics` (counters, gauges read at
scrape time, latency histograms). This module turns one or more of them into metric families:

* counters -> ``kvtier_<what>_total`` (``l1_hit_pages`` -> ``kvtier_hit_pages_total{tier="l1"}``,
  ``bytes_h2d`` -> ``kvtier_bytes_total{direction="h2d"}``, ``match_calls`` ->
  ``kvtier_calls_total{op="match"}``);
* numeric gauges -> ``kvtier_<what>`` (``l2_free_pages`` -> ``kvtier_free_pages{tier="l2"}``);
  text gauges (``l3_state``) -> ``kvtier_<what>_info{<what>="ok"} 1``;
* latency histograms -> ``kvtier_op_duration_seconds{op=...}`` with cumulative buckets (four
  per decade from 1 us to 1000 s: exact, since they are bounds of kvtier's own histograms).

Every source may carry constant labels (``{"setup": "l1+l2", "tp_rank": "0"}``) so several
caches or ranks aggregate. Their names are checked when the `Source` is built (Prometheus's
``[a-zA-Z_][a-zA-Z0-9_]*``, not ``__``-prefixed, none of kvtier's own ``tier``/``direction``/
``op``/``le``): one bad name would make the whole scrape unparseable, and a Prometheus server
drops every sample of it. Values may be any text; they are escaped. Ways out:

* `register(sources, registry=None)`: a collector in ``prometheus_client``'s registry (the
  default one, which vLLM's and SGLang's ``/metrics`` already serve; needs the optional
  ``prometheus`` extra);
* `serve(sources, port=0, host="127.0.0.1")`: kvtier's own exporter thread (no dependency),
  serving ``GET /metrics`` in the text format; it binds to loopback unless told otherwise;
* `PrometheusMirror`: ``prometheus_client`` Counter/Gauge objects kept in step with a source
  (counters by delta, gauges set) on every ``sync()``. Unlike a collector they work in
  ``prometheus_client``'s multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), which is how
  SGLang and vLLM gather the metrics of their scheduler and worker processes into one
  ``/metrics``. Histograms are not mirrored (their observations are not replayable).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from .errors import ConfigError, InvalidArgumentError
from .metrics import Metrics

__all__ = ["Source", "Family", "families", "render", "register", "serve", "MetricsServer",
           "PrometheusMirror"]

PREFIX = "kvtier"
#: Every fifth bound of `kvtier.metrics.LatencyHistogram` (20 per decade): 4 per decade.
BUCKET_STEP = 5

_TIER = re.compile(r"^(l1|l2|l3)_(.+)$")
_BYTES = re.compile(r"^bytes_(.+)$")
_CALLS = re.compile(r"^(.+)_calls$")
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: Label names kvtier's families set themselves; a constant label may not take them.
RESERVED_LABELS = frozenset({"tier", "direction", "op", "le"})


def check_label_name(name: object) -> str:
    """``name`` if it is a label name Prometheus accepts and kvtier does not use itself, else
    a one-line `ConfigError`."""
    if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
        raise ConfigError(f"prometheus label name {name!r} is invalid: it must match "
                          f"[a-zA-Z_][a-zA-Z0-9_]* (e.g. 'tp_rank', not 'tp-rank')",
                          key="labels", value=name)
    if name.startswith("__"):
        raise ConfigError(f"prometheus label name {name!r} is invalid: names starting with "
                          f"'__' are reserved by Prometheus", key="labels", value=name)
    if name in RESERVED_LABELS:
        raise ConfigError(f"prometheus label name {name!r} is kvtier's own (one of "
                          f"{sorted(RESERVED_LABELS)}): pick another name",
                          key="labels", value=name)
    return name


@dataclass(frozen=True)
class Source:
    """One `Metrics` (or a callable returning one, for caches that come and go) and the
    constant labels its samples carry."""

    metrics: Union[Metrics, Callable[[], "Metrics | None"]]
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.labels, Mapping):
            raise ConfigError(f"prometheus labels must be a mapping of name to value, got "
                              f"{type(self.labels).__name__}", key="labels")
        for name in self.labels:
            check_label_name(name)

    def get(self) -> Metrics | None:
        m = self.metrics
        return m if isinstance(m, Metrics) else m()


@dataclass
class Family:
    """One metric family: ``samples`` are (name suffix, labels, value)."""

    name: str
    type: str                       # "counter" | "gauge" | "histogram"
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _split(name: str) -> tuple[str, dict[str, str]]:
    """A kvtier metric name -> (family stem, labels)."""
    m = _TIER.match(name)
    if m:
        return m.group(2), {"tier": m.group(1)}
    m = _BYTES.match(name)
    if m:
        return "bytes", {"direction": m.group(1)}
    m = _CALLS.match(name)
    if m:
        return "calls", {"op": m.group(1)}
    return name, {}


def _clean(stem: str) -> str:
    return _NAME_OK.sub("_", stem)


def _label_key(stem: str) -> str:
    """A metric stem as a label name (a text gauge's value label): valid whatever the stem."""
    key = _clean(stem).lstrip("_") or "value"
    return "_" + key if key[0].isdigit() else key


def _as_sources(sources: Any) -> list[Source]:
    if isinstance(sources, (Metrics, Source)) or callable(sources):
        sources = [sources]
    out = []
    for s in sources:
        if isinstance(s, Source):
            out.append(s)
        elif isinstance(s, Metrics) or callable(s):
            out.append(Source(s))
        else:
            raise InvalidArgumentError(f"a metrics source must be a kvtier Metrics, a Source or "
                                       f"a callable returning one, got {type(s).__name__}",
                                       argument="sources")
    return out


def families(sources: Metrics | Source | Iterable[Metrics | Source]) -> list[Family]:
    """Read every source now and group its numbers into typed, labelled families."""
    fams: dict[str, Family] = {}

    def fam(name: str, typ: str, help_: str) -> Family:
        f = fams.get(name)
        if f is None:
            f = fams[name] = Family(name, typ, help_)
        return f

    for src in _as_sources(sources):
        metrics = src.get()
        if metrics is None:
            continue
        const = {str(k): str(v) for k, v in src.labels.items()}
        counters, gauges, hists = metrics.export()
        for name, value in sorted(counters.items()):
            stem, labels = _split(name)
            f = fam(f"{PREFIX}_{_clean(stem)}", "counter", f"kvtier counter {stem}")
            f.samples.append(("_total", {**const, **labels}, float(value)))
        for name, value in sorted(gauges.items()):
            stem, labels = _split(name)
            if isinstance(value, bool) or isinstance(value, (int, float)):
                f = fam(f"{PREFIX}_{_clean(stem)}", "gauge", f"kvtier gauge {stem}")
                f.samples.append(("", {**const, **labels}, float(value)))
            else:                              # a state as text: one info-style sample
                f = fam(f"{PREFIX}_{_clean(stem)}_info", "gauge",
                        f"kvtier state {stem} (value label)")
                f.samples.append(("", {**const, **labels, _label_key(stem): str(value)}, 1.0))
        for name, (bounds, counts, total, count) in sorted(hists.items()):
            f = fam(f"{PREFIX}_op_duration_seconds", "histogram",
                    "duration of kvtier operations")
            labels = {**const, "op": name}
            cum = counts[0]               # below the lowest bound
            for i, c in enumerate(counts[1:len(bounds)], start=1):
                cum += c
                if i % BUCKET_STEP == 0:
                    f.samples.append(("_bucket", {**labels, "le": _fmt(bounds[i])}, float(cum)))
            f.samples.append(("_bucket", {**labels, "le": "+Inf"}, float(count)))
            f.samples.append(("_sum", labels, float(total)))
            f.samples.append(("_count", labels, float(count)))
    return list(fams.values())


def _fmt(x: float) -> str:
    x = float(x)
    if x != x:
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def _escape(v: str) -> str:
    """A label value in the text format: backslash, double quote and newline escaped."""
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    """HELP text: backslash and newline escaped (a quote is literal there)."""
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def render(sources: Metrics | Source | Iterable[Metrics | Source]) -> str:
    """The Prometheus text exposition format (0.0.4) of ``families(sources)``."""
    lines: list[str] = []
    for f in families(sources):
        lines.append(f"# HELP {f.name} {_escape_help(f.help)}")
        lines.append(f"# TYPE {f.name} {f.type}")
        for suffix, labels, value in f.samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{f.name}{suffix}{{{lab}}} {_fmt(value)}" if lab
                         else f"{f.name}{suffix} {_fmt(value)}")
    return "\n".join(lines) + "\n"


class _Collector:
    """A ``prometheus_client`` collector over kvtier sources (read at every scrape)."""

    def __init__(self, sources: list[Source]):
        self._sources = sources

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import Metric
        for f in families(self._sources):
            m = Metric(f.name, f.help, f.type)
            for suffix, labels, value in f.samples:
                m.add_sample(f.name + suffix, labels, value)
            yield m

    def describe(self) -> list[Any]:     # no up-front description: names depend on the data
        return []


def register(sources: Metrics | Source | Sequence[Metrics | Source], registry: Any = None
             ) -> Any:
    """Register kvtier's metrics into a ``prometheus_client`` registry (the default one, which
    the host engine's ``/metrics`` serves, unless ``registry`` is given). Returns the collector
    (``registry.unregister(it)`` removes it)."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise InvalidArgumentError("prometheus_client is not installed: pip install "
                                   "'kvtier-core[prometheus]' (or use kvtier.prometheus.serve, "
                                   "which needs nothing)", argument="registry") from exc
    collector = _Collector(_as_sources(sources))
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector


class MetricsServer:
    """kvtier's standalone exporter: ``GET /metrics`` on a daemon thread. Close it (or use it
    as a context manager); ``url`` says where it listens."""

    def __init__(self, sources: list[Source], host: str, port: int):
        srcs = sources

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    body = render(srcs).encode()
                except Exception as exc:  # a broken gauge must not kill the exporter
                    self.send_error(500, f"{type(exc).__name__}: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        addr = self._httpd.server_address
        self.host, self.port = str(addr[0]), int(addr[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvtier-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(sources: Metrics | Source | Sequence[Metrics | Source], port: int = 0,
          host: str = "127.0.0.1") -> MetricsServer:
    """Start kvtier's own exporter (port 0: any free port; see ``.url``). It binds to
    ``127.0.0.1`` unless another address is given on purpose."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"metrics port must be an int in [0, 65535], got {port!r}",
                                   argument="port", value=port)
    try:
        return MetricsServer(_as_sources(sources), host, port)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot listen on {host}:{port} for metrics: {exc}",
                                   argument="port", value=port) from exc


_MIRRORED: dict[tuple[int, str], Any] = {}
_MIRROR_LOCK = threading.Lock()


class PrometheusMirror:
    """Mirror one kvtier source into ``prometheus_client`` metric objects (see the module
    doc). ``sync()`` is cheap (a dict walk) and thread-safe; call it after updates or on a
    timer. Needs the optional ``prometheus`` extra."""

    def __init__(self, source: Metrics | Source, registry: Any = None):
        try:
            import prometheus_client
        except ImportError as exc:
            raise InvalidArgumentError("prometheus_client is not installed: pip install "
                                       "'kvtier-core[prometheus]'", argument="registry") from exc
        self._pc = prometheus_client
        self._source = _as_sources(source)[0]
        self._registry = registry if registry is not None else prometheus_client.REGISTRY
        self._last: dict[tuple[str, tuple], float] = {}
        self._lock = threading.Lock()

    def _metric(self, kind: str, name: str, help_: str, labelnames: tuple[str, ...]) -> Any:
        key = (id(self._registry), name)
        with _MIRROR_LOCK:
            m = _MIRRORED.get(key)
            if m is None:
                if kind == "counter":
                    m = self._pc.Counter(name, help_, labelnames, registry=self._registry)
                else:
                    m = self._pc.Gauge(name, help_, labelnames, registry=self._registry,
                                       multiprocess_mode="livesum")
                _MIRRORED[key] = m
            return m

    def sync(self) -> None:
        with self._lock:
            for fam in families(self._source):
                if fam.type == "histogram":
                    continue
                for _suffix, labels, value in fam.samples:
                    names = tuple(sorted(labels))
                    metric = self._metric(fam.type, fam.name, fam.help, names)
                    if tuple(sorted(metric._labelnames)) != names:
                        continue            # a family seen with other labels: not mirrored
                    child = metric.labels(**labels) if names else metric
                    if fam.type == "counter":
                        k = (fam.name, tuple(sorted(labels.items())))
                        delta = value - self._last.get(k, 0.0)
                        if delta > 0:
                            child.inc(delta)
                        self._last[k] = value
                    else:
                        child.set(value)
