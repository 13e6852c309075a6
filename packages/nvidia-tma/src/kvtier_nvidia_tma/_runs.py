"""A page's contiguous byte runs on the device and the host, and merging copies that continue
each other: the copy lists the copy engine and the router are built from."""

from __future__ import annotations

from typing import Any


def chunk_runs(device_pool, host_pool) -> dict[str, Any]:
    """Every contiguous byte run of a page, per layer in page order: where it starts on the
    device (base + page * stride) and on the host (offset + page * stride), as NumPy arrays.
    Device runs are ``pool.chunks`` (any device layout); a chunk that spans two host
    components of a layer_first host pool is cut at the boundary."""
    import numpy as np
    spec = device_pool.spec
    P, C, cb = host_pool.num_pages, spec.num_components, spec.chunk_bytes
    lb = spec.page_bytes // spec.num_layers
    rows = []
    for layer, chunks in enumerate(device_pool.chunks):
        at = 0
        for chunk in chunks:
            n, o = int(chunk.shape[1]), 0
            while o < n:
                if host_pool.layout == "page_first":
                    take, hoff, hstride = n - o, layer * lb + at + o, spec.page_bytes
                else:
                    comp, within = divmod(at + o, cb)
                    take = min(n - o, cb - within)
                    hoff, hstride = (layer * C + comp) * P * cb + within, cb
                rows.append((layer, chunk.data_ptr() + o, chunk.stride(0), hoff, hstride, take))
                o += take
            at += n
    a = np.asarray(rows, dtype=np.uint64).reshape(-1, 6)
    return {"layer": a[:, 0].astype(np.int64), "dev_base": a[:, 1], "dev_stride": a[:, 2],
            "host_off": a[:, 3], "host_stride": a[:, 4], "nbytes": a[:, 5]}


def merge_runs(src, dst, sizes):
    """Merge consecutive copies that continue each other on both sides (NumPy, no loop)."""
    import numpy as np
    if src.size <= 1:
        return src, dst, sizes
    starts = _merge_starts(src, dst, sizes)
    run_sizes = np.add.reduceat(sizes, starts)
    return src[starts], dst[starts], run_sizes.astype(np.uint64)


def _merge_starts(src, dst, sizes, every: int = 0):
    """Indices of the copies that begin a merged run: those that do not continue the previous
    copy on both sides (with ``every``, also each ``every``-th copy: runs end there)."""
    import numpy as np
    cont = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
    if every:
        cont[every - 1::every] = False
    return np.flatnonzero(np.concatenate(([True], ~cont)))
