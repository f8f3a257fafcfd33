/* cuda_context.c - cuInit, devices and their attributes, primary and regular contexts. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "sim_cuda.h"

static _Atomic int initialised;
static uint64_t kernel_default_ns = 5000;
static uint64_t queue_ahead_ns = SIM_QUEUE_AHEAD_NS;
static uint64_t context_bytes; /* device memory a context takes for itself (default none) */

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st *all_contexts;
static struct CUctx_st primary[SIM_MAX_DEVICES];
static unsigned primary_refs[SIM_MAX_DEVICES];
static unsigned primary_flags[SIM_MAX_DEVICES];
static _Atomic unsigned long long next_ctx_id = 1;

#define CTX_STACK 32
static __thread struct CUctx_st *ctx_stack[CTX_STACK];
static __thread int ctx_depth;

uint64_t sim_kernel_default_ns(void) {
    return kernel_default_ns;
}
uint64_t sim_queue_ahead_ns(void) {
    return queue_ahead_ns;
}

CUresult sim_ready(void) {
    return atomic_load_explicit(&initialised, memory_order_acquire) ? CUDA_SUCCESS
                                                                    : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_device_ordinal(CUdevice dev) {
    SIM_TRY(sim_ready());
    if (dev < 0 || dev >= sim_cuda_count()) return CUDA_ERROR_INVALID_DEVICE;
    /* the shared state is anybody's to write: a damaged device record is an error, not a crash */
    return sim_dev_sound(sim_cuda_slot(dev)) ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
}

struct CUctx_st *sim_current(void) {
    struct CUctx_st *c = ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL;
    return c && atomic_load(&c->alive) ? c : NULL;
}

CUresult sim_current_ctx(struct CUctx_st **out) {
    SIM_TRY(sim_ready());
    *out = sim_current();
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult check_ctx(CUcontext c) {
    if (!c || c->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    return atomic_load(&c->alive) ? CUDA_SUCCESS : CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

/* -- init ------------------------------------------------------------------------------------- */

CUresult cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load(&initialised)) return CUDA_SUCCESS;
    if (sim_open(0) != 0) return CUDA_ERROR_OPERATING_SYSTEM;
    sim_reap(); /* processes that exited since anyone looked give their memory back */
    /* Tunables: the duration of kernels other than busy_us, and how much work a stream may
     * have queued beyond now before a launch blocks. */
    const char *us = getenv("GPUSHARE_SIM_KERNEL_US");
    if (us && *us) kernel_default_ns = strtoull(us, NULL, 10) * 1000ull;
    const char *ctx_bytes = getenv("GPUSHARE_SIM_CONTEXT_BYTES");
    if (ctx_bytes && *ctx_bytes) context_bytes = strtoull(ctx_bytes, NULL, 10);
    const char *ahead = getenv("GPUSHARE_SIM_QUEUE_AHEAD_US");
    if (ahead && *ahead && strtoull(ahead, NULL, 10) > 0)
        queue_ahead_ns = strtoull(ahead, NULL, 10) * 1000ull;
    if (sim_cuda_count() == 0) return CUDA_ERROR_NO_DEVICE;
    atomic_store_explicit(&initialised, 1, memory_order_release);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = SIM_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* -- devices ---------------------------------------------------------------------------------- */

CUresult cuDeviceGetCount(int *count) {
    SIM_TRY(sim_ready());
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = sim_cuda_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    SIM_TRY(sim_ready());
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= sim_cuda_count()) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", sim_dev(sim_cuda_slot(dev))->name);
    return CUDA_SUCCESS;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "GPU-xxxxxxxx-xxxx-…" -> the 16 bytes (hex digits in order, dashes skipped). */
static void uuid_bytes(const char *text, CUuuid *out) {
    memset(out, 0, sizeof *out);
    const char *p = strncmp(text, "GPU-", 4) == 0 ? text + 4 : text;
    int n = 0;
    while (*p && n < 32) {
        int v = hexval(*p++);
        if (v < 0) continue;
        if (n % 2 == 0)
            out->bytes[n / 2] = (char)(v << 4);
        else
            out->bytes[n / 2] = (char)(out->bytes[n / 2] | v);
        n++;
    }
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    uuid_bytes(sim_dev(sim_cuda_slot(dev))->uuid, uuid);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    return cuDeviceGetUuid(uuid, dev);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = sim_dev(sim_cuda_slot(dev))->total_bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    unsigned tdp;
    sim_product(sim_dev(sim_cuda_slot(dev))->name, major, minor, &tdp);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    struct sim_device *d = sim_dev(sim_cuda_slot(dev));
    int major, minor;
    unsigned tdp;
    sim_product(d->name, &major, &minor, &tdp);
    int hopper = major >= 9;
    int v;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        v = 1024;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
        v = 1024;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y:
        v = 1024;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z:
        v = 64;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X:
        v = 2147483647;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
        v = 65535;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z:
        v = 65535;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK:
        v = 49152;
        break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY:
        v = 65536;
        break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
        v = 32;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH:
        v = 2147483647;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK:
        v = 65536;
        break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE:
        v = hopper ? 1980000 : 1410000;
        break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT:
        v = 512;
        break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        v = (int)d->sms;
        break;
    case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
        v = sim_cuda_slot(dev) + 1;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE:
        v = hopper ? 2619000 : 1593000;
        break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH:
        v = 5120;
        break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE:
        v = hopper ? 52428800 : 41943040;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
        v = 2048;
        break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT:
        v = 3;
        break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT:
        v = 32;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        v = major;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        v = minor;
        break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
        v = hopper ? 233472 : 167936;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR:
        v = 65536;
        break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID:
        v = sim_cuda_slot(dev);
        break;
    case CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO:
        v = 2;
        break;
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
        v = hopper ? 232448 : 166912;
        break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR:
        v = 32;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE:
        v = 31457280;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE:
        v = 134213632;
        break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK:
        v = 1024;
        break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH:
        v = hopper;
        break;
    default:
        if (attrib <= 0 || attrib > 150) return CUDA_ERROR_INVALID_VALUE;
        v = 0; /* texture/surface limits and newer capabilities: not modelled */
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", sim_cuda_slot(dev) + 1);
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    SIM_TRY(sim_device_ordinal(dev));
    SIM_TRY(sim_device_ordinal(peerDev));
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    *canAccessPeer = dev != peerDev;
    return CUDA_SUCCESS;
}

/* -- contexts --------------------------------------------------------------------------------- */

/* A context counts for its process in NVML's list and, with GPUSHARE_SIM_CONTEXT_BYTES, takes
 * that much device memory (a real one takes a few hundred MiB). */
static CUresult ctx_charge(struct CUctx_st *c) {
    if (context_bytes) {
        c->charge = sim_mem_reserve(c->slot, context_bytes);
        if (!c->charge) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_context_count(c->slot, 1);
    return CUDA_SUCCESS;
}

static void ctx_uncharge(struct CUctx_st *c) {
    if (c->charge) sim_mem_release(c->slot, context_bytes, c->charge);
    c->charge = 0;
    sim_context_count(c->slot, -1);
}

static void ctx_init(struct CUctx_st *c, CUdevice dev, unsigned flags, int is_primary) {
    memset(c, 0, sizeof *c);
    c->magic = MAGIC_CTX;
    c->ordinal = dev;
    c->slot = sim_cuda_slot(dev);
    c->primary = is_primary;
    c->flags = flags;
    c->id = atomic_fetch_add(&next_ctx_id, 1);
    c->legacy.magic = MAGIC_STREAM;
    c->legacy.kind = STREAM_LEGACY;
    c->legacy.ctx = c;
    atomic_store(&c->alive, 1);
}

static void ctx_push(struct CUctx_st *c) {
    if (ctx_depth < CTX_STACK)
        ctx_stack[ctx_depth++] = c;
    else
        ctx_stack[CTX_STACK - 1] = c;
}

/* Drops c from this thread's stack (another thread's stale entry is ignored by sim_current). */
static void ctx_forget(struct CUctx_st *c) {
    for (int i = 0; i < ctx_depth; i++) {
        if (ctx_stack[i] == c) {
            memmove(&ctx_stack[i], &ctx_stack[i + 1],
                    sizeof(ctx_stack[0]) * (size_t)(ctx_depth - i - 1));
            ctx_depth--;
            i--;
        }
    }
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    CUresult r = CUDA_SUCCESS;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    struct CUctx_st *c = &primary[dev];
    if (primary_refs[dev] == 0) {
        ctx_init(c, dev, primary_flags[dev], 1);
        if ((r = ctx_charge(c))) {
            atomic_store(&c->alive, 0);
            pthread_mutex_unlock(&ctx_lock);
            return r;
        }
    }
    primary_refs[dev]++;
    pthread_mutex_unlock(&ctx_lock);
    *pctx = c;
    return CUDA_SUCCESS;
}

static void primary_destroy(CUdevice dev) {
    struct CUctx_st *c = &primary[dev];
    atomic_store(&c->alive, 0);
    sim_free_context_memory(c);
    ctx_uncharge(c);
    primary_refs[dev] = 0;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] == 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if (--primary_refs[dev] == 0) {
        primary_refs[dev] = 1;
        primary_destroy(dev);
    }
    pthread_mutex_unlock(&ctx_lock);
    return r;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    return cuDevicePrimaryCtxRelease_v2(dev);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] > 0) primary_destroy(dev);
    primary_flags[dev] = 0;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    return cuDevicePrimaryCtxReset_v2(dev);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    *flags = primary_flags[dev];
    *active = primary_refs[dev] > 0;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    SIM_TRY(sim_device_ordinal(dev));
    if (flags & ~(unsigned)CU_CTX_FLAGS_MASK) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    primary_flags[dev] = flags;
    primary[dev].flags = flags;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    CUresult r = CUDA_SUCCESS;
    if (!pctx || (flags & ~(unsigned)CU_CTX_FLAGS_MASK)) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = malloc(sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_init(c, dev, flags, 0);
    if ((r = ctx_charge(c))) {
        free(c);
        return r;
    }
    pthread_mutex_lock(&ctx_lock);
    c->next_ctx = all_contexts;
    all_contexts = c;
    pthread_mutex_unlock(&ctx_lock);
    ctx_push(c);
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev) {
    (void)paramsArray;
    (void)numParams;
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev) {
    (void)ctxCreateParams;
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    SIM_TRY(sim_ready());
    SIM_TRY(check_ctx(ctx));
    if (ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    atomic_store(&ctx->alive, 0);
    ctx_forget(ctx);
    sim_free_context_memory(ctx);
    ctx_uncharge(ctx);
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy(CUcontext ctx) {
    return cuCtxDestroy_v2(ctx);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    SIM_TRY(sim_ready());
    if (ctx) SIM_TRY(check_ctx(ctx));
    if (ctx_depth == 0) {
        if (ctx) ctx_push(ctx);
    } else if (ctx) {
        ctx_stack[ctx_depth - 1] = ctx;
    } else {
        ctx_depth--;
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    SIM_TRY(sim_ready());
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = sim_current();
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    SIM_TRY(sim_ready());
    SIM_TRY(check_ctx(ctx));
    ctx_push(ctx);
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
    return cuCtxPushCurrent_v2(ctx);
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    SIM_TRY(sim_ready());
    if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = ctx_stack[--ctx_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext *pctx) {
    return cuCtxPopCurrent_v2(pctx);
}

CUresult cuCtxGetDevice(CUdevice *device) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetFlags(unsigned int *flags) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetFlags(unsigned int flags) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    c->flags = flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    SIM_TRY(sim_ready());
    if (!ctx) ctx = sim_current();
    SIM_TRY(check_ctx(ctx));
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12000;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId) {
    SIM_TRY(sim_ready());
    if (!ctx) ctx = sim_current();
    SIM_TRY(check_ctx(ctx));
    if (!ctxId) return CUDA_ERROR_INVALID_VALUE;
    *ctxId = ctx->id;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    sim_sleep_until(atomic_load(&c->all_end));
    return CUDA_SUCCESS;
}

CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!pvalue) return CUDA_ERROR_INVALID_VALUE;
    static const size_t defaults[] = {1024, 1048576, 8388608, 2, 2048, 64, 0, 0};
    if (limit < 0 || (size_t)limit >= sizeof defaults / sizeof defaults[0])
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    *pvalue = defaults[limit];
    return CUDA_SUCCESS;
}

CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    (void)value;
    return limit >= 0 && limit <= 7 ? CUDA_SUCCESS : CUDA_ERROR_UNSUPPORTED_LIMIT;
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    SIM_TRY(sim_ready());
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
    SIM_TRY(sim_ready());
    if (!ctx) return cuCtxGetDevice(device);
    SIM_TRY(check_ctx(ctx));
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = ctx->ordinal;
    return CUDA_SUCCESS;
}

/* Cache preferences have no effect on a simulated device; they are accepted and remembered. */
static __thread CUfunc_cache cache_config;

CUresult cuCtxSetCacheConfig(CUfunc_cache config) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (config < 0 || config > 3) return CUDA_ERROR_INVALID_VALUE;
    cache_config = config;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!pconfig) return CUDA_ERROR_INVALID_VALUE;
    *pconfig = cache_config;
    return CUDA_SUCCESS;
}

/* Peer access: every simulated device can reach every other one (memory is host memory). */
CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    SIM_TRY(check_ctx(peerContext));
    if (Flags != 0 || peerContext->ordinal == c->ordinal) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    return check_ctx(peerContext);
}

CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice srcDevice,
                                 CUdevice dstDevice) {
    SIM_TRY(sim_device_ordinal(srcDevice));
    SIM_TRY(sim_device_ordinal(dstDevice));
    if (!value || srcDevice == dstDevice || attrib < 1 || attrib > 4)
        return CUDA_ERROR_INVALID_VALUE;
    *value = attrib == 1 ? 0 : 1; /* performance rank 0; access, atomics, arrays supported */
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    SIM_TRY(sim_ready());
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < sim_cuda_count(); i++) {
        char id[32];
        cuDeviceGetPCIBusId(id, sizeof id, i);
        if (strcasecmp(id, pciBusId) == 0 || strcasecmp(id + 5, pciBusId) == 0) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuProfilerStart(void) {
    return sim_ready();
}
CUresult cuProfilerStop(void) {
    return sim_ready();
}
