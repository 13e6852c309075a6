// nvidia-tma: page transfers through the Hopper/Blackwell bulk-copy engine (TMA).
//
// Each warp runs its own pipeline of `stages` shared-memory stages. A *piece* is what one
// stage holds: whole host-contiguous segments (mode 0), a run of chunks of one segment
// (mode 1) or part of one chunk (mode 2); see _plan.plan_tma, which mirrors the decoding here.
// Loads (cp.async.bulk global -> shared) complete on the stage's mbarrier; stores
// (cp.async.bulk shared -> global, bulk groups) go out once it has landed. The host side is
// moved in as few operations as its contiguity allows (one per segment); the device side one
// per chunk, or, with a tensor map, one per box of `box_layers` layers x comps chunks of one
// page (the chunks of a page sit at a constant layer/comp stride in the device pool).
// Lanes of the warp issue operations in parallel; only the warp's own data is touched, so the
// warps of a CTA never synchronise after setup.
//
// Per-layer signals (layer_flags != 0): the launch moves `loops` groups of `layers` layers in
// order, each cut exactly as a launch of that group would be, through one continuous pipeline
// (no drain between groups). Once the bulk group holding a pipeline's last store of layer
// group j has completed (its writes are done, `cp.async.bulk.wait_group`), the pipeline fences
// and counts itself in its CTA's shared arrival counter for j (a release at CTA scope). One
// more warp per CTA, which copies nothing, waits for the CTA's pipelines that hold pieces of j
// (acquire at CTA scope) and adds their number to layer_flags[j] with one release at GPU scope
// (system scope for backups); a stream waiting for the counter to reach the number of
// pipelines that hold pieces (cuStreamWaitValue32, GEQ) then sees all of those layers. The wait
// lags one bulk group behind the newest store, so the loads running ahead keep the link busy.
// The GPU-scope release is left to the warp with no bulk loads in flight: issued by a copy
// pipeline it stalled that pipeline about 2 us per group (on the H200, per-layer loads of
// 64 MiB ran at 83-88% of the link that way and at all-layer rates, 92%, without it).
#include "kvt_common.cuh"

#ifndef KVT_STORES_IN_FLIGHT
#define KVT_STORES_IN_FLIGHT 1   // bulk store groups a lane may leave reading a stage
#endif

struct __align__(64) KvtTensorMap { u64 v[16]; };

__device__ __forceinline__ u32 kvt_smem(const void* ptr) {
    return (u32)__cvta_generic_to_shared(ptr);
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "KVT_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra KVT_DONE;\n"
        "bra KVT_WAIT;\n"
        "KVT_DONE:\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_g2s(u32 dst, u64 src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_s2g(u64 dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tmap_g2s(u32 dst, const KvtTensorMap* map, int c0, int c1,
                                         int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
           "r"(bar) : "memory");
}

__device__ __forceinline__ void tmap_s2g(const KvtTensorMap* map, int c0, int c1, int c2, int c3,
                                         u32 src) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
        " [%0, {%2, %3, %4, %5}], [%1];"
        :: "l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// All but the newest bulk group complete, writes included.
__device__ __forceinline__ void bulk_wait_all_but_one() {
    asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
}

__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One piece, decoded (mirrors _plan.Piece). 32-bit: the host keeps pairs, segments and
// pieces below 2^31 (divisions by run-time values are the kernel's main integer cost).
struct Piece {
    u32 seg0;     // first segment
    u32 nseg;     // segments (mode 0), else 1
    u32 chunk0;   // first chunk within the segment (modes 1, 2)
    u32 nchunk;   // chunks per segment covered (mode 0: seg_chunks)
    u32 off;      // byte offset within the chunk (mode 2)
    u32 bytes;    // bytes per chunk covered (mode 2: part size; else chunk_bytes)
};

// Launch constants in 32-bit form, computed once per thread.
struct Consts {
    u32 K, nsegs, per_pair, g0, mode, per_piece, pps, ppc, chunk, slot, comps;
};

