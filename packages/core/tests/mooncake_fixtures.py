"""A real Mooncake cluster for tests: ``mooncake_master`` on 127.0.0.1, and child processes.

The master is the binary shipped in the mooncake wheel, bound to 127.0.0.1 (RPC and metrics)
with its HTTP metadata server off; clients use TCP and P2P handshakes. Mooncake's client
transport listens on every interface, so by default the tests run inside a fresh loopback-only
network namespace (root only; ``KVTIER_MOONCAKE_NETNS=0`` disables, ``=1`` requires it).

Run as a script, this module is the child process of the cross-process tests (``commit``: put a
prompt's pages and wait; ``bigwriter``: put big pages until killed; ``hold``: contribute a
segment and wait).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

MASTER_ENV = "KVTIER_MOONCAKE_MASTER_ADDRESS"
NETNS_ENV = "KVTIER_MOONCAKE_NETNS"
THIS_FILE = str(Path(__file__).resolve())


def mooncake_import_error() -> str | None:
    """Why the Mooncake client cannot be used here, or None."""
    from kvtier.l3_stores.mooncake import MooncakeStore
    av = MooncakeStore.probe()
    return None if av.ok else f"{av.reason} ({av.hint})"


def close_idle_clients(address: str) -> None:
    from kvtier.l3_stores.mooncake import close_idle_clients
    close_idle_clients(address)


def master_binary() -> str:
    import mooncake
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"mooncake_master not found or not executable at {path}")
    return str(path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
class LoopbackNetns:
    """Move the calling thread (and every thread/process it starts) into a new network
    namespace with only ``lo`` up; ``leave()`` returns to the original one."""

    CLONE_NEWNET = 0x40000000

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._orig: int | None = None

    def enter(self) -> None:
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        if self._libc.unshare(self.CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            os.close(orig)
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        self._orig = orig
        try:
            self._lo_up()
        except OSError:
            self.leave()
            raise

    @staticmethod
    def _lo_up() -> None:
        SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sh14x", b"lo", 0)
            flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))

    def leave(self) -> None:
        if self._orig is None:
            return
        if self._libc.setns(self._orig, self.CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns back to the original network namespace: "
                               f"{os.strerror(err)}")
        os.close(self._orig)
        self._orig = None


@contextlib.contextmanager
def loopback_only():
    """A loopback-only network namespace when allowed (see module doc); yields whether."""
    mode = os.environ.get(NETNS_ENV, "auto").lower()
    if mode in ("0", "off", "no", "false"):
        yield False
        return
    ns = LoopbackNetns()
    try:
        ns.enter()
    except OSError as exc:
        if mode in ("1", "on", "yes", "true"):
            pytest.fail(f"{NETNS_ENV}={mode} but no network namespace: {exc}")
        sys.stderr.write(f"mooncake tests: no private network namespace ({exc}); "
                         "running on the host's loopback\n")
        yield False
        return
    try:
        yield True
    finally:
        ns.leave()


# ---------------------------------------------------------------------------------------------
class MasterProcess:
    """One ``mooncake_master`` bound to 127.0.0.1 on free ports."""

    def __init__(self, workdir: str, *, lease_ttl_ms: int = 300, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.metrics_port = free_port()
        self.workdir = workdir
        self.lease_ttl_ms = lease_ttl_ms
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(workdir, f"mooncake_master_{self.port}.log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--enable_http_metadata_server=false", "--rpc_thread_num=2",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}", *self.extra]

    def start(self, timeout: float = 20.0) -> "MasterProcess":
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.argv(), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; log:\n"
                                   + self.log_tail())
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within "
                           f"{timeout}s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: the master vanishes with every object's metadata."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (a hung master). Returns once the
        kernel shows the process stopped: the signal is delivered asynchronously, and a
        master still running on another core could answer one more call."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.proc.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                return                        # no /proc: as before
            if state in ("T", "t"):
                return
            time.sleep(0.005)
        raise AssertionError(f"mooncake_master {self.proc.pid} did not stop after SIGSTOP")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def mooncake_netns():
    """The network namespace every Mooncake test of the session runs in (see module doc).

    Session-wide: Mooncake keeps process-wide I/O threads, created in the namespace of the
    first client, so every later client and master must live in that same namespace. The rest
    of the session runs there too (loopback only)."""
    why = mooncake_import_error()
    if why is not None:
        pytest.skip(f"mooncake client not importable: {why}")
    with loopback_only() as private:
        yield private


@pytest.fixture(scope="module")
def mooncake_master(mooncake_netns):
    """A master shared by a test module; ``example_config`` points at it."""
    workdir = tempfile.mkdtemp(prefix="kvtier-mooncake-")
    old = os.environ.get(MASTER_ENV)
    master = MasterProcess(workdir).start()
    os.environ[MASTER_ENV] = master.address
    try:
        yield master
    finally:
        close_idle_clients(master.address)
        master.stop()
        if old is None:
            os.environ.pop(MASTER_ENV, None)
        else:
            os.environ[MASTER_ENV] = old
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def private_master(mooncake_master, tmp_path):
    """A master of the test's own (to kill, pause or fill), in the module's namespace."""
    masters: list[MasterProcess] = []

    def make(**kw) -> MasterProcess:
        m = MasterProcess(str(tmp_path), **kw).start()
        masters.append(m)
        return m
    yield make
    for m in masters:
        if m.proc is not None and m.proc.poll() is None:
            m.resume()
            close_idle_clients(m.address)
        m.stop()


# ---------------------------------------------------------------------------------------------
class Child:
    """A child Python process running one role of this module; speaks JSON lines on stdout."""

    def __init__(self, role: str, args: dict):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, THIS_FILE, role, json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)

    def stderr_tail(self, n: int = 3000) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").splitlines()
        # Mooncake's glog lines (I/W/E + date) drown Python's traceback: keep the rest
        keep = [ln for ln in lines if not (len(ln) > 5 and ln[0] in "IWE" and ln[1:5].isdigit())]
        return "\n".join(keep)[-n:]

    def read(self, timeout: float = 60.0) -> dict:
        """The next JSON line (non-JSON lines from vendor code are skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited with {self.proc.wait()} before answering; "
                                   f"its stderr:\n{self.stderr_tail()}")
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    return msg
        raise TimeoutError("child did not answer in time")

    def finish(self, timeout: float = 30.0) -> int:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def prompt_data(spec, num_pages: int, seed: int, layout: str = "page_first"):
    """A prompt's tokens, its page keys and a host pool whose first pages hold its KV."""
    import numpy as np
    import torch

    from kvtier.keys import PageKeyer
    from kvtier.testing import fill_random, make_host_pool
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 150000, size=num_pages * spec.page_size + 3, dtype=np.int64)
    keys = PageKeyer(model_id=f"model-{seed}", spec=spec).keys(tokens)
    pool = make_host_pool(spec, num_pages + 2, layout)
    fill_random(pool.raw, torch.Generator().manual_seed(seed))
    return tokens, keys, pool


