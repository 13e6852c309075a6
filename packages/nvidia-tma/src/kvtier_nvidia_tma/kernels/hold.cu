// Measurement kernels for kvtier_nvidia_tma.limits.
//
// kvt_hold: occupies its SMs for `ns` nanoseconds and moves no data.
//
// Launched with a transfer kernel's grid, block and dynamic shared memory, it takes the same
// SMs for the same time without touching memory, so a concurrent workload's slowdown under it
// is what SM occupancy alone costs (kvtier_nvidia_tma.limits). One thread per warp polls the
// global timer; the others wait at the barrier.
extern "C" __global__ void __launch_bounds__(1024) kvt_hold(unsigned long long ns) {
    extern __shared__ unsigned char smem[];
    if ((threadIdx.x & 31) == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do {
            __nanosleep(2000);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        } while (t - t0 < ns);
        if (ns == 0) smem[threadIdx.x] = 0;    // never taken: keeps the allocation referenced
    }
    __syncthreads();
}

// kvt_read_latency: one thread follows a chain of `n` dependent 8-byte reads through `chain`
// (each element holds the index of the next) and writes the elapsed nanoseconds to out[0] and
// the last index to out[1]. Placed in registered host memory, each step is one PCIe read round
// trip, so out[0] / n is the read latency seen while other traffic shares the link.
extern "C" __global__ void kvt_read_latency(const unsigned long long* chain, unsigned int n,
                                            unsigned long long* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long idx = 0, t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0) :: "memory");
    for (unsigned int i = 0; i < n; ++i)
        asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(idx) : "l"(chain + idx) : "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1) :: "memory");
    out[0] = t1 - t0;
    out[1] = idx;
}
