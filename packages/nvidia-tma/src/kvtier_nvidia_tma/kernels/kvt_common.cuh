// Shared by every kvtier-nvidia-tma kernel: the launch parameters and the page/chunk addressing.
//
// Unit of data: a *chunk* = the page_size rows of one (page, layer, component), contiguous on
// both sides. Device side: chunk (d, g) lives at dev_table[g] + d * chunk_bytes, where
// g = layer * comps + comp indexes a [num_layers * comps] table of per-(layer, comp) buffers.
// Host side: chunk (h, g) lives at host_base + h * host_page_stride + g * host_chunk_stride
// (page_first: stride = page_bytes and chunk_bytes, so a page's chunks are one contiguous run;
// layer_first: chunk_bytes and num_pages * chunk_bytes).
//
// A launch moves the chunks g in [layer0 * comps, (layer0 + layers) * comps) of n (host page,
// device page) pairs, whose indices are read on the device. Out-of-range pairs are skipped and
// counted in *err (never written through).
#pragma once

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

// Every field is 8 bytes so the host-side ctypes mirror (_plan.KvtParams) has no padding
// questions. Keep the order in sync with _plan.KvtParams.
struct KvtParams {
    i64 host_base;          // device-visible address of the host pool's first byte
    i64 dev_table;          // device address of u64[num_layers * comps] buffer bases
    i64 host_idx;           // device address of i64[n] host page indices
    i64 dev_idx;            // device address of i64[n] device page indices
    i64 err;                // device address of a u32 counter of skipped (out-of-range) pairs
    i64 host_page_stride;   // bytes between host pages
    i64 host_chunk_stride;  // bytes between consecutive (layer, comp) chunks of one host page
    i64 chunk_bytes;        // bytes of one chunk (a multiple of 16)
    i64 host_pages;         // host pool size in pages (bounds check)
    i64 dev_pages;          // device pool size in pages (bounds check)
    i64 n;                  // number of (host page, device page) pairs
    i64 comps;              // 2 (K, V) for MHA, 1 for MLA
    i64 layer0;             // first layer of this launch
    i64 layers;             // layers in this launch
    i64 d2h;                // 0: host -> device (load), 1: device -> host (backup)
    // TMA plan (see _plan.plan_tma); unused by the register kernel
    i64 seg_chunks;         // K: chunks per host-contiguous segment
    i64 mode;               // 0: whole segments per piece, 1: chunks of a segment, 2: part of a chunk
    i64 per_piece;          // mode 0: segments; mode 1: chunks; mode 2: bytes per piece
    i64 pieces_per_seg;     // modes 1, 2
    i64 num_pieces;         // pieces in this launch
    i64 slot_bytes;         // mode 0: smem bytes per segment slot (segment bytes rounded to 128)
    i64 stages;             // smem stages per pipeline (warp)
    i64 stage_bytes;        // bytes per stage (a multiple of 128)
    i64 use_tmap;           // device side through the tensor map (one op per box of layers)
    i64 box_layers;         // layers per tensor-map box
    // per-layer signals (TMA kernel): with layer_flags != 0 one launch moves `loops` groups of
    // `layers` layers one after the other (group j: layers layer0 + j * layers ...), each cut
    // as a launch of that one group would be, and each pipeline adds 1 to u32 layer_flags[j]
    // once its part of group j is written (see kvt_tma_copy)
    i64 layer_flags;        // device address of u32[loops] zeroed counters, or 0
    i64 loops;              // groups looped over inside the launch (1 without layer_flags)
};

__device__ __forceinline__ bool kvt_pair(const KvtParams& p, i64 i, i64& h, i64& d) {
    h = reinterpret_cast<const i64*>(p.host_idx)[i];
    d = reinterpret_cast<const i64*>(p.dev_idx)[i];
    return h >= 0 && h < p.host_pages && d >= 0 && d < p.dev_pages;
}

__device__ __forceinline__ u64 kvt_host_chunk(const KvtParams& p, i64 h, i64 g) {
    return (u64)(p.host_base + h * p.host_page_stride + g * p.host_chunk_stride);
}

__device__ __forceinline__ u64 kvt_dev_chunk(const KvtParams& p, i64 d, i64 g) {
    return reinterpret_cast<const u64*>(p.dev_table)[g] + (u64)(d * p.chunk_bytes);
}

// Block 0 of the launch that covers layer 0 counts the out-of-range pairs (so a per-layer
// transfer counts each bad pair once); the copy loops just skip them.
__device__ __forceinline__ void kvt_count_bad_pairs(const KvtParams& p) {
    if (blockIdx.x != 0 || p.layer0 != 0) return;
    u32 bad = 0;
    for (i64 i = threadIdx.x; i < p.n; i += blockDim.x) {
        i64 h, d;
        bad += kvt_pair(p, i, h, d) ? 0u : 1u;
    }
    if (bad) atomicAdd(reinterpret_cast<u32*>(p.err), bad);
}