__device__ __forceinline__ Consts kvt_consts(const KvtParams& p) {
    Consts c;
    c.K = (u32)p.seg_chunks;
    c.per_pair = (u32)(p.comps * p.layers / p.seg_chunks);
    c.nsegs = (u32)p.n * c.per_pair;
    c.g0 = (u32)(p.layer0 * p.comps);
    c.mode = (u32)p.mode;
    c.per_piece = (u32)p.per_piece;
    c.pps = (u32)p.pieces_per_seg;
    c.ppc = c.mode == 2 ? c.pps / c.K : 1;
    c.chunk = (u32)p.chunk_bytes;
    c.slot = c.mode == 0 ? (u32)p.slot_bytes : 0;
    c.comps = (u32)p.comps;
    return c;
}

__device__ __forceinline__ Piece kvt_piece(const Consts& c, u32 k) {
    Piece pc;
    if (c.mode == 0) {
        pc.seg0 = k * c.per_piece;
        pc.nseg = min(c.per_piece, c.nsegs - pc.seg0);
        pc.chunk0 = 0; pc.nchunk = c.K; pc.off = 0; pc.bytes = c.chunk;
    } else {
        pc.seg0 = k / c.pps; pc.nseg = 1;
        const u32 r = k - pc.seg0 * c.pps;
        if (c.mode == 1) {
            pc.chunk0 = r * c.per_piece;
            pc.nchunk = min(c.per_piece, c.K - pc.chunk0);
            pc.off = 0; pc.bytes = c.chunk;
        } else {
            pc.chunk0 = r / c.ppc; pc.nchunk = 1;
            pc.off = (r - pc.chunk0 * c.ppc) * c.per_piece;
            pc.bytes = min(c.per_piece, c.chunk - pc.off);
        }
    }
    return pc;
}

// Segment s -> pair i and its first chunk g (absolute (layer, comp) index).
__device__ __forceinline__ void kvt_segment(const Consts& c, u32 s, u32& i, u32& g) {
    i = s / c.per_pair;
    g = c.g0 + (s - i * c.per_pair) * c.K;
}

// Issue one side of a piece: `host` selects the host or the device addresses, `load` says
// whether the side is read into shared memory (completing on `bar`) or written from it.
__device__ __forceinline__ void kvt_issue(const KvtParams& p, const Consts& c,
                                          const KvtTensorMap* map, const Piece& pc, bool host,
                                          bool load, u32 stage, u32 bar, int lane) {
    if (host) {   // one op per segment (its covered chunks are host-contiguous)
        const u32 nb = pc.nchunk == 1 ? pc.bytes : pc.nchunk * c.chunk;
        for (u32 k = lane; k < pc.nseg; k += 32) {
            u32 i, g;
            i64 h, d;
            kvt_segment(c, pc.seg0 + k, i, g);
            if (!kvt_pair(p, i, h, d)) continue;
            const u64 a = kvt_host_chunk(p, h, g + pc.chunk0) + pc.off;
            const u32 s = stage + k * c.slot;
            if (load) bulk_g2s(s, a, nb, bar); else bulk_s2g(a, s, nb);
        }
    } else if (p.use_tmap) {   // one box (box_layers layers x comps chunks) per segment
        for (u32 k = lane; k < pc.nseg; k += 32) {
            u32 i, g;
            i64 h, d;
            kvt_segment(c, pc.seg0 + k, i, g);
            if (!kvt_pair(p, i, h, d)) continue;
            const u32 s = stage + k * c.slot;
            // coordinates: (element, device page, comp, layer relative to the map's layer0)
            const int layer = (int)((g + pc.chunk0) / c.comps - (u32)p.layer0);
            if (load) tmap_g2s(s, map, 0, (int)d, 0, layer, bar);
            else tmap_s2g(map, 0, (int)d, 0, layer, s);
        }
    } else {       // one op per chunk
        const u32 total = pc.nseg * pc.nchunk;
        for (u32 t = lane; t < total; t += 32) {
            const u32 k = pc.nchunk == 1 ? t : t / pc.nchunk, j = t - k * pc.nchunk;
            u32 i, g;
            i64 h, d;
            kvt_segment(c, pc.seg0 + k, i, g);
            if (!kvt_pair(p, i, h, d)) continue;
            const u64 a = kvt_dev_chunk(p, d, g + pc.chunk0 + j) + pc.off;
            const u32 s = stage + k * c.slot + j * c.chunk;
            if (load) bulk_g2s(s, a, pc.bytes, bar); else bulk_s2g(a, s, pc.bytes);
        }
    }
}

