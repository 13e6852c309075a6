"""pytest plugin: the ``hardware`` marker (tests that need an accelerator or vendor runtime)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hardware: needs real vendor hardware/runtime; skips with the probe's reason")
