/* memory.c - the memory cap: every allocation path reserves against the slot's cap with a
 * compare-and-swap before calling the driver and rolls back when the driver fails, so no
 * interleaving of threads and processes can take an allocation over its cap; a refused call
 * returns CUDA_ERROR_OUT_OF_MEMORY. Frees give the bytes back (the sizes are remembered per
 * pointer / handle / array). cuMemGetInfo, cuDeviceTotalMem and NVML's memory info report the
 * cap as the device's total.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs.h"

enum { KIND_PTR = 0, KIND_HANDLE = 1, KIND_ARRAY = 2 };

/* -- the reservation ------------------------------------------------------------------------ */

int gs_mem_reserve(struct gs_gpu *g, uint64_t bytes) {
    struct gpushare_wire_slot *s = atomic_load_explicit(&g->account, memory_order_acquire);
    uint64_t cap = atomic_load(&atomic_load_explicit(&g->policy, memory_order_acquire)->mem_cap);
    uint64_t cur = atomic_load(&s->mem_used);
    do {
        if (bytes > cap || cur > cap - bytes) {
            atomic_fetch_add(&s->oom_count, 1);
            return -1;
        }
    } while (!atomic_compare_exchange_weak(&s->mem_used, &cur, cur + bytes));
    uint64_t peak = atomic_load(&s->mem_peak);
    while (peak < cur + bytes && !atomic_compare_exchange_weak(&s->mem_peak, &peak, cur + bytes)) {}
    atomic_fetch_add(&g->proc_mem, bytes);
    return 0;
}

static void sub_floor(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = atomic_load(p);
    while (!atomic_compare_exchange_weak(p, &cur, cur > v ? cur - v : 0)) {}
}

void gs_mem_unreserve(struct gs_gpu *g, uint64_t bytes) {
    struct gpushare_wire_slot *s = atomic_load_explicit(&g->account, memory_order_acquire);
    sub_floor(&s->mem_used, bytes);
    sub_floor(&g->proc_mem, bytes);
}

/* -- what was allocated: a striped hash of (kind, key) -> (gpu, bytes) ---------------------- */

#define STRIPES 256
struct entry {
    uint64_t key;
    int kind;
    struct gs_gpu *gpu;
    uint64_t bytes;
    struct entry *next;
};
static struct {
    pthread_mutex_t lock;
    struct entry *head;
} table[STRIPES] = {[0 ... STRIPES - 1] = {PTHREAD_MUTEX_INITIALIZER, NULL}};

static unsigned stripe(uint64_t key, int kind) {
    uint64_t h = (key ^ (uint64_t)kind * 0x9e3779b97f4a7c15ull) * 0xff51afd7ed558ccdull;
    return (unsigned)(h >> 56) % STRIPES;
}

void gs_mem_track(uint64_t key, int kind, struct gs_gpu *g, uint64_t bytes) {
    struct entry *e = malloc(sizeof *e);
    if (!e) return; /* the bytes stay reserved: safe side */
    *e = (struct entry){key, kind, g, bytes, NULL};
    unsigned i = stripe(key, kind);
    pthread_mutex_lock(&table[i].lock);
    e->next = table[i].head;
    table[i].head = e;
    pthread_mutex_unlock(&table[i].lock);
}

/* Removes an entry; returns its bytes (0 if unknown) and gpu. */
static uint64_t untrack(uint64_t key, int kind, struct gs_gpu **g) {
    unsigned i = stripe(key, kind);
    uint64_t bytes = 0;
    *g = NULL;
    pthread_mutex_lock(&table[i].lock);
    for (struct entry **pp = &table[i].head; *pp; pp = &(*pp)->next) {
        struct entry *e = *pp;
        if (e->key == key && e->kind == kind) {
            *pp = e->next;
            bytes = e->bytes;
            *g = e->gpu;
            free(e);
            break;
        }
    }
    pthread_mutex_unlock(&table[i].lock);
    return bytes;
}

uint64_t gs_mem_untrack(uint64_t key, int kind) {
    struct gs_gpu *g;
    uint64_t bytes = untrack(key, kind, &g);
    if (g && bytes) gs_mem_unreserve(g, bytes);
    return bytes;
}