// Bytes a load of this piece lands in shared memory (valid pairs only; a tensor-map box
// always lands whole, out-of-range layers zero-filled).
__device__ __forceinline__ u32 kvt_load_bytes(const KvtParams& p, const Consts& c,
                                              const Piece& pc, bool host, int lane) {
    const u32 each = (!host && p.use_tmap) ? (u32)(p.box_layers * p.comps) * c.chunk
                     : (pc.nchunk == 1 ? pc.bytes : pc.nchunk * c.chunk);
    u32 mine = 0;
    for (u32 k = lane; k < pc.nseg; k += 32) {
        u32 i, g;
        i64 h, d;
        kvt_segment(c, pc.seg0 + k, i, g);
        if (kvt_pair(p, i, h, d)) mine += each;
    }
    return __reduce_add_sync(0xffffffffu, mine);
}

// This pipeline's part of layer group `group` is written: every lane waited for its bulk
// groups (`cp.async.bulk.wait_group`: the writes are done). Each lane orders its async-proxy
// writes before its generic accesses, the warp synchronises, and lane 0 counts the pipeline in
// the CTA's arrival counter for the group with a release at CTA scope; the CTA's publishing
// warp takes it from there (kvt_publish_groups).
__device__ __forceinline__ void kvt_signal_layer(u32* arrivals, u32 group, int lane) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (lane == 0)
        asm volatile("red.release.cta.shared::cta.add.u32 [%0], 1;"
                     :: "r"(kvt_smem(arrivals + group)) : "memory");
}

// The publishing warp of a CTA: for each layer group in order, the number of this CTA's
// pipelines that hold pieces of it (group g's items g*P .. g*P+P-1 go round-robin to pipelines
// (g*P) mod pipes onwards; mirrored by _plan.group_holders_in_cta), a wait until that many have
// arrived (acquire at CTA scope), then one add of that number to layer_flags[g]: a release at
// GPU scope for loads (the data is in device memory and the waiter is this GPU's stream),
// system scope for backups (the data is in host memory). This warp has no memory operations in
// flight, so the release does not hold up the copies.
__device__ __forceinline__ void kvt_publish_groups(const KvtParams& p, u32* arrivals, u32 warps,
                                                   u32 pipes, u32 P, u32 groups, int lane) {
    for (u32 g = 0; g < groups; ++g) {
        const u32 first = (g * P) % pipes;
        const u32 q = blockIdx.x * warps + (u32)lane;
        const bool holds = (u32)lane < warps && (q + pipes - first) % pipes < P;
        const u32 holders = __popc(__ballot_sync(0xffffffffu, holds));
        if (lane == 0 && holders) {
            const u32 a = kvt_smem(arrivals + g);
            u32 seen;
            for (;;) {
                asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];"
                             : "=r"(seen) : "r"(a) : "memory");
                if (seen >= holders) break;
                __nanosleep(64);
            }
            u32* f = reinterpret_cast<u32*>(p.layer_flags) + g;
            if (p.d2h) asm volatile("red.release.sys.global.add.u32 [%0], %1;"
                                    :: "l"(f), "r"(holders) : "memory");
            else asm volatile("red.release.gpu.global.add.u32 [%0], %1;"
                              :: "l"(f), "r"(holders) : "memory");
        }
        __syncwarp();
    }
}

