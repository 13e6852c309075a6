"""kvtier's ``sglang.srt.plugins`` entry point, loaded by SGLang's own ``load_plugins`` and
``HookRegistry``, over SGLang's real host pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) and device pools on the CPU.

Every test puts SGLang's classes and hook registry back as they were: the hooks patch classes
for the whole process, and the other SGLang tests build the same pools.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import PoolCase, attach, extra_config, make_pools, storage_config

from kvtier.errors import BackendNotFoundError, ConfigError, KVTierError, LayoutError
from kvtier.integrations.sglang import plugin

LOGGER = "kvtier.integrations.sglang.plugin"

CASES = [
    PoolCase("mha", "layer_first", torch.float16, 3, 3, heads=3, head_dim=8),
    PoolCase("mha", "page_first", torch.bfloat16, 5, 3, heads=2, head_dim=24),
    PoolCase("mha", "page_first_direct", torch.float32, 4, 2, heads=1, head_dim=12),
    PoolCase("mha", "page_first", torch.float8_e4m3fn, 1, 2, heads=1, head_dim=40),
    PoolCase("mla", "layer_first", torch.float16, 3, 2, kv_lora_rank=20, rope=4),
    PoolCase("mla", "page_first", torch.bfloat16, 7, 3, kv_lora_rank=48, rope=8),
    PoolCase("mla", "page_first_direct", torch.bfloat16, 2, 2, kv_lora_rank=32, rope=0),
]


def _classes():
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    return MHATokenToKVPoolHost, MLATokenToKVPoolHost


def _snapshot():
    return {(cls, attr): vars(cls).get(attr, None) for cls in _classes()
            for attr in plugin.HOOKED}


@pytest.fixture
def sglang_plugins(monkeypatch):
    """SGLang's plugin loading, run fresh (only kvtier's entry point), and undone after."""
    import sglang.srt.plugins as sp
    from sglang.srt.plugins.hook_registry import HookRegistry
    before = _snapshot()
    hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvtier")
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setattr(plugin, "_active", None)

    def load(config: dict | str | None = None) -> None:
        if config is not None:
            monkeypatch.setenv(plugin.ENV, config if isinstance(config, str)
                               else json.dumps(config))
        monkeypatch.setattr(sp, "_plugins_loaded", False)
        sp.load_plugins()

    yield load
    for (cls, attr), value in before.items():
        if value is None:
            if attr in vars(cls):
                delattr(cls, attr)
        else:
            setattr(cls, attr, value)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(patched)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A per-token tensor as uint8 rows, ``[tokens, bytes]``."""
    return t.reshape(t.shape[0], -1).contiguous().view(torch.uint8)


def _host_rows(host, comp: int, layer: int) -> torch.Tensor:
    """SGLang's host tokens of one component and layer, ``[size, bytes]``, read through its
    own buffer layout (what its storage backends and kernels address)."""
    kv = host.kv_buffer[comp] if host.kv_buffer.dim() in (5, 6) and \
        hasattr(host, "device_k_buffers") else host.kv_buffer
    if host.layout == "layer_first":
        t = kv[layer]
    else:                           # page_first [size, L, ...] / direct [pages, L, S, ...]
        t = kv[:, layer]
        t = t.reshape(host.size, *t.shape[2:]) if host.layout == "page_first_direct" else t
    return _rows(t)


def _device_layers(dev, case: PoolCase) -> list[list[torch.Tensor]]:
    if case.kind == "mha":
        return [list(dev.k_buffer), list(dev.v_buffer)]
    return [list(dev.kv_buffer)]


def _tokens(pages, s: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * s, (p + 1) * s, dtype=torch.int64) for p in pages])


@pytest.mark.parametrize("allocator", ["mmap", "torch-pinned"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_host_pool_on_kvtier_round_trips(sglang_plugins, case, allocator):
    sglang_plugins({"host_allocator": allocator, "transfer_engine": "torch"})
    dev, host = make_pools(case)
    try:
        assert isinstance(host.kvtier, plugin.PoolBridge)
        report = host.kvtier.report()
        buf = host.kvtier.buffer
        # The buffer SGLang uses is the one the kvtier allocator handed out, as it reported.
        assert host.kv_buffer.data_ptr() == buf.ptr
        assert host.kv_buffer.nbytes <= buf.nbytes
        assert report["host_allocator"] == allocator and report["backing"] == buf.backing
        assert host.pin_memory is buf.device_addressable
        if allocator == "mmap":
            assert buf.details.get("attempts"), report
        assert report["transfer_engine"] == ["torch"] * (2 if case.kind == "mha" else 1)

        s = host.page_size
        gen = torch.Generator().manual_seed(7)
        comps = _device_layers(dev, case)
        for layer_list in comps:
            for t in layer_list:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                        generator=gen, dtype=torch.uint8))
        dev_pages = dev.size // s                      # pages 1.. (page 0 is SGLang's pad)
        src = torch.randperm(dev_pages, generator=gen)[:3].add(1).tolist()
        dst = [p for p in range(1, dev_pages + 1) if p not in src][:3]
        hpages = torch.randperm(host.page_num, generator=gen)[:3].tolist()
        d_src, d_dst, h_idx = _tokens(src, s), _tokens(dst, s), _tokens(hpages, s)
        want = [[_rows(t)[d_src].clone() for t in c] for c in comps]

        host.backup_from_device_all_layer(dev, h_idx, d_src, "kernel")
        for c in range(len(comps)):
            for layer in range(case.layers):       # in SGLang's own host layout, bitwise
                assert torch.equal(_host_rows(host, c, layer)[h_idx], want[c][layer])

        for c in comps:
            for t in c:
                t.zero_()
        for layer in range(case.layers):            # SGLang's per-layer load loop
            host.load_to_device_per_layer_physical(dev, h_idx, d_dst, layer, "kernel")
            for c in range(len(comps)):             # layer `layer` is there on return
                assert torch.equal(_rows(comps[c][layer])[d_dst], want[c][layer])
        for c in range(len(comps)):
            for layer in range(case.layers):
                assert torch.equal(_rows(comps[c][layer])[d_dst], want[c][layer])
                assert not _rows(comps[c][layer])[d_src].any()     # nothing else written
    finally:
        host.destroy()