void gs_mem_reset_after_fork(void) {
    for (int i = 0; i < STRIPES; i++) pthread_mutex_init(&table[i].lock, NULL);
}

/* -- shared shape of the allocation wrappers ------------------------------------------------ */

/* Before an allocation: the GPU to charge (NULL: not enforced), or a refusal in *err. */
static struct gs_gpu *alloc_gpu(CUresult *err) {
    *err = CUDA_SUCCESS;
    struct gs_gpu *g = gs_current_gpu();
    if (gs.enabled && atomic_load(&gs.denied)) {
        gs_deny_message();
        *err = CUDA_ERROR_NOT_PERMITTED;
        return NULL;
    }
    if (g && atomic_load(&g->policy->state) == GPUSHARE_SLOT_RELEASED) {
        snprintf(gs.deny_reason, sizeof gs.deny_reason, "%s", GS_RELEASED_REASON);
        atomic_store(&gs.denied, 1);
        gs_deny_message();
        *err = CUDA_ERROR_NOT_PERMITTED;
        return NULL;
    }
    return g;
}

#define RESERVE(g, bytes)                                                                          \
    do {                                                                                           \
        if ((g) && gs_mem_reserve((g), (bytes)) != 0) return CUDA_ERROR_OUT_OF_MEMORY;             \
    } while (0)

/* After the driver call: keep the reservation (and remember it) or roll it back. */
static CUresult settle(CUresult r, struct gs_gpu *g, uint64_t bytes, uint64_t key, int kind) {
    if (!g) return r;
    if (r == CUDA_SUCCESS)
        gs_mem_track(key, kind, g, bytes);
    else
        gs_mem_unreserve(g, bytes);
    return r;
}

