"""Backend discovery over the three entry-point groups, with one record per backend.

Rules: importing kvtier imports no vendor runtime (backend modules import theirs inside
``probe()`` or construction); every discovered backend gets a record, failures included; an
unavailable backend asked for by name raises with its reason and hint -- never a silent
fallback; two distributions claiming one name is an error naming both; a backend built for
another INTERFACE_VERSION is refused. Nothing here branches on a backend's name.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from .errors import (BackendConflictError, BackendNotFoundError, BackendUnavailableError,
                     EntryPointError, InterfaceVersionError)
from .interfaces import (GROUPS, HOST_ALLOCATORS, INTERFACE_VERSION, L3_STORES,
                         TRANSFER_ENGINES, Availability, HostAllocator, L3Store, TransferEngine)

_log = logging.getLogger(__name__)

KIND_OF_GROUP = {HOST_ALLOCATORS: "host_allocator", L3_STORES: "l3_store",
                 TRANSFER_ENGINES: "transfer_engine"}
BASE_OF_GROUP = {HOST_ALLOCATORS: HostAllocator, L3_STORES: L3Store,
                 TRANSFER_ENGINES: TransferEngine}


@dataclass
class BackendRecord:
    """Everything known about one discovered backend."""

    group: str
    name: str
    distribution: str
    version: str
    target: str                                  # the entry point's value
    cls: type[Any] | None = None
    error: Exception | None = None               # load / version / conflict problem
    availability: Availability | None = None     # cached probe() result
    conflicts_with: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return KIND_OF_GROUP[self.group]

    def as_dict(self) -> dict[str, Any]:
        av = self.availability
        return {"kind": self.kind, "name": self.name, "distribution": self.distribution,
                "version": self.version, "target": self.target,
                "available": av is not None and av.ok and self.error is None,
                "reason": str(self.error) if self.error else
                ("" if av is None else av.reason),
                "hint": (getattr(self.error, "hint", "") if self.error else
                         ("" if av is None else av.hint)),
                "auto_priority": (self.cls.capabilities().auto_priority
                                  if self.cls is not None and self.group == TRANSFER_ENGINES
                                  else None)}


_lock = threading.RLock()
_records: dict[str, dict[str, BackendRecord]] | None = None


def _load(record: BackendRecord, ep: md.EntryPoint) -> None:
    base = BASE_OF_GROUP[record.group]
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must not break discovery of the others
        record.error = EntryPointError(
            f"{record.kind} {record.name!r} from {record.distribution}: entry point "
            f"{record.target!r} failed to load: {type(exc).__name__}: {exc}",
            kind=record.kind, name=record.name)
        return
    if not (isinstance(obj, type) and issubclass(obj, base)):
        record.error = EntryPointError(
            f"{record.kind} {record.name!r} from {record.distribution}: entry point "
            f"{record.target!r} is not a {base.__name__} subclass", kind=record.kind,
            name=record.name)
        return
    if obj.name != record.name:
        record.error = EntryPointError(
            f"{record.kind} entry point {record.name!r} from {record.distribution} points at "
            f"a class named {obj.name!r}", kind=record.kind, name=record.name)
        return
    found = getattr(obj, "interface_version", None)
    if found != INTERFACE_VERSION:
        record.error = InterfaceVersionError(
            f"{record.kind} {record.name!r} from {record.distribution} {record.version} "
            f"implements kvtier interface version {found!r}, this kvtier-core needs "
            f"{INTERFACE_VERSION}", kind=record.kind, name=record.name,
            expected=INTERFACE_VERSION, found=found)
        return
    record.cls = obj


def discover(refresh: bool = False) -> dict[str, dict[str, BackendRecord]]:
    """Records of every backend in the three groups (cached; ``refresh`` re-reads)."""
    global _records
    with _lock:
        if _records is not None and not refresh:
            return _records
        result: dict[str, dict[str, BackendRecord]] = {}
        for group in GROUPS:
            by_name: dict[str, BackendRecord] = {}
            seen: set[tuple[str, str, str]] = set()
            for ep in md.entry_points(group=group):
                dist = ep.dist.name if ep.dist is not None else "<unknown>"
                version = ep.dist.version if ep.dist is not None else "?"
                if (ep.name, dist, ep.value) in seen:      # same dist seen twice on sys.path
                    continue
                seen.add((ep.name, dist, ep.value))
                rec = BackendRecord(group, ep.name, dist, version, ep.value)
                if ep.name in by_name:
                    other = by_name[ep.name]
                    dists = tuple(sorted({other.distribution, dist}))
                    other.conflicts_with.append(dist)
                    other.error = BackendConflictError(
                        f"{other.kind} {ep.name!r} is registered by two distributions: "
                        f"{' and '.join(dists)}; uninstall one", kind=other.kind,
                        name=ep.name, distributions=dists)
                    other.cls = None
                    continue
                _load(rec, ep)
                by_name[ep.name] = rec
            result[group] = dict(sorted(by_name.items()))
        _records = result
        return result


def records(group: str | None = None) -> list[BackendRecord]:
    found = discover()
    groups = [group] if group else list(GROUPS)
    return [rec for g in groups for rec in found[g].values()]


def probe(record: BackendRecord, refresh: bool = False) -> Availability:
    """Run (or reuse) a backend's probe; a probe that raises is reported, not propagated."""
    if record.error is not None:
        return Availability.unavailable(str(record.error), getattr(record.error, "hint", ""))
    if record.availability is None or refresh:
        try:
            av = record.cls.probe()  # type: ignore[union-attr]
            if not isinstance(av, Availability):
                av = Availability.unavailable(f"probe() returned {av!r}, not an Availability")
        except Exception as exc:
            av = Availability.unavailable(f"probe() raised {type(exc).__name__}: {exc}")
        record.availability = av
    return record.availability


