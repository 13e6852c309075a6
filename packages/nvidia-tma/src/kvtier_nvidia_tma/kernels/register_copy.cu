// nvidia-register: page transfers with vectorised 16-byte register copies.
//
// The launch's chunks are one flat space of 16-byte vectors; every thread of a grid-stride
// loop loads UNROLL independent vectors before storing any, so UNROLL * 16 bytes per thread
// are in flight (PCIe reads need ~70 KB in flight to cover the link's latency).
#include "kvt_common.cuh"

__device__ __forceinline__ uint4 ld_global_v4(u64 a) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(a));
    return r;
}

__device__ __forceinline__ void st_global_v4(u64 a, const uint4& r) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(a), "r"(r.x), "r"(r.y), "r"(r.z), "r"(r.w) : "memory");
}

template <int UNROLL>
__device__ __forceinline__ void kvt_register_copy(const KvtParams& p) {
    kvt_count_bad_pairs(p);
    const u32 vpc = (u32)(p.chunk_bytes >> 4);             // vectors per chunk
    const u32 G = (u32)(p.comps * p.layers);               // chunks per pair in this launch
    const u32 g0 = (u32)(p.layer0 * p.comps);
    const u32 V = (u32)p.n * G * vpc;                      // host keeps this < 2^31
    const u32 T = gridDim.x * blockDim.x;
    for (u32 base = blockIdx.x * blockDim.x + threadIdx.x; base < V; base += T * UNROLL) {
        uint4 r[UNROLL];
        u64 dst[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            dst[u] = 0;
            const u32 v = base + (u32)u * T;
            if (v < V) {
                const u32 q = v / vpc, off = (v - q * vpc) << 4;
                const u32 i = q / G, g = g0 + (q - i * G);
                i64 h, d;
                if (kvt_pair(p, i, h, d)) {
                    const u64 ha = kvt_host_chunk(p, h, g) + off;
                    const u64 da = kvt_dev_chunk(p, d, g) + off;
                    dst[u] = p.d2h ? ha : da;
                    r[u] = ld_global_v4(p.d2h ? da : ha);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (dst[u]) st_global_v4(dst[u], r[u]);
    }
}

extern "C" __global__ void __launch_bounds__(1024) kvt_register_u2(const KvtParams p) {
    kvt_register_copy<2>(p);
}
extern "C" __global__ void __launch_bounds__(1024) kvt_register_u4(const KvtParams p) {
    kvt_register_copy<4>(p);
}
extern "C" __global__ void __launch_bounds__(1024) kvt_register_u8(const KvtParams p) {
    kvt_register_copy<8>(p);
}
