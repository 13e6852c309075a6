"""kvtier_native_keys against kvtier's Python loop and its plain reference chain."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

import kvtier_native_keys as nk
from kvtier import KVSpec, PageKeyer
from kvtier.keys import NATIVE_KEYS_ENV, reference_keys

PAGE_SIZES = (1, 3, 17, 64, 128)


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random token ids, never 0 (a chain over zeros hides byte-order and offset mistakes)."""
    return rng.integers(1, 2**32, size=n, dtype=np.uint64).astype("<u4")


def python_chain(root: bytes, data: bytes, page_bytes: int) -> list[bytes]:
    prev, out = root, []
    for off in range(0, len(data) - len(data) % page_bytes, page_bytes):
        prev = hashlib.sha256(prev + data[off:off + page_bytes]).digest()
        out.append(prev)
    return out


def keyer(page_size: int, model_id: str, hash: str = "sha256") -> PageKeyer:
    spec = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=page_size)
    return PageKeyer(model_id=model_id, spec=spec, hash=hash)


@pytest.fixture
def native_off(monkeypatch):
    monkeypatch.setenv(NATIVE_KEYS_ENV, "0")


def test_supported_hashes():
    assert set(nk.CHAINS) == {"sha256"}
    assert nk.KEY_BYTES == 32 and nk.BACKEND and nk.OPENSSL_VERSION


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(3))
def test_native_equals_python_loop_and_reference(page_size, seed, monkeypatch):
    rng = np.random.default_rng(seed * 1000 + page_size)
    model_id = rng.bytes(12).hex()                       # a random namespace each time
    for name in nk.CHAINS:
        native = keyer(page_size, model_id, name)
        monkeypatch.setenv(NATIVE_KEYS_ENV, "0")
        python = keyer(page_size, model_id, name)
        monkeypatch.delenv(NATIVE_KEYS_ENV)
        assert (native.implementation, python.implementation) == ("native", "python")
        n_pages = int(rng.integers(1, 40))
        tail = int(rng.integers(1, page_size)) if page_size > 1 else 0   # partial last page
        toks = random_tokens(rng, n_pages * page_size + tail)
        got = native.keys(toks)
        assert len(got) == n_pages and all(type(k) is bytes and len(k) == 32 for k in got)
        assert got == python.keys(toks)
        assert got == reference_keys(native.namespace, toks.tolist(), page_size, name)
        # a chain continued with prev is the tail of the whole chain
        cut = int(rng.integers(1, n_pages + 1))
        rest = native.keys(toks[cut * page_size:], prev=got[cut - 1])
        assert rest == got[cut:] == python.keys(toks[cut * page_size:], prev=got[cut - 1])
        assert native.keys(toks[:page_size - 1] if page_size > 1 else []) == []


@pytest.mark.parametrize("page_bytes", [4, 12, 68, 256, 512, 7])
def test_chain_sha256_equals_hashlib_chain(page_bytes):
    rng = np.random.default_rng(page_bytes)
    root = rng.bytes(32)
    data = rng.bytes(page_bytes * 33)
    want = python_chain(root, data, page_bytes)
    assert nk.chain_sha256(root, data, page_bytes) == b"".join(want)
    assert nk.keys_sha256(root, data, page_bytes) == want
    # any C-contiguous buffer
    assert nk.keys_sha256(root, bytearray(data), page_bytes) == want
    assert nk.keys_sha256(root, memoryview(data), page_bytes) == want
    assert nk.keys_sha256(root=root, data=np.frombuffer(data, np.uint8),
                          page_bytes=page_bytes) == want


def test_large_input_releases_the_gil_and_agrees():
    rng = np.random.default_rng(7)
    root, data = rng.bytes(32), rng.bytes(256 * 4096)          # > 64 KiB: GIL released
    want = python_chain(root, data, 256)
    results: list[list[bytes]] = []
    threads = [threading.Thread(target=lambda: results.append(nk.keys_sha256(root, data, 256)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


def test_empty_input():
    root = bytes(range(32))
    assert nk.chain_sha256(root, b"", 256) == b""
    assert nk.keys_sha256(root, b"", 1) == []
    k = keyer(64, "m")
    assert k.implementation == "native" and k.keys([]) == [] and k.keys([5] * 63) == []


@pytest.mark.parametrize("args, exc, match", [
    (("x" * 32, b"abcd", 4), TypeError, "root must be bytes"),
    ((bytearray(32), b"abcd", 4), TypeError, "root must be bytes"),
    ((b"\x01" * 31, b"abcd", 4), ValueError, "32-byte key"),
    ((b"\x01" * 33, b"abcd", 4), ValueError, "32-byte key"),
    ((b"\x01" * 32, b"abcd", 0), ValueError, "page_bytes must be > 0"),
    ((b"\x01" * 32, b"abcd", -4), ValueError, "page_bytes must be > 0"),
    ((b"\x01" * 32, b"abcde", 4), ValueError, "not a multiple of page_bytes"),
    ((b"\x01" * 32, "abcd", 4), TypeError, "bytes-like"),
    ((b"\x01" * 32, [1, 2, 3, 4], 4), TypeError, "bytes-like"),
    ((b"\x01" * 32, np.arange(8, dtype=np.uint32)[::2], 4), TypeError, "C-contiguous"),
    ((b"\x01" * 32, b"abcd", 4.0), TypeError, None),
    ((b"\x01" * 32, b"abcd"), TypeError, None),
])
@pytest.mark.parametrize("fn", [nk.chain_sha256, nk.keys_sha256])
def test_bad_arguments_are_typed_errors(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


def test_env_switch_really_switches(monkeypatch):
    calls = []
    real = nk.CHAINS["sha256"]

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setitem(nk.CHAINS, "sha256", counting)
    toks = random_tokens(np.random.default_rng(3), 64 * 5)
    for off in ("0", "false", "off", " No "):
        monkeypatch.setenv(NATIVE_KEYS_ENV, off)
        k = keyer(64, "m")
        assert k.implementation == "python"
        k.keys(toks)
        assert calls == []
    for on in ("1", "", "yes"):
        monkeypatch.setenv(NATIVE_KEYS_ENV, on)
        k = keyer(64, "m")
        assert k.implementation == "native"
        k.keys(toks)
    assert calls == [256] * 3
    monkeypatch.delenv(NATIVE_KEYS_ENV)
    assert keyer(64, "m").implementation == "native"


@pytest.mark.parametrize("name", ["blake2b", "blake3"])
def test_unsupported_hashes_stay_on_the_python_loop(name):
    if name == "blake3":
        pytest.importorskip("blake3")
    k = keyer(16, "m", name)
    assert k.implementation == "python"
    toks = random_tokens(np.random.default_rng(1), 16 * 9 + 5)
    assert k.keys(toks) == reference_keys(k.namespace, toks.tolist(), 16, name)