#define REAL_OR(name)                                                                              \
    do {                                                                                           \
        gs_resolve();                                                                              \
        if (!real_##name) return CUDA_ERROR_NOT_SUPPORTED;                                         \
    } while (0)

#define SIMPLE_ALLOC(name, bytes_expr, call)                                                       \
    {                                                                                              \
        REAL_OR(name);                                                                             \
        CUresult err;                                                                              \
        struct gs_gpu *g = alloc_gpu(&err);                                                        \
        if (err != CUDA_SUCCESS) return err;                                                       \
        uint64_t bytes = (bytes_expr);                                                             \
        RESERVE(g, bytes);                                                                         \
        CUresult r = call;                                                                         \
        return settle(r, g, bytes, r == CUDA_SUCCESS ? (uint64_t)*dptr : 0, KIND_PTR);             \
    }

/* -- device memory -------------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
    SIMPLE_ALLOC(cuMemAlloc_v2, bytesize, real_cuMemAlloc_v2(dptr, bytesize))

        CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
            SIMPLE_ALLOC(cuMemAllocManaged, bytesize, real_cuMemAllocManaged(dptr, bytesize, flags))

                CUresult
    cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
        SIMPLE_ALLOC(cuMemAllocAsync, bytesize, real_cuMemAllocAsync(dptr, bytesize, hStream))

            CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
                SIMPLE_ALLOC(cuMemAllocAsync_ptsz, bytesize,
                             real_cuMemAllocAsync_ptsz(dptr, bytesize, hStream))

                    CUresult
    cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
        SIMPLE_ALLOC(cuMemAllocFromPoolAsync, bytesize,
                     real_cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream))

            CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                  CUmemoryPool pool, CUstream hStream)
                SIMPLE_ALLOC(cuMemAllocFromPoolAsync_ptsz, bytesize,
                             real_cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, hStream))

                    CUresult
    cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                       unsigned int ElementSizeBytes) {
    REAL_OR(cuMemAllocPitch_v2);
    CUresult err;
    struct gs_gpu *g = alloc_gpu(&err);
    if (err != CUDA_SUCCESS) return err;
    uint64_t estimate = (uint64_t)((WidthInBytes + 511) / 512 * 512) * Height;
    RESERVE(g, estimate);
    CUresult r = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS || !g) return settle(r, g, estimate, 0, KIND_PTR);
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > estimate && gs_mem_reserve(g, actual - estimate) != 0) {
        real_cuMemFree_v2 ? real_cuMemFree_v2(*dptr) : CUDA_SUCCESS;
        gs_mem_unreserve(g, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) gs_mem_unreserve(g, estimate - actual);
    return settle(r, g, actual, (uint64_t)*dptr, KIND_PTR);
}

/* Frees: forget first (so a concurrent allocation reusing the address is not mistaken for this
 * one), then free; if the driver refuses, the bytes are still in use: reserve them again. */
#define SIMPLE_FREE(name, key, kind, call)                                                         \
    {                                                                                              \
        REAL_OR(name);                                                                             \
        gs_init();                                                                                 \
        struct gs_gpu *g;                                                                          \
        uint64_t bytes = untrack((uint64_t)(key), (kind), &g);                                     \
        CUresult r = call;                                                                         \
        if (g && bytes) {                                                                          \
            if (r == CUDA_SUCCESS)                                                                 \
                gs_mem_unreserve(g, bytes);                                                        \
            else                                                                                   \
                gs_mem_track((uint64_t)(key), (kind), g, bytes);                                   \
        }                                                                                          \
        return r;                                                                                  \
    }

CUresult cuMemFree_v2(CUdeviceptr dptr)
    SIMPLE_FREE(cuMemFree_v2, dptr, KIND_PTR, real_cuMemFree_v2(dptr))

        CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
            SIMPLE_FREE(cuMemFreeAsync, dptr, KIND_PTR, real_cuMemFreeAsync(dptr, hStream))

                CUresult
    cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
        SIMPLE_FREE(cuMemFreeAsync_ptsz, dptr, KIND_PTR, real_cuMemFreeAsync_ptsz(dptr, hStream))

    /* -- virtual memory management -------------------------------------------------------------- */

    CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags) {
    REAL_OR(cuMemCreate);
    CUresult err;
    struct gs_gpu *g = alloc_gpu(&err);
    if (err != CUDA_SUCCESS) return err;
    if (prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && gs.ngpus > 1)
        g = gs_gpu_of_ordinal(prop->location.id);
    if (prop && prop->location.type == CU_MEM_LOCATION_TYPE_HOST) g = NULL; /* host memory */
    RESERVE(g, size);
    CUresult r = real_cuMemCreate(handle, size, prop, flags);
    return settle(r, g, size, r == CUDA_SUCCESS ? (uint64_t)*handle : 0, KIND_HANDLE);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
    SIMPLE_FREE(cuMemRelease, handle, KIND_HANDLE, real_cuMemRelease(handle))

    /* -- arrays --------------------------------------------------------------------------------- */

    static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case 0x01:
    case 0x08:
        return 1; /* (UN)SIGNED_INT8 */
    case 0x02:
    case 0x09:
    case 0x10:
        return 2; /* INT16, HALF */
    case 0x03:
    case 0x0a:
    case 0x20:
        return 4; /* INT32, FLOAT */
    default:
        return 16; /* wider/compressed formats: count generously */
    }
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch) {
    return (uint64_t)w * (h ? h : 1) * (d ? d : 1) * (ch ? ch : 1) * format_bytes(f);
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    REAL_OR(cuArrayCreate_v2);
    CUresult err;
    struct gs_gpu *g = alloc_gpu(&err);
    if (err != CUDA_SUCCESS) return err;
    uint64_t bytes =
        desc ? array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels) : 0;
    RESERVE(g, bytes);
    CUresult r = real_cuArrayCreate_v2(pHandle, desc);
    return settle(r, g, bytes, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, KIND_ARRAY);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    REAL_OR(cuArray3DCreate_v2);
    CUresult err;
    struct gs_gpu *g = alloc_gpu(&err);
    if (err != CUDA_SUCCESS) return err;
    uint64_t bytes =
        desc ? array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels)
             : 0;
    RESERVE(g, bytes);
    CUresult r = real_cuArray3DCreate_v2(pHandle, desc);
    return settle(r, g, bytes, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, KIND_ARRAY);
}

