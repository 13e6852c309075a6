"""Both formats of the file store in one test module (not a test module itself).

A module imports ``FileStore`` and ``fmt`` from here and defines ``pytest_generate_tests =
formats(OBJECTS_ONLY)``: every test then runs once per format (``segments``, ``objects``),
except those named in ``OBJECTS_ONLY``, which handle the per-object format's files directly
and run on it alone. Child processes (file_store_child.py) get the format in the
environment."""

from __future__ import annotations

import os

import pytest

from kvtier.l3_stores.file import FileStore as _FileStore

from file_store_child import FORMAT_ENV   # the variable the child processes read

FORMATS = ("segments", "objects")
FORMAT = {"name": "segments"}


def formats(objects_only: set[str], both: set[str] | None = None):
    """A ``pytest_generate_tests``: each test over both formats (with ``both``: only those
    named there; the others use the default format once)."""
    def generate(metafunc) -> None:
        if "fmt" in metafunc.fixturenames:
            name = metafunc.function.__name__
            if name in objects_only:
                metafunc.parametrize("fmt", ["objects"], indirect=True)
            elif both is None or name in both:
                metafunc.parametrize("fmt", FORMATS, indirect=True)
    return generate


@pytest.fixture(autouse=True)
def fmt(request):
    """The store format under test (set without monkeypatch: tests call its undo())."""
    FORMAT["name"] = getattr(request, "param", "segments")
    old = os.environ.get(FORMAT_ENV)
    os.environ[FORMAT_ENV] = FORMAT["name"]
    yield FORMAT["name"]
    FORMAT["name"] = "segments"
    if old is None:
        os.environ.pop(FORMAT_ENV, None)
    else:
        os.environ[FORMAT_ENV] = old


class FileStore(_FileStore):
    """The file store in the format under test (unless the config names one)."""

    def __init__(self, config=None, *, spec):
        super().__init__({"format": FORMAT["name"], **(config or {})}, spec=spec)


def flip(path: str, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of ``path`` (damage behind the store's back)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
