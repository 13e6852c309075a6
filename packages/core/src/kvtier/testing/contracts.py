"""The contract suites: one behaviour, every backend.

Subclass a suite in a package's tests and set ``distribution`` (or leave it None for every
discovered backend). Backends get their config from ``example_config(workdir)``; override
``make_config`` in the subclass to test other settings.

Every suite also tries the hostile inputs that apply to every backend of its kind (keys that
are not bytes and odd byte keys, hostile page indices and sizes, mismatched lengths, calls
after ``close()``, a read racing an overwrite): each ends in exact bytes, a miss or a typed
kvtier error, bounded in time, never an untyped exception, a hang or a file outside the
store's directory. docs/reliability.md lists them with what each backend did.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from typing import Any, Callable

import pytest
import torch

from .. import registry
from ..errors import (InvalidArgumentError, KVTierError, LayoutError, PageIndexError)
from ..interfaces import (GROUPS, HOST_ALLOCATORS, INTERFACE_VERSION, L3_STORES,
                          TRANSFER_ENGINES, Availability, HostBuffer)
from ..spec import KVSpec
from .data import fill_random, make_device_pool, make_host_pool, random_specs, spec_id
from .read_groups import ReadGroupsContract


def backend_params(group: str, distribution: str | None = None) -> list[Any]:
    """``pytest.param`` per discovered backend of ``group``; unavailable ones are skipped
    with the registry's reason."""
    params = []
    for rec in registry.records(group):
        if distribution is not None and rec.distribution != distribution:
            continue
        av = registry.probe(rec)
        marks = [] if av.ok else [pytest.mark.skip(reason=f"{rec.name}: {av.reason}"
                                                   + (f" ({av.hint})" if av.hint else ""))]
        params.append(pytest.param(rec.name, id=rec.name, marks=marks))
    if not params:
        params.append(pytest.param(None, id="none", marks=pytest.mark.skip(
            reason=f"no backend of {group} from {distribution or 'any distribution'}")))
    return params


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor on the CPU, for bitwise comparison (-0.0 != 0.0 here)."""
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    ra, rb = raw_bytes(a), raw_bytes(b)
    assert ra.shape == rb.shape, f"{what}: {tuple(a.shape)} vs {tuple(b.shape)}"
    if not torch.equal(ra, rb):
        bad = int((ra != rb).nonzero()[0])
        raise AssertionError(f"{what}: tensors differ (first differing byte {bad} of "
                             f"{ra.numel()})")


def bounded_call(fn: Callable[[], Any], timeout: float = 20.0, what: str = "call") -> Any:
    """Run ``fn`` on a daemon thread and return its value (or raise its exception); fail, never
    hang, when it has not returned within ``timeout`` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:        # noqa: BLE001 -- re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="kvtier-bounded-call")
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{what} blocked for more than {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def assert_typed_refusal(fn: Callable[[], Any], types: tuple[type[BaseException], ...],
                         what: str, timeout: float = 20.0) -> BaseException:
    """``fn`` must raise one of ``types`` (kvtier's typed errors) within ``timeout``: returning,
    or raising anything else (an untyped TypeError, OverflowError, RuntimeError...), fails."""
    try:
        got = bounded_call(fn, timeout, what)
    except types as exc:
        return exc
    except AssertionError:
        raise
    except BaseException as exc:            # noqa: BLE001 -- reported as the finding
        raise AssertionError(f"{what}: untyped {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{what}: accepted (returned {got!r}), want "
                         f"{' or '.join(t.__name__ for t in types)}")


def files_outside(root: str, inside: str) -> list[str]:
    """Every entry under ``root`` whose real path is neither under ``inside`` nor one of its
    ancestors: what a store rooted in ``inside`` made, or linked to, outside it."""
    inside = os.path.join(os.path.realpath(inside), "")
    out = []
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            real = os.path.join(os.path.realpath(p), "")
            if not real.startswith(inside) and not inside.startswith(real):
                out.append(p)
    return out


class _Suite:
    """What every suite shares: which backends run, and the hook for fake-backed runs.

    By default the parameters are the discovered backends of ``group`` from
    ``distribution``, probed at collection time (unavailable ones are skipped with the
    probe's reason). A suite over FAKE vendor modules cannot probe then (the fakes are put in
    place per test), so it lists its backends in ``fake_backends`` and overrides the
    ``backend_environment`` fixture to install the fakes (and refresh the registry) for each
    test::

        class TestOnFakes(L3StoreContract):
            distribution = "kvtier-my-vendor"
            fake_backends = ("my-store",)

            @pytest.fixture(autouse=True)
            def backend_environment(self, my_fake_runtime):   # a fixture of the package
                yield my_fake_runtime
    """

    group: str = ""
    distribution: str | None = None
    #: Backends to run without a collection-time probe (suites over fakes); None: discover.
    fake_backends: tuple[str, ...] | None = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "backend_name" in metafunc.fixturenames:
            if self.fake_backends is not None:
                params = [pytest.param(n, id=f"{n}-on-fakes") for n in self.fake_backends]
            else:
                params = backend_params(self.group, self.distribution)
            metafunc.parametrize("backend_name", params)

    @pytest.fixture(autouse=True)
    def backend_environment(self):
        """Hook: override (autouse, same name) to put fakes of vendor modules in place for
        each test; the default does nothing."""
        yield None

    def backend_class(self, backend_name: str) -> type[Any]:
        return registry.get_backend_class(self.group, backend_name)

    def make_config(self, backend_name: str, workdir: str) -> dict[str, Any]:
        return self.backend_class(backend_name).example_config(workdir)


# --------------------------------------------------------------------------------------------
class HostAllocatorContract(_Suite):
    group = HOST_ALLOCATORS

    @pytest.fixture
    def allocator(self, backend_name, tmp_path):
        cls = self.backend_class(backend_name)
        return cls(self.make_config(backend_name, str(tmp_path)))

    @pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * 1024 * 1024 + 17])
    def test_allocate_write_read(self, allocator, nbytes):
        buf = allocator.allocate(nbytes)
        try:
            assert isinstance(buf, HostBuffer)
            assert buf.nbytes >= nbytes
            assert buf.tensor.dtype == torch.uint8 and buf.tensor.numel() >= nbytes
            assert buf.ptr == buf.tensor.data_ptr()
            assert isinstance(buf.backing, str) and buf.backing
            data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            buf.tensor[:nbytes].copy_(data)
            assert torch.equal(buf.tensor[:nbytes], data)
        finally:
            buf.close()
        assert buf.closed
        buf.close()  # idempotent

    def test_buffers_are_independent(self, allocator):
        a, b = allocator.allocate(8192 + 3), allocator.allocate(8192 + 3)
        try:
            a.tensor.fill_(0x5A)
            b.tensor.fill_(0xA5)
            assert int(a.tensor.min()) == 0x5A and int(b.tensor.max()) == 0xA5
        finally:
            a.close()
            b.close()

    @pytest.mark.parametrize("nbytes", [0, -1, 1.5, "8", True, False, None, float("nan"),
                                        float("inf"), -(2**63), b"8"])
    def test_bad_size_is_typed_error(self, allocator, nbytes):
        assert_typed_refusal(lambda: allocator.allocate(nbytes), (InvalidArgumentError,),
                             f"allocate({nbytes!r})")

    @pytest.mark.parametrize("nbytes", [1 << 62, (1 << 63) - 1, 1 << 64],
                             ids=["2**62", "2**63-1", "2**64"])
    def test_size_no_machine_holds_is_typed_error(self, allocator, nbytes):
        """Past any address space: a kvtier error (InvalidArgumentError, AllocationError),
        never a MemoryError, OverflowError or RuntimeError of the runtime, never a hang."""
        from ..errors import AllocationError
        assert_typed_refusal(lambda: allocator.allocate(nbytes),
                             (InvalidArgumentError, AllocationError), f"allocate({nbytes})")
        buf = allocator.allocate(4096)              # the allocator still works
        try:
            data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
            buf.tensor[:4096].copy_(data)
            assert torch.equal(buf.tensor[:4096], data)
        finally:
            buf.close()

    def test_backs_a_host_pool(self, backend_name, allocator):
        spec = random_specs()[0]
        from ..host_pool import HostKVPool
        pool = HostKVPool(spec, 7, allocator=allocator)
        try:
            fill_random(pool.raw)
            page = pool.page_bytes_view(3).clone()
            assert torch.equal(pool.page_bytes_view(3), page)
        finally:
            pool.close()