CUresult cuArrayDestroy(CUarray hArray)
    SIMPLE_FREE(cuArrayDestroy, (uintptr_t)hArray, KIND_ARRAY, real_cuArrayDestroy(hArray))

    /* -- what the process is told ---------------------------------------------------------------- */

    static void report(struct gs_gpu *g, uint64_t *free_b, uint64_t *total_b) {
    uint64_t cap = atomic_load(&atomic_load_explicit(&g->policy, memory_order_acquire)->mem_cap);
    if (cap == 0 || cap == UINT64_MAX) return;
    uint64_t used = atomic_load(&atomic_load_explicit(&g->account, memory_order_acquire)->mem_used);
    uint64_t total = cap < *total_b ? cap : *total_b;
    uint64_t left = used < total ? total - used : 0;
    *total_b = total;
    *free_b = left < *free_b ? left : *free_b;
}

static CUresult mem_info(CUresult r, size_t *free_b, size_t *total_b) {
    if (r != CUDA_SUCCESS || !free_b || !total_b) return r;
    struct gs_gpu *g = gs_current_gpu();
    if (g) {
        uint64_t f = *free_b, t = *total_b;
        report(g, &f, &t);
        *free_b = (size_t)f;
        *total_b = (size_t)t;
    }
    return r;
}

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    REAL_OR(cuMemGetInfo_v2);
    return mem_info(real_cuMemGetInfo_v2(free_b, total_b), free_b, total_b);
}

static CUresult total_mem(CUresult r, size_t *bytes, CUdevice dev) {
    if (r != CUDA_SUCCESS || !bytes) return r;
    struct gs_gpu *g = gs_gpu_of_ordinal(dev);
    if (g) {
        uint64_t f = *bytes, t = *bytes;
        report(g, &f, &t);
        *bytes = (size_t)t;
    }
    return r;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    REAL_OR(cuDeviceTotalMem_v2);
    return total_mem(real_cuDeviceTotalMem_v2(bytes, dev), bytes, dev);
}

/* -- NVML inside a share ---------------------------------------------------------------------
 *
 * On a GPU of this process's share, NVML describes the share, so that memory and process lists
 * agree with each other (what monitoring tools such as nvitop and gpustat show): the memory total
 * is the share's cap, "used" is the share's own use (its reservations, or what its processes hold
 * when that is more), and the process lists show only the share's own processes - those whose
 * environment names this allocation (GPUSHARE_ALLOCATION_ID). Other tenants are left out, as a
 * container does not see another container's processes; a process we cannot inspect (another
 * user's) is never ours. GPUs outside the share are reported as the driver reports them. */

/* The share's GPU behind an NVML handle (found by UUID), or NULL. */
static struct gs_gpu *nvml_gpu(nvmlDevice_t device) {
    gs_init();
    if (!gs.enabled || !real_nvmlDeviceGetUUID || !gs.allocation[0]) return NULL;
    char uuid[96] = "";
    if (real_nvmlDeviceGetUUID(device, uuid, sizeof uuid) != 0) return NULL;
    for (int i = 0; i < gs.ngpus; i++)
        if (strcmp(gs.gpu[i].uuid, uuid) == 0) return &gs.gpu[i];
    return NULL;
}

/* The agent's list of the share's connected processes (gs_agent_pids; host pids in a kernel
 * pod), asked at most about once a second. The lock is the NVML hooks' alone (never on a launch
 * path) and is not held while asking. `self` is this process's pid as the agent sees it: when it
 * is not getpid(), we run in a pid namespace of our own (a pod) whose /proc cannot see the pids
 * the driver reports, and only this list tells our processes apart.
 *
 * Degraded: with no list (the agent does not answer, or predates `pids`) /proc is asked only when
 * we share the driver's pid namespace - the agent once said so, or, never told, this is the
 * initial pid namespace. In a pid namespace of our own, the driver's host pids name other
 * processes in our /proc (pids are reused; one may be the share's while the driver means another
 * tenant's), so nothing is taken for the share's: its process lists are empty, its memory use is
 * its own account, and stderr says so once per outage. */
