/* release.c - what happens in the process when its share is released while it keeps running
 * (the notebook's Release button, `%gpushare release`, or a release from outside: REST, admin).
 *
 * The daemon marks the allocation's slots GPUSHARE_SLOT_RELEASED. From then on:
 *  - every launch and allocation fails with CUDA_ERROR_NOT_PERMITTED (lease.c, memory.c) and no
 *    new context can be made (the hooks below), with GS_RELEASED_REASON printed once on stderr
 *    and returned by cuGetErrorString for CUDA_ERROR_NOT_PERMITTED;
 *  - the process's GPU memory is given back: every allocation the interposer tracked is freed
 *    with the real driver, then the primary context of each of its GPUs is reset (which frees
 *    what is left, the context itself included).
 * The freeing runs once per process: in the thread that calls gpushare_release_memory() (the
 * notebook side calls it right after the daemon confirmed the release, so the memory is gone when
 * the release returns), or else in the agent thread as soon as it sees the released slot.
 * A released process never gets a CUDA context back: a new share needs a new process (a kernel
 * restart).
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gs.h"

static _Atomic int release_state; /* 0 not yet, 1 freeing, 2 done */
static _Atomic uint64_t released_bytes;

static int any_slot_released(void) {
    for (int i = 0; i < gs.ngpus; i++) {
        struct gpushare_wire_slot *s =
            atomic_load_explicit(&gs.gpu[i].policy, memory_order_acquire);
        if (atomic_load(&s->state) == GPUSHARE_SLOT_RELEASED) return 1;
    }
    return 0;
}

static void free_everything(void) {
    snprintf(gs.deny_reason, sizeof gs.deny_reason, "%s", GS_RELEASED_REASON);
    atomic_store(&gs.denied, 1);
    uint64_t bytes = gs_mem_free_all();
    for (int i = 0; i < gs.ngpus; i++) /* what is left: the context and untracked memory */
        if (real_cuDevicePrimaryCtxReset_v2) real_cuDevicePrimaryCtxReset_v2((CUdevice)i);
    atomic_store(&released_bytes, bytes);
    gs_log("share released: freed %llu tracked bytes", (unsigned long long)bytes);
}

/* Frees the process's GPU memory once the share is released; returns the tracked bytes freed
 * (the same value to every caller), or -1 when the share is not released (nothing is done). */
__attribute__((visibility("default"))) long long gpushare_release_memory(void) {
    gs_init();
    if (!gs.enabled || !any_slot_released()) return -1;
    int expected = 0;
    if (atomic_compare_exchange_strong(&release_state, &expected, 1)) {
        free_everything();
        atomic_store(&release_state, 2);
    }
    while (atomic_load(&release_state) != 2) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return (long long)atomic_load(&released_bytes);
}

void gs_check_released(void) {
    if (atomic_load(&release_state) == 0 && any_slot_released()) gpushare_release_memory();
}

/* -- no new contexts once released ---------------------------------------------------------- */

static CUresult refuse_if_released(void) {
    gs_init();
    if (gs.enabled && atomic_load(&gs.denied)) {
        gs_deny_message();
        return CUDA_ERROR_NOT_PERMITTED;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult r = refuse_if_released();
    if (r != CUDA_SUCCESS) return r;
    if (!real_cuDevicePrimaryCtxRetain) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuDevicePrimaryCtxRetain(pctx, dev);
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CUresult r = refuse_if_released();
    if (r != CUDA_SUCCESS) return r;
    if (!real_cuCtxCreate_v2) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev) {
    CUresult r = refuse_if_released();
    if (r != CUDA_SUCCESS) return r;
    if (!real_cuCtxCreate_v3) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev) {
    CUresult r = refuse_if_released();
    if (r != CUDA_SUCCESS) return r;
    if (!real_cuCtxCreate_v4) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev);
}

/* -- the reason, where programs look for it ------------------------------------------------- */

/* Driver-API programs (CuPy, Numba, ...) print cuGetErrorString's text: once this process is
 * refused, CUDA_ERROR_NOT_PERMITTED reads as the reason (why, and what to do). */
CUresult cuGetErrorString(CUresult error, const char **pStr) {
    gs_resolve();
    if (error == CUDA_ERROR_NOT_PERMITTED && pStr && gs.enabled && atomic_load(&gs.denied) &&
        gs.deny_reason[0]) {
        *pStr = gs.deny_reason;
        return CUDA_SUCCESS;
    }
    if (!real_cuGetErrorString) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuGetErrorString(error, pStr);
}
