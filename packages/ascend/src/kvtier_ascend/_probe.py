"""Loading the vendor runtimes and telling apart why they cannot run.

torch_npu failing to import (and which shared library it missed), no NPU, memfabric's offload
entity failing to initialise (quoting memfabric's own log lines), and the acc_offload kernel
library not built. Vendor modules are imported here, at call time, never at import of the
package; they are looked up in ``sys.modules`` each time (no module object is cached).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import re
import threading
from typing import Any, Iterator

from kvtier import Availability

TORCH_NPU_HINT = ("install the Ascend CANN toolkit (source its set_env.sh) and the torch-npu "
                  "build matching your torch; neither is a kvtier dependency")
MEMFABRIC_HINT = "pip install 'kvtier-ascend[runtime]' (memfabric-hybrid needs the Ascend driver)"
KERNEL_HINT = ("build memfabric's acc_offload kernel library on the NPU host: `mfcli kernel "
               "install` (needs CANN, torch and torch-npu; Atlas A3/A5 only)")
DRIVER_HINT = ("memfabric needs the Ascend NPU driver and firmware (it checks the version in "
               "/usr/local/Ascend/driver/version.info) and an NPU on this host")
NPU_HINT = ("needs an Ascend NPU visible to this process (check npu-smi and "
            "ASCEND_RT_VISIBLE_DEVICES)")

#: memfabric log levels (set_log_level: 0 debug, 1 info, 2 warn, 3 error; >3 seen for traces).
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}
_LIB_RE = re.compile(r"(lib[\w.+-]*?\.so(?:\.[\w.]+)?)")
_PREFIX_RE = re.compile(r"^\[[^\]]*\]\s*")
log = logging.getLogger("memfabric_hybrid")


def load_torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def load_memfabric() -> Any:
    """The ``memfabric_hybrid`` package. Its ``offload`` is an attribute (a pybind11
    submodule), not an importable ``memfabric_hybrid.offload`` module."""
    return importlib.import_module("memfabric_hybrid")


def load_offload() -> Any:
    mf = load_memfabric()
    try:
        return mf.offload
    except AttributeError as exc:
        raise ImportError(f"memfabric_hybrid {getattr(mf, '__version__', '')} has no "
                          "'offload' (acc_offload) module") from exc


def missing_library(exc: BaseException) -> str | None:
    """The shared library an import error names (``libhccl.so: cannot open ...``)."""
    m = _LIB_RE.search(str(exc))
    return m.group(1) if m else None


def import_failure(module: str, exc: BaseException) -> str:
    """A reason naming what failed: the package missing, or a library it needs."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module:
        return f"{module} is not installed"
    lib = missing_library(exc)
    what = f"{lib} is missing" if lib else "import failed"
    return f"{module} failed to import: {what} ({type(exc).__name__}: {exc})"


# ----- memfabric's log lines -------------------------------------------------------------------
class _LogSink:
    """memfabric's extern logger: forwards to Python logging and, while a capture is open,
    records lines so a failure can quote memfabric's own explanation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.captures: list[collections.deque] = []
        self.installed_on: Any = None

    def __call__(self, level: int, message: str) -> None:
        with self.lock:
            capturing = bool(self.captures)
            for cap in self.captures:
                cap.append((int(level), str(message)))
        # While capturing (probes), memfabric's lines are quoted in the reason instead.
        log.log(logging.DEBUG if capturing else _LEVELS.get(int(level), logging.DEBUG),
                "%s", message)


_sink = _LogSink()


def install_logger(mf: Any) -> None:
    """Route memfabric's log lines into Python logging (logger ``memfabric_hybrid``).

    memfabric prints them to stdout otherwise; it has no way to read back a previously set
    logger, so this replaces any other one for the process (once per module object).
    """
    if _sink.installed_on is mf:
        return
    setter = getattr(mf, "set_extern_logger", None)
    if setter is None:
        return
    try:
        setter(_sink)
        _sink.installed_on = mf
    except (RuntimeError, TypeError):  # an older build: keep its own printing
        pass


@contextlib.contextmanager
def capture_log(mf: Any, maxlen: int = 200) -> Iterator[collections.deque]:
    """Record memfabric's log lines emitted inside the block."""
    cap: collections.deque = collections.deque(maxlen=maxlen)
    with _sink.lock:
        _sink.captures.append(cap)
    try:
        install_logger(mf)
        yield cap
    finally:
        with _sink.lock:
            _sink.captures.remove(cap)


