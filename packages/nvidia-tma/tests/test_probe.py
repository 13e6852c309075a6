"""The package's backends are discovered and report honestly why they can or cannot run."""


from kvtier import registry
from kvtier.testing.imports import vendor_modules_added


def test_backends_discovered_with_reason():
    recs = [r for r in registry.records() if r.distribution == "kvtier-nvidia-tma"]
    assert recs, "the package's entry points are not registered"
    for rec in recs:
        assert rec.error is None, rec.error
        av = registry.probe(rec)
        assert av.ok or av.reason, f"{rec.name}: unavailable without a reason"


def test_import_loads_no_vendor_runtime():
    """Importing the package and discovering its backends adds no vendor module."""
    stmts = "import kvtier, kvtier_nvidia_tma; from kvtier import registry; registry.discover()"
    assert vendor_modules_added(stmts) == []