# --------------------------------------------------------------------------------------------
class L3StoreContract(ReadGroupsContract, _Suite):
    group = L3_STORES
    num_pages = 23

    @pytest.fixture(params=random_specs()[:3], ids=spec_id)
    def spec(self, request) -> KVSpec:
        return request.param

    @pytest.fixture(params=["page_first", "layer_first"])
    def layout(self, request) -> str:
        return request.param

    @pytest.fixture
    def pool(self, spec, layout):
        p = make_host_pool(spec, self.num_pages, layout)
        yield p
        p.close()

    @pytest.fixture
    def store(self, backend_name, spec, pool, tmp_path):
        cls = self.backend_class(backend_name)
        if pool.layout not in cls.capabilities().host_layouts:
            pytest.skip(f"{backend_name} does not support host layout {pool.layout} "
                        "(declared in capabilities().host_layouts)")
        s = cls(self.make_config(backend_name, str(tmp_path)), spec=spec)
        s.attach(pool)
        s.clear()
        yield s
        try:
            s.clear()
        finally:
            s.close()

    @staticmethod
    def keys(n: int, tag: str = "") -> list[bytes]:
        salt = os.urandom(6).hex() + tag
        return [f"k-{salt}-{i}".encode().ljust(32, b".") for i in range(n)]

    def snapshot(self, pool, pages):
        return [pool.view[p].clone() for p in pages]

    def test_set_get_roundtrip_bitwise(self, store, pool):
        rng = random.Random(1)
        src = rng.sample(range(pool.num_pages), 9)
        dst = rng.sample([p for p in range(pool.num_pages) if p not in src], 9)
        keys = self.keys(9)
        want = self.snapshot(pool, src)
        assert store.batch_set(keys, src) == [True] * 9
        fill_random(pool.raw)                      # poison everything, sources included
        got = store.batch_get(keys, dst)
        assert got == [True] * 9
        for i, p in enumerate(dst):
            assert_bitwise_equal(pool.view[p], want[i], f"page {i} read into host page {p}")

    def test_get_into_the_same_host_page_twice_is_refused(self, store, pool):
        """Two keys read into one host page would leave it holding one of them while both
        report a hit: a typed error before anything is touched."""
        from ..errors import InvalidArgumentError
        keys = self.keys(3)
        assert store.batch_set(keys, [0, 1, 2]) == [True] * 3
        before = self.snapshot(pool, [4, 5])
        with pytest.raises(InvalidArgumentError):
            store.batch_get(keys[:2], [4, 4])
        with pytest.raises(InvalidArgumentError):
            store.batch_get(keys, [5, 4, 5])
        for p, want in zip((4, 5), before):
            assert_bitwise_equal(pool.view[p], want, f"host page {p} was touched")

    def test_exists_counts_leading_hits(self, store, pool):
        keys = self.keys(6)
        assert store.batch_exists(keys) == 0
        store.batch_set(keys[:4], [0, 1, 2, 3])
        assert store.batch_exists(keys) == 4
        assert store.batch_exists(keys[:2]) == 2
        assert store.batch_exists([keys[5]] + keys[:4]) == 0
        store.delete([keys[1]])
        assert store.batch_exists(keys) == 1
        assert store.batch_exists([]) == 0

    def test_missing_keys_are_misses_and_leave_pages_alone(self, store, pool):
        keys = self.keys(3)
        store.batch_set(keys[:1], [5])
        before = pool.view[7].clone()
        got = store.batch_get([keys[1], keys[0]], [7, 8])
        assert got == [False, True]
        assert_bitwise_equal(pool.view[7], before, "a miss must not touch the page")

    def test_overwrite_and_delete_and_clear(self, store, pool):
        keys = self.keys(3)
        assert store.batch_set(keys, [1, 2, 3]) == [True] * 3
        want = pool.view[4].clone()
        assert store.batch_set(keys[:1], [4]) == [True]   # same key, new content
        fill_random(pool.raw)
        assert store.batch_get(keys[:1], [9]) == [True]
        assert_bitwise_equal(pool.view[9], want, "overwritten key")
        assert store.delete(keys[1:2] + [b"never-set"]) == 1
        assert store.batch_get(keys[1:2], [9]) == [False]
        store.clear()
        assert store.batch_exists(keys) == 0

    def test_stats_count_io(self, store, pool, spec):
        keys = self.keys(2)
        before = store.stats()
        store.batch_set(keys, [0, 1])
        store.batch_get(keys + self.keys(1), [2, 3, 4])
        after = store.stats()
        assert after["sets"] - before["sets"] == 2
        assert after["gets"] - before["gets"] == 3
        assert after["get_hits"] - before["get_hits"] == 2
        assert after["bytes_read"] - before["bytes_read"] == 2 * spec.page_bytes

    def test_bad_arguments_are_typed_errors(self, store, pool):
        keys = self.keys(2)
        with pytest.raises(InvalidArgumentError):
            store.batch_set(keys, [0])                     # length mismatch
        with pytest.raises(PageIndexError):
            store.batch_set(keys, [0, pool.num_pages])     # out of range
        with pytest.raises(PageIndexError):
            store.batch_get(keys, [-1, 0])
        with pytest.raises(InvalidArgumentError):
            store.batch_set(["str-key", keys[1]], [0, 1])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError):
            store.batch_exists(b"not-a-list")              # type: ignore[arg-type]
        assert store.batch_exists(keys) == 0, "a rejected call must not store anything"

    def test_unattached_store_refuses_io(self, backend_name, spec, tmp_path):
        cls = self.backend_class(backend_name)
        s = cls(self.make_config(backend_name, str(tmp_path / "unattached")), spec=spec)
        try:
            with pytest.raises(KVTierError):
                s.batch_get(self.keys(1), [0])
        finally:
            s.close()

    def test_foreign_pool_is_refused(self, store):
        other = KVSpec.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2,
                           dtype="float32")
        p = make_host_pool(other, 2)
        try:
            with pytest.raises(KVTierError):
                store.attach(p)
        finally:
            p.close()

    # ----- hostile inputs: what every store gets, whatever it stores in -------------------------
    TRAVERSAL_DEPTH = 8

    @pytest.fixture
    def lone(self, backend_name, tmp_path):
        """``(store, pool, workdir)``: one store over one small pool of random bytes (the first
        host layout the backend declares; these cases are about the calls, not the geometry),
        its config rooted in a directory of its own ``TRAVERSAL_DEPTH`` levels below
        ``tmp_path``, so that anything it writes outside that directory shows (a key climbing
        that many levels from anywhere in it still lands inside ``tmp_path``)."""
        spec = random_specs()[0]
        cls = self.backend_class(backend_name)
        pool = make_host_pool(spec, 2 * len(self.ODD_KEYS) + 2,
                              cls.capabilities().host_layouts[0])
        workdir = tmp_path.joinpath(*[f"d{i}" for i in range(self.TRAVERSAL_DEPTH)], "work")
        workdir.mkdir(parents=True)
        s = None
        try:
            s = cls(self.make_config(backend_name, str(workdir)), spec=spec)
            s.attach(pool)
            s.clear()
            yield s, pool, str(workdir)
        finally:
            try:
                if s is not None:
                    try:
                        s.clear()
                    except KVTierError:
                        pass                        # closed by the test
                    s.close()
            finally:
                pool.close()

    @staticmethod
    def page_bytes(pool, page: int) -> torch.Tensor:
        """One host page's bytes in logical order, whatever the pool's layout."""
        return torch.cat(pool.page_segments(page)).clone()

    def odd_keys(self, tmp_path) -> dict[str, bytes]:
        """Byte keys a store must round-trip bitwise or refuse with a typed error; the ones
        that would name a path resolve (if joined to a directory naively) into ``tmp_path``."""
        big = os.urandom(4096)
        one = os.urandom(1)
        while one in (b"\x00", b".", b"/"):    # another key below: keys must be distinct
            one = os.urandom(1)
        keys = {
            "32-random": os.urandom(32),
            "empty": b"",
            "1-byte": one,
            "4096-bytes": big,
            "4096-bytes-last-differs": big[:-1] + bytes([big[-1] ^ 0xFF]),
            "slash": b"kv/" + os.urandom(8).hex().encode(),
            "only-slashes": b"/" * 40,
            "dotdot": b"..",
            "dot": b".",
            "traversal": b"../" * self.TRAVERSAL_DEPTH + b"escaped-" + os.urandom(4).hex().encode(),
            "absolute": os.fsencode(tmp_path / f"absolute-{os.urandom(4).hex()}"),
            "backslashes": b"..\\..\\..\\escaped",
            "nul": b"\x00",
            "nul-nul": b"\x00\x00",
            "nul-inside": b"k\x00" + os.urandom(8),
            "0xff": b"\xff" * 32,
            "newline": b"k\n\r\t",
        }
        assert tuple(keys) == self.ODD_KEYS
        assert len(set(keys.values())) == len(keys), "odd keys must be distinct"
        return keys

    ODD_KEYS = ("32-random", "empty", "1-byte", "4096-bytes", "4096-bytes-last-differs", "slash",
                "only-slashes", "dotdot", "dot", "traversal", "absolute", "backslashes", "nul",
                "nul-nul", "nul-inside", "0xff", "newline")

    @pytest.mark.parametrize("label", ODD_KEYS)
    def test_odd_byte_key_round_trips_or_is_refused(self, lone, tmp_path, label):
        """Every byte key: a bitwise round trip, or a typed refusal (an exception, or False and
        then a miss) -- never wrong bytes, an untyped exception, or a file outside the store's
        directory. An ordinary key written beside it keeps its own bytes."""
        store, pool, workdir = lone
        key = self.odd_keys(tmp_path)[label]
        plain = self.keys(1, "plain")[0]
        want, want_plain = self.page_bytes(pool, 1), self.page_bytes(pool, 2)
        assert store.batch_set([plain], [2]) == [True]
        try:
            stored = bounded_call(lambda: store.batch_set([key], [1]), what="batch_set")
        except KVTierError:
            stored = None                           # refused, typed: allowed
        assert files_outside(str(tmp_path), workdir) == [], f"key {label!r} wrote outside"
        fill_random(pool.raw)
        if stored is None:
            with pytest.raises(KVTierError):        # refused once, refused always
                store.batch_get([key], [4])
        else:
            assert stored in ([True], [False]), stored
            before = self.page_bytes(pool, 4)
            got = bounded_call(lambda: store.batch_get([key], [4]), what="batch_get")
            if stored == [True]:
                assert got == [True], f"key {label!r} stored but read as a miss"
                assert torch.equal(self.page_bytes(pool, 4), want), f"key {label!r}: wrong bytes"
                assert store.batch_exists([key]) == 1
                assert store.delete([key]) == 1
                assert store.batch_get([key], [5]) == [False]
            else:
                assert got == [False]
                assert torch.equal(self.page_bytes(pool, 4), before), "a miss touched the page"
        assert store.batch_get([plain], [6]) == [True]
        assert torch.equal(self.page_bytes(pool, 6), want_plain), (
            f"key {label!r} changed what another key reads")
        store.clear()
        assert files_outside(str(tmp_path), workdir) == [], f"key {label!r} wrote outside"

    def test_odd_keys_in_one_batch_stay_distinct(self, lone, tmp_path):
        """Keys that differ only in their last byte, by a NUL, or by a dot are distinct objects:
        each accepted key reads back its own page (no truncation, no normalisation)."""
        store, pool, workdir = lone
        accepted = []
        for key in self.odd_keys(tmp_path).values():
            try:
                if store.batch_set([key], [0]) == [True]:
                    accepted.append(key)
            except KVTierError:
                pass
        assert accepted, "not even the 32-byte key was stored"
        pages = list(range(len(accepted)))
        store.clear()
        want = [self.page_bytes(pool, p) for p in pages]
        assert store.batch_set(accepted, pages) == [True] * len(accepted)
        fill_random(pool.raw)
        dst = [len(pages) + i for i in range(len(pages))][:pool.num_pages - len(pages)]
        assert len(dst) == len(pages), "pool too small for the batch"
        assert store.batch_get(accepted, dst) == [True] * len(accepted)
        for i, p in enumerate(dst):
            assert torch.equal(self.page_bytes(pool, p), want[i]), f"key {accepted[i][:16]!r}"
        assert files_outside(str(tmp_path), workdir) == []

    @pytest.mark.parametrize("bad", ["str-key", 7, None, 1.5, ["list"]],
                             ids=["str", "int", "None", "float", "list"])
    def test_keys_that_are_not_bytes_are_typed_errors_before_anything(self, lone, bad):
        """A key that is not bytes, anywhere in a batch, is an InvalidArgumentError from every
        call before anything is read, written or deleted."""
        store, pool, _ = lone
        good = self.keys(3)
        assert store.batch_set(good[:1], [0]) == [True]
        fill_random(pool.raw)
        raw = pool.raw.clone()
        sets = store.stats()["sets"]
        for what, call in [
                ("batch_set", lambda: store.batch_set(good[1:] + [bad], [1, 2, 3])),
                ("batch_get", lambda: store.batch_get(good[:1] + [bad], [4, 5])),
                ("batch_exists", lambda: store.batch_exists(good[:1] + [bad])),
                ("delete", lambda: store.delete(good[:1] + [bad]))]:
            assert_typed_refusal(call, (InvalidArgumentError,), f"{what} with key {bad!r}")
        assert torch.equal(pool.raw, raw), "a refused call touched the pool"
        assert store.stats()["sets"] == sets
        assert store.batch_exists(good) == 1, "a refused call stored or deleted a key"

    BAD_PAGES = {"True": True, "False": False, "-1": -1, "num_pages": None, "2**63": 2**63,
                 "-2**63-1": -2**63 - 1, "float": 1.0, "None": "none", "str": "0",
                 "float-tensor": "float-tensor", "bool-tensor": "bool-tensor",
                 "2d-tensor": "2d-tensor"}

    def _bad_pages(self, label: str, pool) -> Any:
        """``[1, bad]`` for one hostile host page index (or a whole hostile tensor)."""
        if label == "num_pages":
            return [1, pool.num_pages]
        if label == "None":
            return [1, None]
        if label.endswith("tensor"):
            return {"float-tensor": torch.tensor([1.0, 2.0]),
                    "bool-tensor": torch.tensor([True, False]),
                    "2d-tensor": torch.tensor([[1, 2]])}[label]
        return [1, self.BAD_PAGES[label]]

    @pytest.mark.parametrize("label", list(BAD_PAGES))
    def test_hostile_host_page_indices_are_typed_errors_before_anything(self, lone, label):
        store, pool, _ = lone
        k = self.keys(2)
        fill_random(pool.raw)
        raw = pool.raw.clone()
        for what, call in [("batch_set", lambda: store.batch_set(k, self._bad_pages(label, pool))),
                           ("batch_get", lambda: store.batch_get(k, self._bad_pages(label, pool)))]:
            assert_typed_refusal(call, (PageIndexError, InvalidArgumentError),
                                 f"{what} with host page {label}")
        assert torch.equal(pool.raw, raw), "a refused call touched the pool"
        assert store.batch_exists(k[:1]) == 0, "a refused batch_set stored a key"

    def test_mismatched_lengths_are_typed_errors_and_empty_batches_are_empty(self, lone):
        store, pool, _ = lone
        k = self.keys(3)
        assert store.batch_set(k[:1], [0]) == [True]
        fill_random(pool.raw)
        raw = pool.raw.clone()
        for what, call in [("batch_set 3 keys, 2 pages", lambda: store.batch_set(k, [1, 2])),
                           ("batch_set 0 keys, 1 page", lambda: store.batch_set([], [1])),
                           ("batch_set 2 keys, 0 pages", lambda: store.batch_set(k[1:], [])),
                           ("batch_get 1 key, 3 pages", lambda: store.batch_get(k[:1], [3, 4, 5])),
                           ("batch_get 3 keys, 1 page", lambda: store.batch_get(k, [3]))]:
            assert_typed_refusal(call, (InvalidArgumentError,), what)
        assert torch.equal(pool.raw, raw), "a refused call touched the pool"
        assert store.batch_exists(k) == 1
        assert store.batch_set([], []) == [] and store.batch_get([], []) == []
        assert store.delete([]) == 0 and store.batch_exists([]) == 0
        assert torch.equal(pool.raw, raw)

    def test_one_host_page_under_two_keys_in_one_batch_set(self, lone):
        """Allowed (unlike one page twice in batch_get): both keys then hold the page."""
        store, pool, _ = lone
        k = self.keys(3)
        want = self.page_bytes(pool, 3)
        other = self.page_bytes(pool, 4)
        assert store.batch_set(k, [3, 4, 3]) == [True] * 3
        fill_random(pool.raw)
        assert store.batch_get(k, [7, 8, 9]) == [True] * 3
        for key_i, page, w in ((0, 7, want), (1, 8, other), (2, 9, want)):
            assert torch.equal(self.page_bytes(pool, page), w), f"key {key_i}"

    def test_calls_after_close_are_typed_errors_or_empty(self, backend_name, tmp_path):
        """After close(): each call raises a kvtier error or answers empty (misses, 0, False
        writes) within a bound, leaves the pool alone; close() stays idempotent."""
        spec = random_specs()[0]
        cls = self.backend_class(backend_name)
        pool = make_host_pool(spec, 8, cls.capabilities().host_layouts[0])
        try:
            s = cls(self.make_config(backend_name, str(tmp_path)), spec=spec)
            s.attach(pool)
            s.clear()
            k = self.keys(2)
            assert s.batch_set(k, [0, 1]) == [True, True]
            bounded_call(s.close, what="close")
            fill_random(pool.raw)
            raw = pool.raw.clone()
            empty = {"batch_get": [False, False], "batch_set": [False, False],
                     "batch_exists": 0, "delete": 0, "clear": None}
            for what, call in [("batch_get", lambda: s.batch_get(k, [4, 5])),
                               ("batch_set", lambda: s.batch_set(k, [2, 3])),
                               ("batch_exists", lambda: s.batch_exists(k)),
                               ("delete", lambda: s.delete(k)),
                               ("clear", s.clear)]:
                try:
                    got = bounded_call(call, 20.0, f"{what} after close")
                except KVTierError:
                    continue
                except AssertionError:
                    raise
                except Exception as exc:            # noqa: BLE001 -- the finding
                    raise AssertionError(f"{what} after close: untyped "
                                         f"{type(exc).__name__}: {exc}") from exc
                assert got == empty[what], f"{what} after close answered {got!r}"
            assert torch.equal(pool.raw, raw), "a call after close touched the pool"
            bounded_call(s.close, what="a second close")
        finally:
            pool.close()

    def test_read_during_overwrite_is_old_new_or_miss_never_a_mix(self, lone):
        """One thread overwrites a key from pages of random bytes while another reads it into
        its own page: every read is a miss or exactly one of the versions written."""
        store, pool, _ = lone
        deadline = time.monotonic() + 30.0
        for rnd in range(3):
            fill_random(pool.raw)
            key = self.keys(1, f"race{rnd}")[0]
            errors, reads = self._race(store, pool, key, [0, 1, 2, 3], 10, deadline)
            assert not errors, f"round {rnd}: {errors[:3]}"
            assert reads, f"round {rnd}: the reader never ran"

    def _race(self, store, pool, key: bytes, versions: list[int], dst: int,
              deadline: float) -> tuple[list[str], int]:
        """Overwrite ``key`` from ``versions`` on one thread while reading it into ``dst`` on
        another for half a second; returns (what went wrong, reads done)."""
        want = [self.page_bytes(pool, p) for p in versions]
        assert store.batch_set([key], [versions[0]]) == [True]
        stop = threading.Event()
        errors: list[str] = []
        reads = [0]

        def writer() -> None:
            i = 1
            try:
                while not stop.is_set():
                    store.batch_set([key], [versions[i % len(versions)]])
                    i += 1
            except BaseException as exc:        # noqa: BLE001 -- reported by the caller
                errors.append(f"writer: {type(exc).__name__}: {exc}")

        def reader() -> None:
            try:
                end = time.monotonic() + 0.5
                while time.monotonic() < end and not errors:
                    if store.batch_get([key], [dst]) == [True]:
                        got = self.page_bytes(pool, dst)
                        if not any(torch.equal(got, w) for w in want):
                            errors.append("a read returned bytes of no version written")
                            return
                    reads[0] += 1
            except BaseException as exc:        # noqa: BLE001 -- reported by the caller
                errors.append(f"reader: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=writer, daemon=True),
                   threading.Thread(target=reader, daemon=True)]
        for t in threads:
            t.start()
        threads[1].join(max(0.1, deadline - time.monotonic()))
        stop.set()
        threads[0].join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a racing call hung"
        return errors, reads[0]


