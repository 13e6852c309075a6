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
