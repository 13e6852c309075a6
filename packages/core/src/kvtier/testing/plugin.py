"""pytest plugin (entry point ``pytest11``), loaded into every pytest session of an environment
with kvtier-core: it registers kvtier's markers and imports nothing else (no torch, no kvtier
module), so it costs other projects' test runs nothing."""

#: Markers kvtier's suites use (``--strict-markers`` rejects any other).
MARKERS = {
    "hardware": "needs real vendor hardware/runtime; skips with the probe's reason",
}


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
