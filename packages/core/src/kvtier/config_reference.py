"""The configuration reference (``docs/config.md``), generated from the config dataclasses of
the controller and of core's own backends: ``python -m kvtier.config_reference >
docs/config.md``; a test checks that the page is current. It sits above everything it
documents, so `kvtier.config` (the bottom floor every config is built with) imports nothing
from above it.
"""

from __future__ import annotations

import dataclasses

from .config import _describe, _hints, config_fields

__all__ = ["field_docs", "reference_markdown", "reference"]


# --------------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """``#:`` comments written above each field in the class body, by field name."""
    import ast
    import inspect
    import textwrap
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    out: dict[str, str] = {}
    tree = ast.parse(src)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                doc.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            if doc:
                out[node.target.id] = " ".join(doc)
    return out


def reference_markdown(sections: list[tuple[str, type, str]]) -> str:
    """A Markdown table per config dataclass: ``(title, cls, intro)`` each."""
    out = []
    for title, cls, intro in sections:
        hints = _hints(cls)
        docs = field_docs(cls)
        out += [f"## {title}", "", intro, "", "| field | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        for f in config_fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f"`{f.default!r}`"
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f"`{f.default_factory()!r}`"  # type: ignore[misc]
            else:
                default = "required"
            kind = _describe(hints[f.name]).replace("|", "\\|")
            out.append(f"| `{f.name}` | {kind} | {default} | "
                       f"{docs.get(f.name, '').replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def reference() -> str:
    """docs/config.md: every field of the controller's config and of core's own backends'
    configs (``python -m kvtier.config_reference > docs/config.md``; CI checks it is current)."""
    from .cache import CacheConfig
    from .host_allocators.mmap import MmapAllocator
    from .host_allocators.torch_pinned import TorchPinnedAllocator
    from .l3_stores.chain import ChainStore
    from .l3_stores.file import FileStore
    from .l3_stores.memory import MemoryStore
    from .l3_stores.mooncake import MooncakeStore
    from .l3_stores.shm import ShmStore
    from .transfer_engines.torch_engine import TorchTransferEngine
    head = ("# kvtier configuration reference\n\nGenerated from the config dataclasses by "
            "`python -m kvtier.config_reference > docs/config.md`; the tests check that it is "
            "current.\n"
            "\nThe controller's config comes from a dict, a `CacheConfig`, a TOML file "
            "(`--config FILE` or `KVTIER_CONFIG`, table `[cache]`) or `KVTIER_<FIELD>` "
            "environment variables (dict fields as JSON); unknown keys and unknown `KVTIER_*` "
            "variables are errors that name them. Backend configs go in `host_allocator_config`"
            ", `l3_config` and `transfer_config`.\n"
            "\nBounds, checked before anything is allocated: every int fits in 64 bits; page "
            "counts and byte sizes (the host pool's pages times its page size too) are at most "
            "2**48 (256 TiB), `l3_io_threads` at most 1024, timeouts at most 1e7 s; a config "
            "file nests at most 32 levels, is at most 16 MiB and must be a regular file (a "
            "FIFO or a device is refused, never waited on).\n")
    sections: list[tuple[str, type, str]] = [("CacheConfig (the controller)", CacheConfig,
                 "`kvtier.cache.CacheConfig`; environment: `KVTIER_<FIELD>`.")]
    for cls in (TorchPinnedAllocator, MmapAllocator, MemoryStore, FileStore, ShmStore,
                ChainStore, MooncakeStore, TorchTransferEngine):
        sections.append((f"`{cls.name}` ({cls.__name__}.Config)", cls.Config,
                         ((cls.__doc__ or "").strip().splitlines() or [""])[0]))
    return head + "\n" + reference_markdown(sections)


if __name__ == "__main__":  # pragma: no cover
    print(reference(), end="")