extern "C" __global__ void __launch_bounds__(1024)
kvt_tma_copy(const KvtParams p, const __grid_constant__ KvtTensorMap tmap) {
    extern __shared__ __align__(128) unsigned char smem[];
    kvt_count_bad_pairs(p);
    const bool flags = p.layer_flags != 0;
    // copy pipelines: every warp, or all but the last (the publishing warp) with layer_flags
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x >> 5) - (flags ? 1 : 0);
    const u32 S = (u32)p.stages, stage_bytes = (u32)p.stage_bytes;
    const u32 groups = flags ? (u32)p.loops : 0u;
    // layout: [warps * S barriers, padded to 128 B][warps * S stages][groups arrival counters]
    const u32 bar_bytes = (warps * S * 8 + 127) & ~127u;
    u32* arrivals = reinterpret_cast<u32*>(smem + bar_bytes + warps * S * stage_bytes);
    const u32 bars = kvt_smem(smem) + warp * S * 8;
    const u32 stages = kvt_smem(smem) + bar_bytes + warp * S * stage_bytes;
    if (warp < warps && lane == 0) {
        for (u32 s = 0; s < S; ++s) mbar_init(bars + s * 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        fence_async_smem();
    }
    if (warp == warps)
        for (u32 g = lane; g < groups; g += 32) arrivals[g] = 0;
    __syncthreads();

    const bool src_host = p.d2h == 0;   // loads read the source side
    const Consts c0 = kvt_consts(p);
    const u32 pipes = gridDim.x * warps;
    const u32 P = (u32)p.num_pieces;
    if (warp == warps) {                // the publishing warp (layer_flags only)
        kvt_publish_groups(p, arrivals, (u32)warps, pipes, P, groups, lane);
        return;
    }
    const u32 pipe = blockIdx.x * warps + warp;
    // Items are (group, piece) pairs in group order, dealt round-robin over the pipelines as
    // one sequence, so no pipeline holds more than one item over another in the whole launch
    // (dealing each group afresh would give the same pipelines a group's extra pieces every
    // time: 2% of the link at 1190 pieces per group over 32 pipelines).
    const u32 Q = P * (flags ? (u32)p.loops : 1u);
    const u32 T = Q > pipe ? (Q - pipe + pipes - 1) / pipes : 0;   // this pipeline's items
    const u32 gstep = (u32)p.layers * c0.comps;                        // chunks per group
    const u32 D = S - 1 - KVT_STORES_IN_FLIGHT;     // loads running ahead of the stores
    const u32 NONE = 0xffffffffu;
    u32 pending = NONE;                              // layer group whose last store is in
                                                     // the newest bulk group committed
    for (u32 it = 0; it < T + D; ++it) {
        if (it < T) {                                // load item `it` into stage it % S
            const u32 q = pipe + it * pipes, lay = q / P, k = q - lay * P;
            const u32 s = it % S;
            Consts c = c0;
            c.g0 += lay * gstep;
            if (it >= S) bulk_wait_read<KVT_STORES_IN_FLIGHT>();  // item it-S read out
            __syncwarp();
            const Piece pc = kvt_piece(c, k);
            const u32 bar = bars + s * 8, stage = stages + s * stage_bytes;
            const u32 nb = kvt_load_bytes(p, c, pc, src_host, lane);
            if (lane == 0) mbar_expect_tx(bar, nb);
            __syncwarp();
            kvt_issue(p, c, &tmap, pc, src_host, true, stage, bar, lane);
        }
        if (it >= D && it - D < T) {                 // store item it-D from its stage
            const u32 cp = it - D, s = cp % S;
            const u32 q = pipe + cp * pipes, lay = q / P, k = q - lay * P;
            const bool last = k + pipes >= P;        // this pipeline's last piece of the group
            Consts c = c0;
            c.g0 += lay * gstep;
            const u32 bar = bars + s * 8, stage = stages + s * stage_bytes;
            mbar_wait(bar, (cp / S) & 1);
            fence_async_smem();
            const Piece pc = kvt_piece(c, k);
            kvt_issue(p, c, &tmap, pc, !src_host, false, stage, bar, lane);
            bulk_commit();
            if (flags) {
                if (pending != NONE) {               // its group is now the second newest
                    bulk_wait_all_but_one();
                    kvt_signal_layer(arrivals, pending, lane);
                    pending = NONE;
                }
                if (last) pending = lay;
            }
        }
    }
    bulk_wait_all();
    if (flags && pending != NONE) kvt_signal_layer(arrivals, pending, lane);
}
