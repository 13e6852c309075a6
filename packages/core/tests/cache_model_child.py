"""The data-path process of test_cache_model.py's two-process layout (not a test module).

`Child` starts `serve` in a process of its own (multiprocessing's "spawn" context, as vLLM
starts its workers) and talks to it over a `multiprocessing.Pipe`: every request gets exactly
one reply, so the two ends never drift apart. The child owns what a worker owns -- the device
pool, and through a `CacheExecutor` the host pool and the L3 store -- and runs the `Plan` s it
is sent; the test process keeps the `CachePlanner`. Plans and results are pickled on the way,
page bytes travel as `bytes`.

Also the page helpers both layouts use: a device page's bytes, over every layer and component.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

import torch

from kvtier.cache import CacheExecutor
from kvtier.device_pool import DeviceKVPool
from kvtier.testing import fill_random
from kvtier.testing.contracts import raw_bytes

#: How long the test process waits for any one reply before it gives the child up.
REPLY_TIMEOUT_S = 60.0


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def write_device_page(pool: DeviceKVPool, page: int, raw: bytes) -> None:
    """Write ``raw`` (as `PageBytes` reads a page) into device page ``page``."""
    spec = pool.spec
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    off = 0
    for layer in range(spec.num_layers):
        for c in range(spec.num_components):
            view = pool.page(c, layer, page)
            n = view.numel() * view.element_size()
            view.view(-1).view(torch.uint8).copy_(data[off:off + n])
            off += n


class PageBytes:
    """Every byte of a device page of one pool (layer by layer, component by component), read
    through numpy views of the pool's memory taken once."""

    def __init__(self, pool: DeviceKVPool):
        spec = pool.spec
        self.arrays = [pool.pages_view(c, layer).view(torch.uint8).numpy()
                       for layer in range(spec.num_layers) for c in range(spec.num_components)]

    def __call__(self, page: int) -> bytes:
        return b"".join(a[page].tobytes() for a in self.arrays)


class _Worker:
    """The child's state: one executor and its pools, rebuilt by ``reset``."""

    def __init__(self) -> None:
        self.ex: CacheExecutor | None = None
        self.dpool: DeviceKVPool | None = None

    def reset(self, config: dict, spec: Any, device_pages: int, host_pages: int,
              seed: int) -> str:
        self.close()
        self.dpool = DeviceKVPool.empty(spec, device_pages)
        gen = torch.Generator().manual_seed(seed)
        for comp in self.dpool.layers:
            for t in comp:
                fill_random(t, gen)
        self.page_bytes = PageBytes(self.dpool)
        self.ex = CacheExecutor.from_config(config, device_pool=self.dpool,
                                            num_host_pages=host_pages)
        return self.dpool.page_order

    def close(self) -> int:
        """Close the executor; returns the store errors it counted."""
        ex, self.ex = self.ex, None
        if ex is None:
            return 0
        ex.close()
        return ex.metrics().get("store_errors", 0)

    def submit(self, plan: Any, two_part: bool = False) -> None:
        self.ex.submit(plan, two_part=two_part)

    def wait_backups(self, plan_id: int, timeout: float) -> list:
        """Wait until all of a plan but its L3 writes is done; every result so far."""
        assert self.ex.wait_backups(plan_id, timeout), f"plan {plan_id} still backing up"
        return self.ex.poll()

    def wait(self, plan_id: int | None, timeout: float) -> list:
        """Wait for one plan (None: for every plan); returns every result finished so far."""
        ok = self.ex.wait_idle(timeout) if plan_id is None else self.ex.wait(plan_id, timeout)
        assert ok, f"plan {plan_id} still running after {timeout} s"
        return self.ex.poll()

    def exists(self, keys: list[bytes]) -> int:
        # the writes already sent land first: what L3 holds then depends on the plans sent,
        # not on thread timing
        assert self.ex.wait_idle(10)
        return self.ex.store.batch_exists(keys)

    def delete(self, keys: list[bytes]) -> int:
        return self.ex.store.delete(keys)

    def read_device(self, pages: list[int]) -> list[bytes]:
        return [self.page_bytes(p) for p in pages]

    def write_device(self, pages: list[int], datas: list[bytes]) -> None:
        for p, data in zip(pages, datas):
            write_device_page(self.dpool, p, data)

    def read_host(self, pages: list[int]) -> list[bytes]:
        view = self.ex.host_pool.view
        return [as_bytes(raw_bytes(view[p])) for p in pages]

    def read_l3(self, keys: list[bytes], host_page: int) -> list[bytes | None]:
        """Each object L3 holds of ``keys`` (None: not there), read through ``host_page``."""
        out: list[bytes | None] = []
        for key in keys:
            if self.ex.store.batch_get([key], [host_page]) == [True]:
                out.append(self.read_host([host_page])[0])
            else:
                out.append(None)
        return out


def serve(conn: Any) -> None:
    """The child's loop: ``(command, *args)`` in, ``("ok", value)`` or ``("error", text)``
    out, until ``("stop",)``."""
    torch.set_num_threads(1)
    worker = _Worker()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            worker.close()
            return
        cmd, args = msg[0], msg[1:]
        if cmd == "stop":
            worker.close()
            conn.send(("ok", None))
            conn.close()
            os._exit(0)         # nothing left to flush: skip the interpreter's teardown
        try:
            conn.send(("ok", getattr(worker, cmd)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Child:
    """The test process's end: starts `serve` in a spawned process on first use."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.conn: Any = None

    def call(self, cmd: str, *args: Any) -> Any:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send((cmd, *args))
        if not self.conn.poll(REPLY_TIMEOUT_S):
            self.kill()
            raise AssertionError(f"the executor process did not answer {cmd!r} in "
                                 f"{REPLY_TIMEOUT_S} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"the executor process failed {cmd!r}:\n{value}")
        return value

    def start(self) -> None:
        self.kill()
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(there,), daemon=True,
                                name="kvtier-cache-model-executor")
        self.proc.start()
        there.close()

    def stop(self) -> None:
        """Ask the child to close its executor and exit; kill it if it does not."""
        if self.proc is None:
            return
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                if self.conn.poll(REPLY_TIMEOUT_S):
                    self.conn.recv()
            self.proc.join(10)
        except (OSError, EOFError):
            pass
        self.kill()

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                if proc.is_alive():
                    proc.kill()
                proc.join(10)
            except (AssertionError, OSError, ValueError):     # it never started
                pass
        if self.conn is not None:
            self.conn.close()
            self.conn = None