def test_unconfigured_plugin_touches_nothing(sglang_plugins, caplog):
    before = _snapshot()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        sglang_plugins()
    assert _snapshot() == before
    assert not [r for r in caplog.records if r.name == LOGGER]
    _, host = make_pools(CASES[0])
    assert not hasattr(host, "kvtier")


def test_other_sglang_minor_is_refused_in_one_line(sglang_plugins, caplog, monkeypatch):
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.6.0")
    before = _snapshot()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sglang_plugins({"host_allocator": "mmap"})
    assert _snapshot() == before
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "0.5.x" in lines[0] and "0.6.0" in lines[0] and "disabled" in lines[0]
    _, host = make_pools(CASES[0])
    assert not hasattr(host, "kvtier")
    assert plugin.version_refusal("0.5.23") is None
    assert plugin.version_refusal("0.5.30+cu129") is None
    assert plugin.version_refusal("0.4.10") is not None


@pytest.mark.parametrize("config, error, key", [
    ({"host_alocator": "mmap"}, ConfigError, "sglang_hicache.host_alocator"),
    ({"host_allocator": "no-such"}, BackendNotFoundError, None),
    ({"host_allocator": "mmap", "host_allocator_config": {"hugepage": "off"}}, ConfigError,
     "mmap.hugepage"),
    ({"transfer_engine": "torch", "transfer_engine_config": {"staging": 1}}, ConfigError,
     "torch.staging"),
    ('{"host_allocator": ', ConfigError, plugin.ENV),
    ("/nonexistent/kvtier-sglang.toml", ConfigError, "config"),
])
def test_bad_config_is_one_typed_line(sglang_plugins, monkeypatch, caplog, config, error, key):
    monkeypatch.setenv(plugin.ENV, config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(error) as info:
        plugin.register()
    assert isinstance(info.value, KVTierError) and "\n" not in str(info.value)
    if key is not None:
        assert info.value.key == key
    before = _snapshot()
    with caplog.at_level(logging.ERROR):             # through SGLang: logged, nothing patched
        sglang_plugins(config)
    assert _snapshot() == before
    failed = [r for r in caplog.records if r.name == "sglang.srt.plugins" and r.exc_info]
    assert len(failed) == 1 and isinstance(failed[0].exc_info[1], error)


def test_config_from_toml_and_json_files(tmp_path):
    toml = tmp_path / "kvtier.toml"
    toml.write_text('host_allocator = "mmap"\n[host_allocator_config]\nhugepages = "off"\n')
    assert plugin.load_config(str(toml)).host_allocator_config == {"hugepages": "off"}
    js = tmp_path / "kvtier.json"
    js.write_text('{"host_allocator": "torch-pinned", "transfer_engine": "auto"}')
    assert plugin.load_config(str(js)).transfer_engine == "auto"


def test_unserved_layout_is_refused_when_the_pool_is_built(sglang_plugins):
    sglang_plugins({"host_allocator": "mmap"})
    with pytest.raises(LayoutError, match="page_head") as info:
        make_pools(PoolCase("mha", "page_head", torch.bfloat16, 2, 2, heads=2, head_dim=16))
    assert "\n" not in str(info.value)


def test_a_storage_backends_own_allocator_is_not_replaced(sglang_plugins):
    """SGLang's shm / Mooncake / UMBP backends allocate the host pool themselves (shared or
    registered memory); the plugin refuses rather than swap their allocator out."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    sglang_plugins({"host_allocator": "mmap"})
    dev = MHATokenToKVPool(size=30, page_size=3, dtype=torch.float16, head_num=1, head_dim=8,
                           layer_num=2, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    with pytest.raises(LayoutError, match="ShmHostTensorAllocator") as info:
        MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 3,
                             "layer_first", pin_memory=False, device="cpu",
                             allocator_type="shm", device_capacity_tokens=dev.size,
                             start_layer=dev.start_layer, end_layer=dev.end_layer)
    assert "\n" not in str(info.value)


def test_kvtier_l3_adapter_bridges_a_plugin_pool(sglang_plugins):
    """Both ways in together: the HiCache storage adapter wraps the pool kvtier allocated."""
    sglang_plugins({"host_allocator": "mmap"})
    case = CASES[1]
    _, host = make_pools(case)
    backend = attach(host, storage_config(extra_config("memory", {"capacity_bytes": 1 << 20}),
                                          layout=case.layout))
    try:
        assert backend.bridge.base == host.kvtier.buffer.ptr
        assert backend.bridge.pool.buffer.device_addressable is host.pin_memory
    finally:
        backend.close()
        host.destroy()