# --------------------------------------------------------------------------------------------
def _devices() -> list[str]:
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


class TransferEngineContract(_Suite):
    group = TRANSFER_ENGINES
    device_pages = 19
    host_pages = 29

    def devices(self, backend_name: str) -> list[str]:
        """Devices this backend moves data for (subclasses narrow it)."""
        types = self.backend_class(backend_name).capabilities().device_types
        return [d for d in _devices() if not types or d in types or "any torch device" in types]

    def host_allocator(self, backend_name: str) -> Any:
        """Allocator (name or instance) of the host pool the engine moves pages to and from;
        engines that need device-addressable host memory override it."""
        return "torch-pinned"

    @pytest.fixture(params=random_specs(), ids=spec_id)
    def spec(self, request) -> KVSpec:
        return request.param

    @pytest.fixture(params=["page_first", "layer_first"])
    def layout(self, request) -> str:
        return request.param

    @pytest.fixture
    def setup(self, backend_name, spec, layout, tmp_path):
        caps = self.backend_class(backend_name).capabilities()
        if layout not in caps.host_layouts:
            pytest.skip(f"{backend_name} does not support host layout {layout}")
        devices = self.devices(backend_name)
        if not devices:
            pytest.skip(f"{backend_name}: no device here")
        dev = devices[-1]
        dpool = make_device_pool(spec, self.device_pages, dev)
        hpool = make_host_pool(spec, self.host_pages, layout,
                               self.host_allocator(backend_name))
        cls = self.backend_class(backend_name)
        config = self.make_config(backend_name, str(tmp_path))
        if spec.row_bytes % caps.row_alignment:
            try:
                with pytest.raises(LayoutError):
                    cls(dpool, hpool, config)
            finally:
                hpool.close()
            pytest.skip(f"{backend_name} needs rows of a multiple of {caps.row_alignment} B "
                        f"(capabilities().row_alignment); {spec.row_bytes} B rows are refused "
                        "with LayoutError, as declared")
        engine = cls(dpool, hpool, config)
        yield engine, dpool, hpool
        engine.close()
        hpool.close()

    @staticmethod
    def _pairs(n: int, a: int, b: int, seed: int) -> tuple[list[int], list[int]]:
        rng = random.Random(seed)
        return rng.sample(range(a), n), rng.sample(range(b), n)

    def test_backup_then_load_bitwise(self, setup, spec):
        engine, dpool, hpool = setup
        dev_src, host = self._pairs(11, dpool.num_pages, hpool.num_pages, 3)
        want = [[[dpool.page(c, l, p).clone() for p in dev_src]
                 for l in range(spec.num_layers)] for c in range(spec.num_components)]
        engine.backup(dev_src, host).wait()
        _sync(dpool)
        for c in range(spec.num_components):
            for l in range(spec.num_layers):
                for i, p in enumerate(host):
                    assert_bitwise_equal(hpool.view[p, l, c], want[c][l][i],
                                         f"backup comp {c} layer {l} host page {p}")
        for comp in dpool.layers:                  # poison the device pool
            for t in comp:
                fill_random(t)
        dev_dst = random.Random(4).sample(range(dpool.num_pages), 11)
        h = engine.load(host, dev_dst)
        for layer in range(spec.num_layers):
            h.wait_layer(layer)
            _sync(dpool)
            for c in range(spec.num_components):
                for i, p in enumerate(dev_dst):
                    assert_bitwise_equal(dpool.page(c, layer, p), want[c][layer][i],
                                         f"load comp {c} layer {layer} device page {p}")
        h.wait()
        assert h.done()

    def test_untouched_pages_stay_untouched(self, setup):
        engine, dpool, hpool = setup
        from ..layout import logical_view
        before = hpool.raw.clone()
        old = logical_view(before, hpool.spec, hpool.num_pages, hpool.layout)
        engine.backup([2, 0], [5, 1]).wait()
        _sync(dpool)
        changed = {p for p in range(hpool.num_pages)
                   if not torch.equal(raw_bytes(old[p]), raw_bytes(hpool.view[p]))}
        assert changed == {5, 1}

    def test_repeated_and_tensor_indices(self, setup, spec):
        engine, dpool, hpool = setup
        for rep in range(3):
            dev, host = self._pairs(5, dpool.num_pages, hpool.num_pages, 10 + rep)
            fill_random(hpool.raw)
            want = [hpool.view[p].clone() for p in host]
            on_host = self.backend_class(engine.name).capabilities().host_indices
            d_idx = torch.tensor(dev, dtype=torch.int64,
                                 device="cpu" if on_host else dpool.device)
            engine.load(torch.tensor(host), d_idx).wait()
            _sync(dpool)
            for i, p in enumerate(dev):
                for c in range(spec.num_components):
                    for l in range(spec.num_layers):
                        assert_bitwise_equal(dpool.page(c, l, p), want[i][l, c],
                                             f"rep {rep} page {p}")

    def test_empty_transfer(self, setup):
        engine, _, _ = setup
        h = engine.load([], [])
        h.wait()
        assert h.done()

    def test_bad_indices_are_typed_errors(self, setup):
        engine, dpool, hpool = setup
        with pytest.raises(PageIndexError):
            engine.load([0, hpool.num_pages], [0, 1])
        with pytest.raises(PageIndexError):
            engine.backup([dpool.num_pages], [0])
        with pytest.raises(PageIndexError):
            engine.load([0.5], [1])                               # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError):
            engine.load([0, 1], [0])
        h = engine.load([0], [0])
        with pytest.raises(LayoutError):
            h.wait_layer(engine.spec.num_layers)
        h.wait()

    def test_hostile_indices_are_typed_errors_before_any_byte_moves(self, setup):
        """Bools, negatives, indices past int64, floats, None, strings, tensors of a float or
        bool dtype or two dimensions, and lists of different lengths -- each at the end of an
        otherwise valid list -- are PageIndexError or InvalidArgumentError, and neither pool
        changes by a byte."""
        engine, dpool, hpool = setup
        dev = dpool.device
        cases = [
            ("load host [0, True]", lambda: engine.load([0, True], [0, 1])),
            ("load device [0, False]", lambda: engine.load([0, 1], [0, False])),
            ("backup device [0, -1]", lambda: engine.backup([0, -1], [0, 1])),
            ("backup host [0, -1]", lambda: engine.backup([0, 1], [0, -1])),
            ("load host [0, 2**63]", lambda: engine.load([0, 2**63], [0, 1])),
            ("backup device [0, -2**63-1]", lambda: engine.backup([0, -2**63 - 1], [0, 1])),
            ("load host [0, 1.0]", lambda: engine.load([0, 1.0], [0, 1])),
            ("backup device [0, None]", lambda: engine.backup([0, None], [0, 1])),
            ("load host '01'", lambda: engine.load("01", [0, 1])),
            ("load host float tensor", lambda: engine.load(torch.tensor([0.0, 1.0]), [0, 1])),
            ("load device float tensor on the device",
             lambda: engine.load([0, 1], torch.tensor([0.0, 1.0], device=dev))),
            ("backup host bool tensor",
             lambda: engine.backup([0, 1], torch.tensor([True, False]))),
            ("backup device 2-D tensor",
             lambda: engine.backup(torch.tensor([[0, 1]], device=dev), [0, 1])),
            ("backup 2 device pages, 1 host page", lambda: engine.backup([0, 1], [0])),
            ("load 0 host pages, 1 device page", lambda: engine.load([], [0])),
            ("backup 1 device page, 0 host pages", lambda: engine.backup([0], [])),
        ]
        before_host = hpool.raw.clone()
        before_dev = [dpool.page_bytes(p).cpu() for p in range(dpool.num_pages)]
        for what, call in cases:
            assert_typed_refusal(call, (PageIndexError, InvalidArgumentError), what)
            _sync(dpool)
            assert torch.equal(hpool.raw, before_host), f"{what}: the host pool changed"
        for p in range(dpool.num_pages):
            assert torch.equal(dpool.page_bytes(p).cpu(), before_dev[p]), (
                f"device page {p} changed")

    # ----- loads of a range of layers (capabilities().layer_ranges) ---------------------------
    #: Geometries of the layer-range tests: odd layer counts; rows of a multiple of 16 bytes,
    #: so that engines moving 16-byte units take them too.
    range_specs = (
        KVSpec.mha(num_layers=5, num_kv_heads=2, head_dim=24, page_size=3, dtype="bfloat16"),
        KVSpec.mla(num_layers=13, kv_lora_rank=56, rope_dim=8, page_size=5, dtype="bfloat16"),
        KVSpec.mha(num_layers=7, num_kv_heads=3, head_dim=16, page_size=2,
                   dtype="float8_e4m3fn"),
    )

    @pytest.fixture(params=range_specs, ids=spec_id)
    def range_spec(self, request) -> KVSpec:
        return request.param

    @pytest.fixture(params=[True, False], ids=["one-block", "layers-apart"])
    def range_setup(self, request, backend_name, range_spec, layout, tmp_path):
        """An engine over ``range_spec`` pools (the device pool's layers in one allocation or
        each its own), skipped where the engine does not load layer ranges."""
        cls = self.backend_class(backend_name)
        caps = cls.capabilities()
        if not caps.layer_ranges:
            pytest.skip(f"{backend_name} loads every layer of a page "
                        "(capabilities().layer_ranges is False)")
        if layout not in caps.host_layouts:
            pytest.skip(f"{backend_name} does not support host layout {layout}")
        devices = self.devices(backend_name)
        if not devices:
            pytest.skip(f"{backend_name}: no device here")
        if range_spec.row_bytes % caps.row_alignment:
            pytest.skip(f"{backend_name} needs rows of a multiple of {caps.row_alignment} B")
        dpool = make_layout_pool(range_spec, "token_major", self.device_pages, devices[-1],
                                 one_block=request.param)
        hpool = make_host_pool(range_spec, self.host_pages, layout,
                               self.host_allocator(backend_name))
        try:
            engine = cls(dpool, hpool, self.make_config(backend_name, str(tmp_path)))
        except BaseException:
            hpool.close()
            raise
        yield engine, dpool, hpool
        engine.close()
        hpool.close()

    @staticmethod
    def _layer_rows(dpool, layer: int) -> torch.Tensor:
        """Every device page's bytes of one layer, on the CPU: ``[pages, layer bytes]``, in
        the order of a host page's bytes of that layer."""
        return torch.cat([c.cpu() for c in dpool.chunks[layer]], dim=1)

    def test_layer_range_loads_move_those_layers_only(self, range_setup):
        """Loads of random ranges of layers (the first, the last, all of them and random
        ones) between random pages: each layer of the range lands bitwise once its
        ``wait_layer`` returned (asked in random order); every other byte of the device pool
        -- other layers of the same pages, other pages -- is untouched; the host pool is
        not changed; ``wait_layer`` outside the range is a LayoutError; ``wait``, ``done``
        and ``synchronize`` cover the range. An empty ranged load answers for its range
        only."""
        engine, dpool, hpool = range_setup
        spec = engine.spec
        L, lb = spec.num_layers, spec.page_bytes // spec.num_layers
        rng = random.Random(zlib.crc32(repr((spec_id(spec), hpool.layout)).encode()))
        on_host = self.backend_class(engine.name).capabilities().host_indices
        ranges = [(0, 1), (L - 1, L), (0, L)]
        for _ in range(4):
            lo = rng.randrange(L)
            ranges.append((lo, rng.randint(lo + 1, L)))
        for k, (lo, hi) in enumerate(ranges):
            fill_random(hpool.raw)
            for chunks in dpool.chunks:            # poison the device pool
                for c in chunks:
                    fill_random(c)
            _sync(dpool)
            before = [self._layer_rows(dpool, layer) for layer in range(L)]
            host_before = hpool.raw.clone()
            n = rng.randint(1, min(dpool.num_pages, hpool.num_pages))
            host = rng.sample(range(hpool.num_pages), n)
            dev = rng.sample(range(dpool.num_pages), n)
            want = torch.stack([torch.cat(hpool.page_segments(p)) for p in host])
            if k % 2:                              # tensors, where the engine reads them
                h = engine.load(torch.tensor(host), torch.tensor(
                    dev, device="cpu" if on_host else dpool.device), layers=(lo, hi))
            else:
                h = engine.load(host, dev, layers=(lo, hi))
            what = f"load of layers [{lo}, {hi}) of {n} pages"
            for layer in rng.sample(range(lo, hi), hi - lo):
                h.wait_layer(layer)
                _sync(dpool)
                got = self._layer_rows(dpool, layer)[dev]
                assert torch.equal(got, want[:, layer * lb:(layer + 1) * lb]), (
                    f"{what}: layer {layer} differs after wait_layer({layer})")
            for bad in {lo - 1, hi, -1, L} - set(range(lo, hi)):
                with pytest.raises(LayoutError):
                    h.wait_layer(bad)
            h.wait()
            h.synchronize()
            _sync(dpool)
            assert h.done(), what
            for layer in range(L):
                expect = before[layer].clone()
                if lo <= layer < hi:
                    expect[dev] = want[:, layer * lb:(layer + 1) * lb]
                got = self._layer_rows(dpool, layer)
                if not torch.equal(got, expect):
                    pages = sorted({int(p) for p in (got != expect).any(1).nonzero()})
                    raise AssertionError(f"{what}: layer {layer} of device pages {pages} "
                                         f"{'differs' if lo <= layer < hi else 'changed'}")
            assert torch.equal(hpool.raw, host_before), f"{what}: the host pool changed"
        lo, hi = ranges[-1]
        h = engine.load([], [], layers=(lo, hi))
        h.wait_layer(lo)
        with pytest.raises(LayoutError):
            h.wait_layer(hi)
        h.wait()
        assert h.done()

    def test_bad_layer_ranges_are_typed_errors_before_any_byte_moves(self, setup):
        """``layers`` that is not ``(lo, hi)`` of ints with ``0 <= lo < hi <= num_layers``
        (empty, reversed or out-of-bounds ranges, bools, floats, strings, other lengths) is
        an InvalidArgumentError or LayoutError, and neither pool changes by a byte; an
        engine without ``capabilities().layer_ranges`` refuses any ``layers`` but None."""
        engine, dpool, hpool = setup
        L = engine.spec.num_layers
        if self.backend_class(engine.name).capabilities().layer_ranges:
            cases = [
                (0, 0), (L, L), (1, 0), (L, 0), (-1, 1), (-1, L), (0, L + 1), (L, L + 1),
                (-2**63, 1), (0, 2**64), (True, 1), (0, True), (False, True), (0.0, 1),
                (0, 1.0), ("0", "1"), (None, 1), (0,), (0, 1, 2), (), 1, 0, "01", b"\x00\x01",
                {0: 1}, torch.tensor([0, 1])]
        else:
            cases = [(0, L), (0, 1), [0, L], (0, 0), "all"]
        before_host = hpool.raw.clone()
        before_dev = [self._layer_rows(dpool, layer) for layer in range(L)]
        for bad in cases:
            assert_typed_refusal(lambda bad=bad: engine.load([0, 1], [1, 0], layers=bad),
                                 (InvalidArgumentError, LayoutError), f"load layers={bad!r}")
        _sync(dpool)
        assert torch.equal(hpool.raw, before_host), "the host pool changed"
        for layer in range(L):
            assert torch.equal(self._layer_rows(dpool, layer), before_dev[layer]), (
                f"layer {layer} of the device pool changed")
        h = engine.load([0], [0], layers=None)           # None: every layer, as without it
        h.wait()
        h.wait_layer(L - 1)