def probe_all(refresh: bool = False) -> list[BackendRecord]:
    recs = records()
    for rec in recs:
        probe(rec, refresh=refresh)
    return recs


def get_record(group: str, name: str) -> BackendRecord:
    if group not in GROUPS:
        raise BackendNotFoundError(f"unknown backend group {group!r}; expected one of "
                                   f"{list(GROUPS)}")
    kind = KIND_OF_GROUP[group]
    if not isinstance(name, str):
        raise BackendNotFoundError(f"{kind} name must be a string, got {name!r}", kind=kind)
    found = discover()[group]
    if name not in found:
        raise BackendNotFoundError(
            f"no {kind} named {name!r}; discovered: {sorted(found) or 'none'}",
            kind=kind, name=name)
    return found[name]


def get_backend_class(group: str, name: str, *, check: bool = True) -> type[Any]:
    """The class of a named backend; raises if it failed to load or (``check``) can't run."""
    rec = get_record(group, name)
    if rec.error is not None:
        raise rec.error
    if check:
        av = probe(rec)
        if not av.ok:
            raise BackendUnavailableError(
                f"{rec.kind} {name!r} ({rec.distribution} {rec.version}) is unavailable: "
                f"{av.reason}" + (f" -- {av.hint}" if av.hint else ""),
                kind=rec.kind, name=name, reason=av.reason, hint=av.hint)
    assert rec.cls is not None
    return rec.cls


def create_host_allocator(name: str, config: Any = None) -> HostAllocator:
    return get_backend_class(HOST_ALLOCATORS, name)(config)


def create_l3_store(name: str, config: Any = None, *, spec: Any) -> L3Store:
    return get_backend_class(L3_STORES, name)(config, spec=spec)


def create_transfer_engine(name: str, device_pool: Any, host_pool: Any,
                           config: Any = None) -> TransferEngine:
    """The named engine over the two pools; ``"auto"``: see `select_transfer_engine`."""
    if name == AUTO:
        return select_transfer_engine(device_pool, host_pool, config)
    return get_backend_class(TRANSFER_ENGINES, name)(device_pool, host_pool, config)


# --------------------------------------------------------------------------------------------
# transfer_engine="auto": chosen by declared capabilities, reported
AUTO = "auto"


def auto_candidates(device_type: str, host_layout: str | None = None
                    ) -> list[tuple[BackendRecord, str]]:
    """Every transfer engine with its verdict for ``device_type``, best first: ``""`` if
    ``auto`` may build it, else why not (unavailable, other devices, no auto rank, ...)."""
    out = []
    for rec in records(TRANSFER_ENGINES):
        av = probe(rec)
        caps = rec.cls.capabilities() if rec.cls is not None and av.ok else None
        if caps is None:
            why = f"unavailable: {av.reason}"
        elif caps.auto_priority is None:
            why = "not chosen automatically (no auto_priority)"
        elif device_type not in caps.device_types and "any torch device" not in \
                caps.device_types:
            why = f"moves data for {', '.join(caps.device_types)}, not {device_type}"
        elif host_layout is not None and host_layout not in caps.host_layouts:
            why = f"does not take {host_layout} host pools"
        else:
            why = ""
        out.append((rec, why, -(caps.auto_priority or 0) if caps and not why else 0))
    out.sort(key=lambda t: (bool(t[1]), t[2], t[0].name))
    return [(rec, why) for rec, why, _ in out]


def select_transfer_engine(device_pool: Any, host_pool: Any,
                           config: Any = None) -> TransferEngine:
    """Build the highest-ranked available engine (``Capabilities.auto_priority``) that moves
    data for the device pool's device type; one that refuses these pools when built (a typed
    KVTierError: layout, alignment, memory) is passed over for the next. ``config`` maps engine
    names to their configs. The choice is logged and kept on the engine as ``auto_selection``
    ({"chosen", "skipped": {name: why}}). Nothing available raises BackendUnavailableError."""
    from .errors import ConfigError, KVTierError
    if config is not None and not isinstance(config, dict):
        raise ConfigError("transfer_engine 'auto': config must map engine names to their "
                          f"configs, got {type(config).__name__}", key="transfer_engine_config")
    configs = dict(config or {})
    device_type = device_pool.device.type
    candidates = auto_candidates(device_type, getattr(host_pool, "layout", None))
    skipped = {rec.name: why for rec, why in candidates if why}
    for rec, why in candidates:
        if why:
            continue
        try:
            engine = rec.cls(device_pool, host_pool, configs.get(rec.name))  # type: ignore
        except KVTierError as exc:
            skipped[rec.name] = f"refused these pools: {type(exc).__name__}: {exc}"
            continue
        engine.auto_selection = {"chosen": rec.name, "device_type": device_type,
                                 "skipped": skipped}
        _log.info("transfer_engine=auto chose %r for %s pools (passed over: %s)", rec.name,
                  device_type, "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "none")
        return engine
    raise BackendUnavailableError(
        f"transfer_engine 'auto': no transfer engine can move pages for a {device_type} device "
        "pool here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()),
        kind="transfer_engine", name=AUTO, reason="no engine fits")