def spec_from(d: dict):
    from kvtier.spec import KVSpec
    return KVSpec.from_dict(d)


def _role_commit(args: dict) -> None:
    """Process A: commit a prompt's pages, report, and keep its client (and segment) alive."""
    from kvtier.l3_stores.mooncake import MooncakeStore
    spec = spec_from(args["spec"])
    _, keys, pool = prompt_data(spec, args["num_pages"], args["seed"], args["layout"])
    store = MooncakeStore(args["config"], spec=spec)
    store.attach(pool)
    ok = store.batch_set(keys, list(range(len(keys))))
    print(json.dumps({"stored": ok, "stats": store.stats()}), flush=True)
    sys.stdin.read()
    store.close()
    pool.close()


def _role_bigwriter(args: dict) -> None:
    """Put big pages one by one, announcing each put before it starts, until killed."""
    from kvtier.l3_stores.mooncake import MooncakeStore
    from kvtier.testing import make_host_pool
    spec = spec_from(args["spec"])
    pool = make_host_pool(spec, 1)
    store = MooncakeStore(args["config"], spec=spec)
    store.attach(pool)
    page = pool.page_bytes_view(0)
    for i in range(args["count"]):
        page.copy_(big_page_pattern(page.numel(), i))
        print(json.dumps({"putting": i}), flush=True)
        ok = store.batch_set([big_key(i)], [0])
        print(json.dumps({"put": i, "ok": ok[0]}), flush=True)
    sys.stdin.read()


def _role_hold(args: dict) -> None:
    """Contribute a segment to the pool and wait."""
    from kvtier.l3_stores.mooncake import MooncakeStore
    store = MooncakeStore(args["config"], spec=spec_from(args["spec"]))
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    store.close()


def big_key(i: int) -> bytes:
    return f"big-page-{i}".encode().ljust(32, b"#")


def big_page_pattern(nbytes: int, i: int):
    """Page ``i``'s bytes: cheap to make for hundreds of MiB, different per page and offset."""
    import torch
    base = torch.arange(nbytes // 8 + 1, dtype=torch.int64) * 2654435761 + i * 97 + 1
    return base.view(torch.uint8)[:nbytes]


ROLES = {"commit": _role_commit, "bigwriter": _role_bigwriter, "hold": _role_hold}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