def quote_errors(lines: Any, mf: Any = None, last: int = 4) -> str:
    """memfabric's explanation of a failure: its last error lines (source prefix stripped),
    else its last-error text, else a pointer to its log."""
    errors = [_PREFIX_RE.sub("", msg) for level, msg in lines if level >= 3 and level in _LEVELS]
    uniq = list(dict.fromkeys(errors))[-last:]
    if uniq:
        return "; ".join(uniq)
    getter = getattr(mf, "get_and_clear_last_err_msg", None) if mf is not None else None
    if getter is not None:
        try:
            text = getter()
        except (RuntimeError, TypeError):
            text = ""
        if text:
            return str(text)
    return "no error text from memfabric (see its log)"


# ----- probes ------------------------------------------------------------------------------
def probe_npu() -> Availability:
    """torch_npu imports and sees at least one NPU."""
    try:
        torch_npu = load_torch_npu()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(import_failure("torch_npu", exc), TORCH_NPU_HINT)
    try:
        count = int(torch_npu.npu.device_count())
    except (RuntimeError, AttributeError, OSError) as exc:
        return Availability.unavailable(f"no Ascend NPU: torch_npu.npu.device_count() failed: "
                                        f"{type(exc).__name__}: {exc}", NPU_HINT)
    if count <= 0:
        return Availability.unavailable("no Ascend NPU: torch_npu sees 0 devices", NPU_HINT)
    return Availability.available(f"torch_npu sees {count} NPU(s)")


def probe_memfabric(*, launch_kernel: bool = False) -> Availability:
    """memfabric imports and its offload entity initialises (reusing this process's session
    when one is open, else a trial one that is torn down again); with ``launch_kernel`` an
    empty ``kv_exchange_copy`` is launched too, which needs the acc_offload kernel library."""
    try:
        mf = load_memfabric()
        offload = load_offload()
    except (ImportError, OSError, RuntimeError) as exc:
        return Availability.unavailable(import_failure("memfabric_hybrid", exc), MEMFABRIC_HINT)
    from . import _memfabric
    try:
        with _memfabric.probe_session(mf, offload) as session:
            if launch_kernel:
                return _probe_kernel(mf, offload, session)
            return Availability.available(f"memfabric offload initialised on NPU "
                                          f"{session.device_id}")
    except _memfabric.OffloadInitError as exc:
        return Availability.unavailable(str(exc), DRIVER_HINT)


def _probe_kernel(mf: Any, offload: Any, session: Any) -> Availability:
    """Launch a zero-page kv_exchange_copy: the launch loads the acc_offload kernel library
    (shipped as an empty placeholder until ``mfcli kernel install`` builds it)."""
    import torch

    from .metadata import H2D, header, pack

    try:
        torch_npu = load_torch_npu()
        npu = torch_npu.npu
        dev_type = npu.current_stream(session.device_id).device.type
        device = torch.device(dev_type, session.device_id)
        # A valid launch that moves nothing: one component, zero pages.
        vals = pack(header(1, 0, 1, H2D, 0, 0, "page_first"), [])
        meta = torch.tensor(vals, dtype=torch.int64).to(device)
        with capture_log(mf) as lines:
            rc = offload.kv_exchange_copy(meta, device)
            npu.synchronize(session.device_id)
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        return Availability.unavailable(f"kv_exchange_copy probe launch failed: "
                                        f"{type(exc).__name__}: {exc}", KERNEL_HINT)
    if rc != 0:
        return Availability.unavailable(f"kv_exchange_copy returned {rc}: "
                                        f"{quote_errors(lines, mf)}", KERNEL_HINT)
    return Availability.available(f"memfabric offload + kv_exchange_copy kernel on NPU "
                                  f"{session.device_id}")
