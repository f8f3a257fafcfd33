/* gs_fastpath - the cost of the interposer's launch fast path by itself (gs_admit in gs.h: one
 * atomic load of the slot's lease, one vDSO clock read, compares), in a direct call loop against
 * an empty loop. Prints {"fast_path_ns": …, "empty_loop_ns": …}. */
#include <stdio.h>
#include <stdlib.h>

#include "gs.h"

__thread struct gs_tls gs_tl;
struct gs_global gs;
static long slow_calls;

CUresult gs_admit_slow(struct gs_gpu *g, CUstream stream) { /* refills the thread's cache */
    slow_calls++;
    gs_tl.lease = atomic_load(&g->slot->lease_until_ns);
    gs_tl.stream = stream;
    gs_tl.gpu = g;
    gs_tl.budget = 1 << 30;
    return CUDA_SUCCESS;
}

static double per_call(long n, int admit, struct gs_gpu *g) {
    uint64_t t0 = gs_now();
    unsigned long sink = 0;
    for (long i = 0; i < n; i++) {
        if (admit) sink += (unsigned long)gs_admit(g, (CUstream)0x10);
        __asm__ volatile("" : "+r"(sink));
    }
    return (double)(gs_now() - t0) / (double)n;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 20000000;
    static struct gs_gpu g;
    g.slot = &g.local;
    atomic_store(&g.local.lease_until_ns, gs_now() + 3600ull * 1000000000ull);
    double best_admit = 1e9, best_empty = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double a = per_call(n, 1, &g), e = per_call(n, 0, &g);
        if (a < best_admit) best_admit = a;
        if (e < best_empty) best_empty = e;
    }
    printf("{\"fast_path_ns\":%.2f,\"empty_loop_ns\":%.2f,\"slow_calls\":%ld}\n", best_admit,
           best_empty, slow_calls);
    return 0;
}
