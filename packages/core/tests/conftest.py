"""Shared fixtures of kvtier-core's tests."""

import pytest

from mooncake_fixtures import (mooncake_master, mooncake_netns,  # noqa: F401  (fixtures)
                               private_master)


@pytest.fixture(autouse=True)
def _mooncake_master_for_contracts(request):
    """Contract-suite tests parametrised with the ``mooncake`` store need a running master
    (``MooncakeStore.example_config`` points at it)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend_name") == "mooncake":
        request.getfixturevalue("mooncake_master")