#define NVML_PIDS_MAX      256
#define NVML_PIDS_EVERY_NS 1000000000ull
#define NVML_NS_UNKNOWN    0
#define NVML_NS_SHARED     1 /* the agent sees our pid as ours: /proc names what the driver does */
#define NVML_NS_OWN        2 /* a pid namespace of our own: only the agent's list can tell */
#define NVML_DEGRADED      (-2)
static struct {
    pthread_mutex_t lock;
    uint64_t asked_ns; /* 0: never */
    unsigned asker;    /* getpid() of the asker: a forked child asks afresh */
    int n;             /* -1: the agent gave no list */
    unsigned self;
    int ns; /* NVML_NS_*, from the agent's last list (a forked child shares the namespace) */
    unsigned pid[NVML_PIDS_MAX];
} nvml_pids = {.lock = PTHREAD_MUTEX_INITIALIZER, .n = -1};
static _Atomic int nvml_degraded_said;

/* Whether this process runs outside the initial pid namespace (PROC_PID_INIT_INO, 0xEFFFFFFC, is
 * the kernel's fixed inode for it); unreadable counts as outside (nothing proves otherwise). */
static int nvml_in_pid_namespace(void) {
    static _Atomic int known; /* 0: not looked yet, 1: initial, 2: another */
    int k = atomic_load(&known);
    if (!k) {
        char link[64];
        ssize_t n = readlink("/proc/self/ns/pid", link, sizeof link - 1);
        if (n > 0) link[n] = 0;
        k = n > 0 && strcmp(link, "pid:[4026531836]") == 0 ? 1 : 2;
        atomic_store(&known, k);
    }
    return k == 2;
}

static void nvml_say_degraded(void) {
    if (atomic_exchange(&nvml_degraded_said, 1)) return;
    fprintf(stderr,
            "gpushare: NVML is degraded: the node agent does not answer, and in a pid namespace of "
            "its own (a kernel pod) this process cannot tell its share's processes from others "
            "by the driver's process ids; the share's process lists are empty and its memory use "
            "is its own account until the agent answers again\n");
}

/* 1: `pid` is in the agent's list (or is us as the agent sees us); 0: it is not; -1: we share
 * the agent's pid namespace or it gave no list and we share the driver's (look in /proc);
 * NVML_DEGRADED: no list, and /proc cannot tell. */
static int nvml_agent_says(unsigned pid) {
    pthread_mutex_lock(&nvml_pids.lock);
    uint64_t now = gs_now();
    unsigned me = (unsigned)getpid();
    int ask = !nvml_pids.asked_ns || now - nvml_pids.asked_ns >= NVML_PIDS_EVERY_NS ||
              nvml_pids.asker != me;
    if (ask) {
        nvml_pids.asked_ns = now ? now : 1;
        nvml_pids.asker = me;
    }
    pthread_mutex_unlock(&nvml_pids.lock);
    if (ask) {
        unsigned got[NVML_PIDS_MAX], self = 0;
        int n = gs_agent_pids(got, NVML_PIDS_MAX, &self);
        pthread_mutex_lock(&nvml_pids.lock);
        nvml_pids.n = n;
        nvml_pids.self = self;
        if (n > 0) memcpy(nvml_pids.pid, got, (size_t)n * sizeof *got);
        pthread_mutex_unlock(&nvml_pids.lock);
    }
    int says = -1;
    pthread_mutex_lock(&nvml_pids.lock);
    if (nvml_pids.n >= 0 && nvml_pids.asker == me) {
        nvml_pids.ns = nvml_pids.self != me ? NVML_NS_OWN : NVML_NS_SHARED;
        atomic_store(&nvml_degraded_said, 0); /* the agent answers: say it again next outage */
        if (nvml_pids.self != me) {
            says = pid == nvml_pids.self;
            for (int i = 0; i < nvml_pids.n && !says; i++) says = nvml_pids.pid[i] == pid;
        }
    } else if (nvml_pids.ns == NVML_NS_OWN ||
               (nvml_pids.ns == NVML_NS_UNKNOWN && nvml_in_pid_namespace())) {
        says = NVML_DEGRADED;
    }
    pthread_mutex_unlock(&nvml_pids.lock);
    return says;
}

/* Whether process `pid` (as the driver reports it) belongs to this share. In a pid namespace of
 * our own (a kernel pod; the driver reports host pids): whether the agent lists it, and no
 * process while it gives no list (degraded, said once). Otherwise:
 * this process, or one whose environment holds GPUSHARE_ALLOCATION_ID=<ours> (read from /proc; a
 * process we may not read is not ours). */
