"""`CacheConfig`: every setting of the controller, and its dict / environment / CLI glue."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ..config import (build_config, check_depth, config_fields, config_from_env, parse_json,
                      read_config_file)
from ..errors import ConfigError, show_value
from .cost import check_rate

__all__ = ["CacheConfig", "MAX_HOST_POOL_BYTES", "MAX_COUNT", "MAX_SECONDS"]

_DICT_FIELDS = ("host_allocator_config", "l3_config", "transfer_config")

#: Upper bound of page counts and byte sizes (2**48 B = 256 TiB: more than any one host holds;
#: a bigger value is a typo, refused before anything is allocated).
MAX_COUNT = 2**48
#: Upper bound of the host pool's size in bytes (pages x page bytes), checked before allocating.
MAX_HOST_POOL_BYTES = 2**48
#: Upper bound of ``l3_io_threads``: each is an OS thread.
MAX_IO_THREADS = 1024
#: Upper bound of every timeout (about 116 days; threads' waits overflow near 292 years).
MAX_SECONDS = 1e7

#: (field, least, greatest) of every int field; an int is also at most 2**63 - 1 (`_coerce`).
_INT_RANGES = (("host_pool_pages", 1, MAX_COUNT), ("host_pool_bytes", 1, MAX_COUNT),
               ("tp_rank", 0, MAX_COUNT), ("tp_size", 1, MAX_COUNT),
               ("pp_rank", 0, MAX_COUNT), ("pp_size", 1, MAX_COUNT),
               ("selective_threshold", 1, 2**63 - 1), ("prefetch_min_tokens", 0, MAX_COUNT),
               ("l3_io_threads", 1, MAX_IO_THREADS), ("l3_batch_pages", 1, MAX_COUNT),
               ("l3_error_limit", 1, MAX_COUNT), ("l3_max_queued_pages", 1, MAX_COUNT))


@dataclass(frozen=True)
class CacheConfig:
    """Everything the controller is built from; unknown keys are a ConfigError naming them.

    The host pool holds ``host_pool_pages`` pages, or as many as fit in ``host_pool_bytes``,
    or (neither given) ``host_pool_ratio`` times the device pool's pages.
    """

    model_id: str
    tp_rank: int = 0
    tp_size: int = 1
    #: Folded into every page key with model_id and the KV geometry (kvtier.keys.KeyNamespace):
    #: a LoRA adapter, a tenant, anything else that changes a page's bytes.
    salt: str = ""
    #: The model's revision (commit or tag): part of every page key.
    model_revision: str = ""
    #: RoPE and its scaling as the engine runs it (a canonical string, e.g. the JSON of the
    #: model's rope_scaling): part of every page key.
    rope: str = ""
    #: Pipeline-parallel rank and size: part of every page key.
    pp_rank: int = 0
    pp_size: int = 1
    #: Page-key hash: "sha256" (the default), "blake2b" or "blake3" (kvtier-core[blake3]).
    key_hash: Literal["sha256", "blake2b", "blake3"] = "sha256"
    host_pool_pages: int | None = None
    host_pool_bytes: int | None = None
    host_pool_ratio: float = 2.0
    host_layout: Literal["page_first", "layer_first"] = "page_first"
    host_allocator: str = "torch-pinned"
    host_allocator_config: dict[str, Any] = field(default_factory=dict)
    l3_store: str | None = None
    l3_config: dict[str, Any] = field(default_factory=dict)
    #: A transfer engine by name, or "auto": the best available one for the device by declared
    #: capability (the choice is logged and kept on the engine).
    transfer_engine: str = "auto"
    transfer_config: dict[str, Any] = field(default_factory=dict)
    write_policy: Literal["write_through", "write_through_selective",
                          "write_back"] = "write_through"
    selective_threshold: int = 2
    #: How long a fetch waits for L3 pages (see `kvtier.policies`): ``wait_complete`` (all
    #: of them; each store call within ``l3_call_timeout_s``), ``timeout`` (a budget that
    #: grows with the request) or ``best_effort`` (never waits: loads only what a prefetch()
    #: called earlier has landed).
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "wait_complete"
    prefetch_timeout_base_s: float = 0.05
    prefetch_timeout_per_1k_tokens_s: float = 0.01
    prefetch_timeout_cap_s: float = 1.0
    prefetch_min_tokens: int = 0
    l3_io_threads: int = 2
    #: Pages per store call.
    l3_batch_pages: int = 64
    #: Store calls raising in a row before the store counts as broken.
    l3_error_limit: int = 8
    #: Seconds (> 0) a store call may take before it counts as failed (its worker is
    #: replaced).
    l3_call_timeout_s: float = 30.0
    #: Pages queued for L3 writes beyond which new writes are dropped (and counted).
    l3_max_queued_pages: int = 65536
    #: On close: "flush" finishes every queued write (and, with write_back, writes dirty L2
    #: pages to L3); "cancel" drops queued writes not yet started.
    close_policy: Literal["flush", "cancel"] = "flush"
    close_timeout_s: float = 300.0
    #: Cost-aware fetch (`kvtier.cache.cost`): load only the leading hit pages whose loading
    #: beats recomputing them at the measured rates; False loads every hit.
    cost_aware_fetch: bool = True
    #: The engine's prefill rate in tokens/s (None: measured from ``observe_recompute``).
    recompute_tokens_per_s: float | None = None
    #: Weight of each new observation in the measured rates' moving averages.
    cost_ewma_alpha: float = 0.3
    #: False: drop write-through L3 writes while reading a page from L3 is measured slower
    #: than recomputing it (counted in ``cost_skipped_l3_writes``).
    l3_write_when_slow: bool = True
    #: Load L3 pages straight from a store's shared-memory arena into device pages where
    #: the store offers it (``shm``) and the engine can read the arena (registered with the
    #: device): no copy into L2 first, layer by layer beside the L2 hit
    #: (`kvtier.cache.inplace`). False: every L3 read goes through L2.
    l3_in_place_loads: bool = True
    #: Read L3 pages into L2 layer group by layer group and load each group into the device
    #: as it lands, so a prefill's first layers start before the whole read is done, where
    #: the store reads layer ranges (`L3Store.read_groups`) and the transfer engine loads
    #: them (``layer_ranges``). False (the default): a load waits for its pages' whole L3
    #: read. Off by default: on an H100 (8B, bf16, file L3 on tmpfs, 0.1 ms switch interval)
    #: streamed reads ran beside the prefill at 11-13 GB/s against whole reads' 19-21 before
    #: it, tying them on long context (2.13-2.14x over L1 only) and trailing on multi-turn
    #: (2.10-2.15x against 2.23-2.29x); at 5 ms a disk L3 streamed was slower than none
    #: (0.98-1.25x against L1+L2's 1.56-1.59x): records/demo-stream.md.
    l3_stream_layers: bool = False
    #: Stream a fetch's L3 pages only when their whole read would take at least this long
    #: at the measured L3 rate of whole reads (0: always; rate not measured yet: read
    #: whole). A streamed prefill waits layer group by layer group, and its reads run beside
    #: it: on an H100 (8B, bf16, file L3 on tmpfs) they ran at 55-65% of the rate of whole
    #: reads, so a short read (multi-turn: ~8 ms) gains less from the overlap than it loses.
    l3_stream_min_read_s: float = 0.1
    #: Streamed reads: read a page's layer groups in doubling spans, the first group alone and
    #: then each span as many groups as came before it (of 8 groups: 1, 1, 2, 4), one ranged
    #: read and one load per span, so the prefill still waits for one group at first while a
    #: page costs 4 reads instead of 8. False: one read and one load per group.
    l3_stream_spans: bool = True
    #: A fetch that reads its L3 pages whole (not streamed, not in place) reads them in the
    #: plan that loads them: the L2 hit's load starts at once, and each batch of
    #: ``l3_batch_pages`` L3 pages is loaded (every layer) as it lands, while the next batch
    #: is read, so the prefill starts with most of its pages in place instead of loading
    #: them beside it. Only under the ``wait_complete`` prefetch policy, and where no earlier
    #: `prefetch` started the read (the fetch then waits for it and loads after). False (the
    #: default): the fetch waits for the whole read, then loads layer by layer beside the
    #: prefill. Off by default: on an H100 and an H200 (8B, bf16, file L3 on tmpfs) the
    #: prefill of a long-context request fell to within a few ms of the ideal's, but the
    #: fetch grew by as much (each batch's loads are queued between two store calls, and the
    #: last batch's is waited for): 68-73% of the measured ideal either way on long context,
    #: 70-72% against 72-74% on multi-turn (records/demo-load-while-reading.md).
    l3_load_while_reading: bool = False
    #: The interpreter's thread switch interval in seconds (``sys.setswitchinterval``), set
    #: for the whole process when the data path is built; None (the default) leaves it.
    #: kvtier's threads run Python beside the engine's, and where the engine launches its
    #: forward pass from Python, a thread waiting for the interpreter lock can hold that
    #: launch back for up to this long (CPython's default is 0.005). On an H100 (8B, bf16,
    #: at 60% load) the demo's L1+L2+L3 prefills took 42.3 ms at 0.005 and 29.6 ms at
    #: 0.0001 (the every-page-in-L1 ideal's: 29.8 and 26.1): records/l3-staging.md,
    #: call 11. At most 1.
    switch_interval_s: float | None = None

    def __post_init__(self) -> None:
        for name in _DICT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, str):          # from the environment or a CLI flag: JSON
                v = parse_json(v, name) if v.strip() else {}
            if not isinstance(v, Mapping):
                raise ConfigError(f"{name} must be a mapping, got {show_value(v)}", key=name,
                                  value=v)
            check_depth(v, name)
            object.__setattr__(self, name, dict(v))
        if self.host_pool_pages is not None and self.host_pool_bytes is not None:
            raise ConfigError("give host_pool_pages or host_pool_bytes, not both",
                              key="host_pool_bytes", value=self.host_pool_bytes)
        for name, lo, hi in _INT_RANGES:
            v = getattr(self, name)
            if v is not None and not lo <= v <= hi:
                bound = f">= {lo}" if v < lo else f"<= {hi}"
                raise ConfigError(f"{name} must be {bound}, got {show_value(v)}", key=name,
                                  value=v)
        for name in ("host_pool_ratio", "prefetch_timeout_base_s",
                     "prefetch_timeout_per_1k_tokens_s", "prefetch_timeout_cap_s",
                     "close_timeout_s", "l3_call_timeout_s", "l3_stream_min_read_s"):
            v = getattr(self, name)
            if not (v >= 0) or math.isinf(v):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}", key=name,
                                  value=v)
            top: float = MAX_SECONDS if name.endswith("_s") else MAX_COUNT
            if v > top:
                raise ConfigError(f"{name} must be <= {top:g}, got {v!r}", key=name, value=v)
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if not r < n:
                raise ConfigError(f"{rank} must be below {size} ({n}), got {r}", key=rank,
                                  value=r)
        if not self.l3_call_timeout_s > 0:          # 0: every store call would time out
            raise ConfigError(f"l3_call_timeout_s must be > 0, got {self.l3_call_timeout_s!r}",
                              key="l3_call_timeout_s", value=self.l3_call_timeout_s)
        if self.recompute_tokens_per_s is not None:
            check_rate("recompute_tokens_per_s", self.recompute_tokens_per_s)
        if not (0 < self.cost_ewma_alpha <= 1):
            raise ConfigError(f"cost_ewma_alpha must be in (0, 1], got "
                              f"{self.cost_ewma_alpha!r}", key="cost_ewma_alpha",
                              value=self.cost_ewma_alpha)
        v = self.switch_interval_s
        if v is not None and not (0 < v <= 1):
            raise ConfigError(f"switch_interval_s must be in (0, 1] seconds or unset, got "
                              f"{v!r}", key="switch_interval_s", value=v)
        if self.l3_store == "":
            object.__setattr__(self, "l3_store", None)

    # ----- builders ------------------------------------------------------------------------
    #: Fields an engine integration decides (its parallel layout): a user may not set them.
    ENGINE_DECIDED = ("tp_rank", "tp_size", "pp_rank", "pp_size")

    @classmethod
    def inside_engine(cls, extra: Any, *, where: str, engine: str,
                      **decided: Any) -> "CacheConfig":
        """The config of kvtier inside an engine: ``extra`` is the user's part of it (the
        engine's setting ``where``); ``decided`` are what the engine knows -- its model id
        and revision fill keys the user did not set, its parallel layout
        (`ENGINE_DECIDED`) may not be set by the user. One-line ConfigErrors name the key
        (an unknown one with the nearest known key)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {type(extra).__name__}",
                              key=where)
        extra = dict(extra)
        for name in cls.ENGINE_DECIDED:
            if name in extra:
                raise ConfigError(f"{where}.{name}: the {engine} integration takes it from "
                                  f"{engine}'s parallel config; remove it", key=name,
                                  value=extra[name])
        for k, v in decided.items():
            if k in ("model_id", "model_revision"):
                extra.setdefault(k, v)
            else:
                extra[k] = v
        return cls.from_dict(extra)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "CacheConfig") -> "CacheConfig":
        return build_config(cls, data, section="cache")

    @classmethod
    def from_env(cls, prefix: str = "KVTIER_", environ: Mapping[str, str] | None = None,
                 base: Mapping[str, Any] | None = None) -> "CacheConfig":
        """From ``KVTIER_MODEL_ID``, ``KVTIER_HOST_POOL_PAGES``, ... over ``base``; dict
        fields (``KVTIER_L3_CONFIG``) are JSON."""
        return config_from_env(cls, prefix, environ, base)

    @classmethod
    def from_file(cls, path: str, section: str = "cache",
                  base: Mapping[str, Any] | None = None) -> "CacheConfig":
        """From the ``[section]`` table of a TOML file, over ``base``."""
        return build_config(cls, {**dict(base or {}), **read_config_file(path, section)},
                            section=section)

    @classmethod
    def load(cls, base: Mapping[str, Any] | None = None, *, path: str | None = None,
             environ: Mapping[str, str] | None = None, prefix: str = "KVTIER_"
             ) -> "CacheConfig":
        """The layered configuration: ``base`` (the caller's dict), then the config file
        (``path`` or ``$KVTIER_CONFIG``, table ``[cache]``), then ``KVTIER_<FIELD>``
        variables; later layers win. Unknown keys and variables are ConfigErrors."""
        env = os.environ if environ is None else environ
        data = dict(base or {})
        path = path or env.get("KVTIER_CONFIG") or None
        if path:
            data.update(read_config_file(path, "cache"))
        return config_from_env(cls, prefix, env, data)

    @classmethod
    def file_settings(cls, path: str | None = None, *,
                      environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The ``[cache]`` table of the config file (``path``, else ``$KVTIER_CONFIG``, which
        ``kvtier --config FILE`` sets), every key a field (else a ConfigError naming it); {}
        without a file. For a command that lays the file's settings under its own: its
        flags win where both set a field. Values are checked when the command builds its
        config from the merged dict."""
        env = os.environ if environ is None else environ
        path = path or env.get("KVTIER_CONFIG") or None
        if not path:
            return {}
        data = read_config_file(path, "cache")
        names = {f.name for f in config_fields(cls)}
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ConfigError(f"config file {path}: unknown key cache.{show_value(unknown[0])} "
                              f"for CacheConfig; known keys: {sorted(names)}",
                              key=f"cache.{unknown[0]}", value=data[unknown[0]])
        return dict(data)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """Add one ``--<prefix><field>`` flag per field (dashes for underscores)."""
        group = parser.add_argument_group("cache configuration")
        for f in config_fields(cls):
            flag = "--" + (prefix + f.name).replace("_", "-")
            group.add_argument(flag, dest=f"_cache_{f.name}", default=None, metavar="V",
                               help=f"CacheConfig.{f.name}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, base: Mapping[str, Any] | None = None
                  ) -> "CacheConfig":
        """Build from flags added by `add_arguments` (only flags given), over ``base``."""
        data: dict[str, Any] = dict(base or {})
        for f in config_fields(cls):
            v = getattr(args, f"_cache_{f.name}", None)
            if v is not None:
                data[f.name] = v
        return build_config(cls, data, section="cache", from_text=True)

    def key_identity(self) -> dict[str, Any]:
        """The identity fields of `kvtier.keys.PageKeyer` this config sets (besides model_id,
        TP rank/size and salt; the layouts come from the pools)."""
        return {"model_revision": self.model_revision, "rope": self.rope,
                "pp_rank": self.pp_rank, "pp_size": self.pp_size, "hash": self.key_hash,
                "host_layout": self.host_layout}

    def host_pages_for(self, page_bytes: int, device_pages: int) -> int:
        """How many host pages this config asks for."""
        if self.host_pool_pages is not None:
            n, name = self.host_pool_pages, "host_pool_pages"
        elif self.host_pool_bytes is not None:
            n = self.host_pool_bytes // page_bytes
            if n < 1:
                raise ConfigError(f"host_pool_bytes={self.host_pool_bytes} holds no page of "
                                  f"{page_bytes} bytes", key="host_pool_bytes",
                                  value=self.host_pool_bytes)
            return n
        else:
            n, name = max(1, int(device_pages * self.host_pool_ratio)), "host_pool_ratio"
        if n * page_bytes > MAX_HOST_POOL_BYTES:
            raise ConfigError(f"{name}: {n} host pages of {page_bytes} bytes is "
                              f"{n * page_bytes} bytes, more than the {MAX_HOST_POOL_BYTES} "
                              "(256 TiB) a host pool may have", key=name,
                              value=getattr(self, name))
        return n

