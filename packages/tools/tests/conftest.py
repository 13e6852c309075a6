"""Shared fixtures of the tools' tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _own_switch_interval():
    """A demo engine's cache sets the process's thread switch interval (the demo's
    ``switch_interval_ms``): each test hands the one it found to the next."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