def _sync(dpool) -> None:
    if dpool.device.type == "cuda":
        torch.cuda.synchronize(dpool.device)


# --------------------------------------------------------------------------------------------
class PackageContract:
    """What every backend package promises, whatever its backends: subclass it in the
    package's tests and set ``distribution`` and ``module`` (its top-level import).

    - every backend it registers is discovered, loads, implements this INTERFACE_VERSION and
      has a typed ``Config``; one that cannot run says why (a non-empty probe reason);
    - importing the package and discovering its backends adds no vendor runtime module
      (`kvtier.testing.imports.VENDOR_ROOTS`, or ``vendor_roots``);
    - ``import kvtier`` (and the ``kvtier`` command's listing) imports nothing of the package
      (core never imports a vendor package).
    """

    distribution: str = ""
    module: str = ""
    #: (kind, name) pairs the package must register; None: at least one backend.
    backends: set[tuple[str, str]] | None = None
    vendor_roots: tuple[str, ...] | None = None

    def _records(self) -> list[Any]:
        assert self.distribution and self.module, "set distribution and module"
        return [r for g in GROUPS for r in registry.records(g)
                if r.distribution == self.distribution]

    def test_backends_discovered_with_reason(self):
        recs = self._records()
        assert recs, f"{self.distribution} registers no backend (are its entry points there?)"
        if self.backends is not None:
            assert {(r.kind, r.name) for r in recs} == set(self.backends)
        for rec in recs:
            assert rec.error is None, rec.error
            av = registry.probe(rec)
            assert isinstance(av, Availability)
            assert av.ok or av.reason, f"{rec.name}: unavailable without a reason"

    def test_backends_declare_the_interface(self):
        import dataclasses
        for rec in self._records():
            cls = rec.cls
            assert cls is not None and cls.interface_version == INTERFACE_VERSION
            assert dataclasses.is_dataclass(cls.Config), f"{rec.name}: Config is no dataclass"
            assert cls.__module__.split(".")[0] == self.module, (
                f"{rec.name} lives in {cls.__module__}, outside {self.module}")

    def test_import_loads_no_vendor_runtime(self):
        from .imports import VENDOR_ROOTS, vendor_modules_added
        stmts = f"import kvtier, {self.module}; from kvtier import registry; registry.discover()"
        assert vendor_modules_added(stmts, tuple(self.vendor_roots or VENDOR_ROOTS)) == []

    def test_core_does_not_import_the_package(self):
        """``import kvtier`` imports nothing of the package; ``kvtier --help`` only what its
        ``kvtier.commands`` entry points name (light modules: no backend, no tool)."""
        import json
        import subprocess
        import sys
        mod = self.module
        code = (f"import sys, json\nmine = lambda: sorted(m for m in sys.modules "
                f"if m.split('.')[0] == {mod!r})\n"
                "import kvtier, kvtier.cli\nafter_import = mine()\n"
                "try:\n    kvtier.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
                "print(json.dumps([after_import, mine()]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        after_import, after_help = json.loads(out.stdout.strip().splitlines()[-1])
        assert after_import == []
        assert set(after_help) <= {mod, f"{mod}._version", f"{mod}.commands"}, after_help


# Device layouts (pool.chunks): every engine moves each layout bitwise or refuses it when built.
DEVICE_LAYOUTS = ("token_major", "vllm_flash", "flashinfer_nhd", "flashinfer_hnd", "vllm_cpu",
                  "mla")


def make_layout_pool(spec: KVSpec, layout: str, num_pages: int, device: str = "cpu",
                     one_block: bool = False):
    """A device pool of random bytes in ``layout`` (``token_major``: DeviceKVPool(spec, k, v)),
    each layer its own allocation, or with ``one_block`` views of one allocation (layers at
    one stride, as engines that allocate the whole cache at once have it)."""
    from ..device_pool import BLOCK_LAYOUTS, DeviceKVPool
    H, D = spec.row_shape
    if layout == "token_major":
        if one_block:
            return make_device_pool(spec, num_pages, device)
        comps = [[fill_random(torch.empty((num_pages * spec.page_size, H, D),
                                          dtype=spec.torch_dtype, device=device))
                  for _ in range(spec.num_layers)] for _ in range(spec.num_components)]
        return DeviceKVPool(spec, comps[0], comps[1] if spec.num_components == 2 else None)
    shape = BLOCK_LAYOUTS[layout][1](num_pages, spec.page_size, H, D)
    if one_block:
        block = fill_random(torch.empty((spec.num_layers, *shape), dtype=spec.torch_dtype,
                                        device=device))
        tensors = list(block.unbind(0))
    else:
        tensors = [fill_random(torch.empty(shape, dtype=spec.torch_dtype, device=device))
                   for _ in range(spec.num_layers)]
    return DeviceKVPool.from_blocks(spec, tensors, layout)


def layout_specs(layout: str) -> list[KVSpec]:
    """Odd geometries for a layout: fp8 and 2-byte dtypes, odd page sizes and dims."""
    if layout == "mla":
        return [KVSpec.mla(num_layers=3, kv_lora_rank=40, rope_dim=8, page_size=5,
                           dtype="float8_e4m3fn"),
                KVSpec.mla(num_layers=2, kv_lora_rank=20, rope_dim=4, page_size=3,
                           dtype="bfloat16")]
    return [KVSpec.mha(num_layers=3, num_kv_heads=3, head_dim=16, page_size=5,
                       dtype="float8_e4m3fn"),
            KVSpec.mha(num_layers=2, num_kv_heads=2, head_dim=12, page_size=3, dtype="float16")]


class DeviceLayoutContract(_Suite):
    """Round trips over every device layout with random pages; an engine that cannot move a
    layout must refuse it with LayoutError when built (unless ``refusals_allowed`` is False)."""

    group = TRANSFER_ENGINES
    device_pages = 13
    host_pages = 17
    refusals_allowed = True
    devices = TransferEngineContract.devices
    host_allocator = TransferEngineContract.host_allocator

    def make_config(self, backend_name: str, workdir: str) -> dict[str, Any]:
        return self.backend_class(backend_name).example_config(workdir)

    @pytest.fixture(params=["page_first", "layer_first"])
    def layout(self, request) -> str:
        return request.param

    @pytest.fixture(params=[(lay, i, one) for lay in DEVICE_LAYOUTS for i in range(2)
                            for one in (False, True)],
                    ids=lambda p: f"{p[0]}-{p[1]}" + ("-one-block" if p[2] else ""))
    def layout_case(self, request):
        return request.param

    def test_layout_roundtrip_bitwise(self, backend_name, layout_case, layout, tmp_path):
        dev_layout, which, one_block = layout_case
        spec = layout_specs(dev_layout)[which]
        cls = self.backend_class(backend_name)
        if layout not in cls.capabilities().host_layouts:
            pytest.skip(f"{backend_name} does not support host layout {layout}")
        devices = self.devices(backend_name)
        if not devices:
            pytest.skip(f"{backend_name}: no device here")
        dpool = make_layout_pool(spec, dev_layout, self.device_pages, devices[-1], one_block)
        hpool = make_host_pool(spec, self.host_pages, layout, self.host_allocator(backend_name))
        try:
            try:
                engine = cls(dpool, hpool, self.make_config(backend_name, str(tmp_path)))
            except LayoutError:
                if not self.refusals_allowed:
                    raise
                return                       # refused when built: allowed
            try:
                rng = random.Random(zlib.crc32(repr((layout_case, layout)).encode()))
                src = rng.sample(range(dpool.num_pages), 9)
                host = rng.sample(range(hpool.num_pages), 9)
                want = [dpool.page_bytes(p).cpu() for p in src]
                engine.backup(src, host).wait()
                _sync(dpool)
                for i, p in enumerate(host):
                    got = torch.cat(hpool.page_segments(p))
                    assert torch.equal(got, want[i]), f"backup of device page {src[i]}"
                for layer in dpool.chunks:
                    for chunk in layer:
                        fill_random(chunk)
                dst = rng.sample(range(dpool.num_pages), 9)
                h = engine.load(host, dst)
                h.wait()
                _sync(dpool)
                for i, p in enumerate(dst):
                    assert torch.equal(dpool.page_bytes(p).cpu(), want[i]), f"load of {p}"
            finally:
                engine.close()
        finally:
            hpool.close()