static int nvml_own_pid(unsigned pid) {
    int says = nvml_agent_says(pid);
    if (says == NVML_DEGRADED) nvml_say_degraded();
    if (says >= 0 || says == NVML_DEGRADED) return says > 0;
    if (pid == (unsigned)getpid()) return 1;
    char want[96], path[48], buf[4096];
    size_t wn = (size_t)snprintf(want, sizeof want, "GPUSHARE_ALLOCATION_ID=%s", gs.allocation);
    if (wn >= sizeof want) return 0;
    snprintf(path, sizeof path, "/proc/%u/environ", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    size_t k = 0; /* bytes of `want` matched by the current entry */
    int match = 1, found = 0;
    ssize_t n;
    while (!found && (n = read(fd, buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < n && !found; i++) {
            if (buf[i] == 0) {
                found = match && k == wn;
                k = 0;
                match = 1;
            } else if (match) {
                match = k < wn && buf[i] == want[k];
                k += (size_t)match;
            }
        }
    }
    close(fd);
    return found;
}

/* Keeps the share's own entries of an array of `n` entries of `size` bytes whose pid is at
 * `pid_at`, in order; returns how many are left. */
static unsigned nvml_keep_own(void *array, unsigned n, size_t size, size_t pid_at) {
    char *base = array;
    unsigned kept = 0;
    for (unsigned i = 0; i < n; i++) {
        unsigned pid;
        memcpy(&pid, base + i * size + pid_at, sizeof pid);
        if (!nvml_own_pid(pid)) continue;
        if (kept != i) memmove(base + kept * size, base + i * size, size);
        kept++;
    }
    return kept;
}

/* What the share's processes hold on the device, as the driver counts it (0 if unknown). */
static unsigned long long nvml_own_bytes(nvmlDevice_t device) {
    nvmlProcessInfo_t infos[64];
    unsigned n = 64;
    unsigned long long sum = 0;
    if (real_nvmlDeviceGetComputeRunningProcesses_v3) {
        if (real_nvmlDeviceGetComputeRunningProcesses_v3(device, &n, infos) != 0) return 0;
    } else if (real_nvmlDeviceGetComputeRunningProcesses_v2) {
        if (real_nvmlDeviceGetComputeRunningProcesses_v2(device, &n, infos) != 0) return 0;
    } else {
        return 0;
    }
    for (unsigned i = 0; i < n && i < 64; i++)
        if (infos[i].usedGpuMemory != ~0ull && nvml_own_pid(infos[i].pid))
            sum += infos[i].usedGpuMemory;
    return sum;
}

/* The share's memory on a GPU of the share: total = cap, used = its own use, free = the rest. */
static int nvml_share_memory(nvmlDevice_t device, unsigned long long *total,
                             unsigned long long *free_b, unsigned long long *used) {
    struct gs_gpu *g = nvml_gpu(device);
    if (!g) return 0;
    uint64_t f = *free_b, t = *total;
    report(g, &f, &t);
    if (t == *total) return 0; /* no cap below the device's memory */
    uint64_t own = atomic_load(&atomic_load_explicit(&g->account, memory_order_acquire)->mem_used);
    unsigned long long held = nvml_own_bytes(device);
    if (held > own) own = held;
    *total = t;
    *used = own < t ? own : t;
    *free_b = t - *used < f ? t - *used : f;
    return 1;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    gs_resolve();
    if (!real_nvmlDeviceGetMemoryInfo) return 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo(device, memory);
    if (r == 0 && memory) nvml_share_memory(device, &memory->total, &memory->free, &memory->used);
    return r;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    gs_resolve();
    if (!real_nvmlDeviceGetMemoryInfo_v2) return 13;
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    if (r == 0 && memory && nvml_share_memory(device, &memory->total, &memory->free, &memory->used))
        memory->reserved = 0;
    return r;
}

/* The process lists: the driver's answer, then only the share's own entries on its GPUs. */
#define GS_NVML_PROCESS_LIST(name, type)                                                           \
    nvmlReturn_t name(nvmlDevice_t device, unsigned int *count, type *infos) {                     \
        gs_resolve();                                                                              \
        if (!real_##name) return 13;                                                               \
        nvmlReturn_t r = real_##name(device, count, infos);                                        \
        if (r == 0 && count && infos && nvml_gpu(device))                                          \
            *count = nvml_keep_own(infos, *count, sizeof *infos, offsetof(type, pid));             \
        return r;                                                                                  \
    }
GS_NVML_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
GS_NVML_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)
#undef GS_NVML_PROCESS_LIST

nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                   nvmlProcessDetailList_v1_t *plist) {
    gs_resolve();
    if (!real_nvmlDeviceGetRunningProcessDetailList) return 13;
    nvmlReturn_t r = real_nvmlDeviceGetRunningProcessDetailList(device, plist);
    if (r == 0 && plist && plist->procArray && nvml_gpu(device))
        plist->numProcArrayEntries =
            nvml_keep_own(plist->procArray, plist->numProcArrayEntries, sizeof *plist->procArray,
                          offsetof(nvmlProcessDetail_v1_t, pid));
    return r;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeen) {
    gs_resolve();
    if (!real_nvmlDeviceGetProcessUtilization) return 13;
    nvmlReturn_t r = real_nvmlDeviceGetProcessUtilization(device, samples, count, lastSeen);
    if (r == 0 && count && samples && nvml_gpu(device))
        *count = nvml_keep_own(samples, *count, sizeof *samples,
                               offsetof(nvmlProcessUtilizationSample_t, pid));
    return r;
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                   nvmlProcessesUtilizationInfo_v1_t *info) {
    gs_resolve();
    if (!real_nvmlDeviceGetProcessesUtilizationInfo) return 13;
    nvmlReturn_t r = real_nvmlDeviceGetProcessesUtilizationInfo(device, info);
    if (r == 0 && info && info->procUtilArray && nvml_gpu(device))
        info->processSamplesCount = nvml_keep_own(info->procUtilArray, info->processSamplesCount,
                                                  sizeof *info->procUtilArray,
                                                  offsetof(nvmlProcessUtilizationInfo_v1_t, pid));
    return r;
}

/* -- after a release (release.c) ----------------------------------------------------------- */

/* Frees one tracked allocation: in the current context, else in its GPU's primary context. */
static CUresult free_one(const struct entry *e) {
    for (int attempt = 0; attempt < 2; attempt++) {
        CUcontext pushed = NULL;
        if (attempt == 1) {
            int ordinal = (int)(e->gpu - gs.gpu);
            if (!real_cuDevicePrimaryCtxRetain ||
                real_cuDevicePrimaryCtxRetain(&pushed, (CUdevice)ordinal) != CUDA_SUCCESS)
                return CUDA_ERROR_INVALID_CONTEXT;
            if (real_cuCtxPushCurrent_v2) real_cuCtxPushCurrent_v2(pushed);
        }
        CUresult r = CUDA_ERROR_NOT_SUPPORTED;
        if (e->kind == KIND_PTR && real_cuMemFree_v2) r = real_cuMemFree_v2((CUdeviceptr)e->key);
        if (e->kind == KIND_HANDLE && real_cuMemRelease) r = real_cuMemRelease(e->key);
        if (e->kind == KIND_ARRAY && real_cuArrayDestroy)
            r = real_cuArrayDestroy((CUarray)(uintptr_t)e->key);
        if (pushed) {
            CUcontext popped;
            if (real_cuCtxPopCurrent_v2) real_cuCtxPopCurrent_v2(&popped);
            if (real_cuDevicePrimaryCtxRelease_v2)
                real_cuDevicePrimaryCtxRelease_v2((CUdevice)(int)(e->gpu - gs.gpu));
        }
        if (r == CUDA_SUCCESS || attempt == 1) return r;
    }
    return CUDA_ERROR_INVALID_CONTEXT;
}

uint64_t gs_mem_free_all(void) {
    uint64_t freed = 0;
    for (int i = 0; i < STRIPES; i++) {
        for (;;) {
            pthread_mutex_lock(&table[i].lock);
            struct entry *e = table[i].head;
            if (e) table[i].head = e->next;
            pthread_mutex_unlock(&table[i].lock);
            if (!e) break;
            free_one(e);
            if (e->gpu) gs_mem_unreserve(e->gpu, e->bytes);
            freed += e->bytes;
            free(e);
        }
    }
    return freed;
}
