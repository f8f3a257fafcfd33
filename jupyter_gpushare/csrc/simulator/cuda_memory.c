/* cuda_memory.c - device memory: allocations, host memory, pools, virtual memory management, arrays.
 *
 * Device memory is finite: every allocation reserves its size against the device's total in the
 * shared state (and is charged to this process, which NVML reports). Allocations are backed by
 * real, lazily committed host memory (mmap with MAP_NORESERVE), so a device pointer is a host
 * address and copies and sets (cuda_copy.c) really move bytes; untouched memory costs nothing.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_cuda.h"

enum alloc_kind { ALLOC_DEVICE, ALLOC_MANAGED, ALLOC_POOL };

struct alloc {
    uint64_t base;
    uint64_t length; /* mapped bytes (whole pages) */
    uint64_t bytes;  /* bytes charged to the device */
    uint64_t gen;    /* the charge's generation */
    int slot;
    enum alloc_kind kind;
    struct CUctx_st *ctx;
    struct CUmemPoolHandle_st *pool;
    struct alloc *next;
};

/* VMM: a physical allocation (cuMemCreate) and one mapping of it into a reserved range. */
struct phys {
    uint64_t size;
    uint64_t gen;
    int slot;
    int fd;   /* memfd so that several mappings share the bytes; -1 if unavailable */
    int refs; /* the handle itself + live mappings */
    struct phys *next;
};

struct mapping {
    uint64_t base, size;
    struct phys *phys;
    struct mapping *next;
};

struct reservation {
    uint64_t base, size;
    struct reservation *next;
};

#define BUCKETS 4096
static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *buckets[BUCKETS];
static struct phys *physs;
static struct mapping *mappings;
static struct reservation *reservations;
static struct CUarray_st *arrays;
static struct CUmemPoolHandle_st default_pools[SIM_MAX_DEVICES];
static struct CUmemPoolHandle_st *current_pools[SIM_MAX_DEVICES];
static struct CUmemPoolHandle_st *user_pools[256];

static size_t bucket_of(uint64_t base) {
    return (size_t)((base >> 12) * 0x9E3779B97F4A7C15ull >> 52) % BUCKETS;
}

static uint64_t page_round(uint64_t n) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

/* -- the allocation table --------------------------------------------------------------------- */

static CUresult dev_alloc(struct CUctx_st *ctx, int slot, uint64_t bytes, enum alloc_kind kind,
                          struct CUmemPoolHandle_st *pool, CUdeviceptr *out) {
    if (!out || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t gen = sim_mem_reserve(slot, bytes);
    if (!gen) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t length = page_round(bytes);
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct alloc *a = p == MAP_FAILED ? NULL : malloc(sizeof *a);
    if (!a) {
        if (p != MAP_FAILED) munmap(p, length);
        sim_mem_release(slot, bytes, gen);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = (struct alloc){.base = (uint64_t)(uintptr_t)p,
                        .length = length,
                        .bytes = bytes,
                        .gen = gen,
                        .slot = slot,
                        .kind = kind,
                        .ctx = ctx,
                        .pool = pool};
    pthread_mutex_lock(&mem_lock);
    size_t b = bucket_of(a->base);
    a->next = buckets[b];
    buckets[b] = a;
    if (pool) {
        uint64_t used = atomic_fetch_add(&pool->used, bytes) + bytes;
        sim_atomic_max(&pool->used_high, used);
    }
    pthread_mutex_unlock(&mem_lock);
    *out = a->base;
    return CUDA_SUCCESS;
}

static void alloc_release(struct alloc *a) {
    if (a->pool) atomic_fetch_sub(&a->pool->used, a->bytes);
    munmap((void *)(uintptr_t)a->base, a->length);
    sim_mem_release(a->slot, a->bytes, a->gen);
    free(a);
}

static CUresult dev_free(CUdeviceptr ptr) {
    if (ptr == 0) return CUDA_SUCCESS;
    pthread_mutex_lock(&mem_lock);
    struct alloc **pp = &buckets[bucket_of(ptr)];
    while (*pp && (*pp)->base != ptr) pp = &(*pp)->next;
    struct alloc *a = *pp;
    if (a) *pp = a->next;
    pthread_mutex_unlock(&mem_lock);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    alloc_release(a);
    return CUDA_SUCCESS;
}

void sim_free_context_memory(struct CUctx_st *ctx) {
    struct alloc *dead = NULL;
    pthread_mutex_lock(&mem_lock);
    for (size_t b = 0; b < BUCKETS; b++) {
        struct alloc **pp = &buckets[b];
        while (*pp) {
            struct alloc *a = *pp;
            if (a->ctx == ctx) {
                *pp = a->next;
                a->next = dead;
                dead = a;
            } else {
                pp = &a->next;
            }
        }
    }
    struct CUarray_st *dead_arrays = NULL;
    for (struct CUarray_st **pp = &arrays; *pp;) {
        struct CUarray_st *a = *pp;
        if (a->ctx == ctx) {
            *pp = a->next;
            a->next = dead_arrays;
            dead_arrays = a;
        } else {
            pp = &a->next;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    for (struct alloc *a = dead, *n; a; a = n) {
        n = a->next;
        alloc_release(a);
    }
    for (struct CUarray_st *a = dead_arrays, *n; a; a = n) {
        n = a->next;
        a->magic = MAGIC_DEAD;
        sim_mem_release(a->slot, a->bytes, a->gen);
        free(a);
    }
}

/* The allocation containing [ptr, ptr+n) (caller holds mem_lock), or NULL. */
static struct alloc *containing(uint64_t ptr, uint64_t n) {
    struct alloc *a = buckets[bucket_of(ptr)];
    for (; a; a = a->next)
        if (a->base == ptr && n <= a->length) return a;
    for (size_t b = 0; b < BUCKETS; b++)
        for (a = buckets[b]; a; a = a->next)
            if (ptr >= a->base && ptr - a->base <= a->length && n <= a->length - (ptr - a->base))
                return a;
    return NULL;
}

/* Whether [ptr, ptr+n) is device memory this process may touch: an allocation or VMM mapping. */
int sim_device_range(uint64_t ptr, uint64_t n) {
    pthread_mutex_lock(&mem_lock);
    int ok = containing(ptr, n) != NULL;
    for (struct mapping *m = mappings; !ok && m; m = m->next)
        ok = ptr >= m->base && ptr - m->base <= m->size && n <= m->size - (ptr - m->base);
    pthread_mutex_unlock(&mem_lock);
    return ok;
}

/* -- allocation entry points ------------------------------------------------------------------ */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    return dev_alloc(c, c->slot, bytesize, ALLOC_DEVICE, NULL, dptr);
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + 511) / 512 * 512;
    SIM_TRY(dev_alloc(c, c->slot, (uint64_t)pitch * Height, ALLOC_DEVICE, NULL, dptr));
    *pPitch = pitch;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    return dev_alloc(c, c->slot, bytesize, ALLOC_MANAGED, NULL, dptr);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    SIM_TRY(sim_ready());
    return dev_free(dptr);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    struct sim_device *d = sim_dev(c->slot);
    uint64_t used = atomic_load(&d->mem_used);
    *total = d->total_bytes;
    *free_bytes = used < d->total_bytes ? d->total_bytes - used : 0;
    return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    SIM_TRY(sim_ready());
    pthread_mutex_lock(&mem_lock);
    struct alloc *a = containing(dptr, 0);
    if (a) {
        if (pbase) *pbase = a->base;
        if (psize) *psize = a->bytes;
    }
    pthread_mutex_unlock(&mem_lock);
    return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    SIM_TRY(sim_ready());
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_lock);
    struct alloc *a = containing(ptr, 0);
    struct alloc copy = a ? *a : (struct alloc){0};
    pthread_mutex_unlock(&mem_lock);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = copy.ctx;
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data =
            copy.kind == ALLOC_MANAGED ? CU_MEMORYTYPE_UNIFIED : CU_MEMORYTYPE_DEVICE;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *(CUdeviceptr *)data = ptr;
        break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (copy.kind != ALLOC_MANAGED) return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = (void *)(uintptr_t)ptr;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *(int *)data = copy.kind == ALLOC_MANAGED;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = copy.ctx ? copy.ctx->ordinal : 0;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(CUdeviceptr *)data = copy.base;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = copy.bytes;
        break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        *(int *)data = 1;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* Unified memory hints: the simulator keeps every byte in host memory, so prefetching and
 * advice only need a valid range. */
static CUresult um_hint(CUdeviceptr ptr, size_t count, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult r = h || ptds >= 0 ? sim_stream(h, ptds > 0, &s) : sim_ready();
    if (r) return r;
    return count && sim_device_range(ptr, count) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice,
                            CUstream hStream) {
    (void)dstDevice;
    return um_hint(devPtr, count, hStream, 0);
}

CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice,
                                 CUstream hStream) {
    (void)dstDevice;
    return um_hint(devPtr, count, hStream, 1);
}

CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                               unsigned int flags, CUstream hStream) {
    (void)location;
    return flags ? CUDA_ERROR_INVALID_VALUE : um_hint(devPtr, count, hStream, 0);
}

CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                    unsigned int flags, CUstream hStream) {
    (void)location;
    return flags ? CUDA_ERROR_INVALID_VALUE : um_hint(devPtr, count, hStream, 1);
}

CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device) {
    (void)device;
    if (advice < 1 || advice > 6) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return um_hint(devPtr, count, NULL, -1);
}

CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice,
                        CUmemLocation location) {
    (void)location;
    if (advice < 1 || advice > 6) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return um_hint(devPtr, count, NULL, -1);
}

/* -- host memory ------------------------------------------------------------------------------ */

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    SIM_TRY(sim_ready());
    if (!pp || bytesize == 0 || (Flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytesize) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) {
    return cuMemHostAlloc(pp, bytesize, 0);
}

/* Unified addressing: a host allocation's device pointer is its address. */
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    SIM_TRY(sim_ready());
    if (!pdptr || !p || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    SIM_TRY(sim_ready());
    free(p);
    return CUDA_SUCCESS;
}

CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    (void)Flags;
    SIM_TRY(sim_ready());
    return p && bytesize ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemHostUnregister(void *p) {
    SIM_TRY(sim_ready());
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- stream-ordered allocation and pools ------------------------------------------------------ */

static struct CUmemPoolHandle_st *default_pool(int ordinal) {
    struct CUmemPoolHandle_st *p = &default_pools[ordinal];
    pthread_mutex_lock(&mem_lock);
    if (p->magic != MAGIC_POOL) {
        p->magic = MAGIC_POOL;
        p->ordinal = ordinal;
        p->slot = sim_cuda_slot(ordinal);
    }
    pthread_mutex_unlock(&mem_lock);
    return p;
}

static struct CUmemPoolHandle_st *current_pool(int ordinal) {
    pthread_mutex_lock(&mem_lock);
    struct CUmemPoolHandle_st *p = current_pools[ordinal];
    pthread_mutex_unlock(&mem_lock);
    return p ? p : default_pool(ordinal);
}

static CUresult check_pool(CUmemoryPool pool) {
    SIM_TRY(sim_ready());
    return pool && pool->magic == MAGIC_POOL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult alloc_from_pool(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                CUstream hStream, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, ptds, &s);
    if (r) return r;
    if (!pool) pool = current_pool(s->ctx->ordinal);
    SIM_TRY(check_pool(pool));
    return dev_alloc(s->ctx, pool->slot, bytesize, ALLOC_POOL, pool, dptr);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_from_pool(dptr, bytesize, NULL, hStream, 0);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_from_pool(dptr, bytesize, NULL, hStream, 1);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    if (!pool) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return alloc_from_pool(dptr, bytesize, pool, hStream, 0);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    if (!pool) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return alloc_from_pool(dptr, bytesize, pool, hStream, 1);
}

/* The memory is given back at once: the simulator's kernels never read it. */
static CUresult free_async(CUdeviceptr dptr, CUstream hStream, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, ptds, &s);
    if (r) return r;
    return dptr ? dev_free(dptr) : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    return free_async(dptr, hStream, 0);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return free_async(dptr, hStream, 1);
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    SIM_TRY(sim_ready());
    CUresult r = CUDA_SUCCESS;
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = sim_device_ordinal(poolProps->location.id))) return CUDA_ERROR_INVALID_VALUE;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = MAGIC_POOL;
    p->ordinal = poolProps->location.id;
    p->slot = sim_cuda_slot(p->ordinal);
    pthread_mutex_lock(&mem_lock);
    size_t i = 0;
    while (i < sizeof user_pools / sizeof user_pools[0] && user_pools[i]) i++;
    if (i < sizeof user_pools / sizeof user_pools[0]) user_pools[i] = p;
    pthread_mutex_unlock(&mem_lock);
    if (i == sizeof user_pools / sizeof user_pools[0]) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pool = p;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    CUresult r = check_pool(pool);
    if (r) return r;
    if (pool >= default_pools && pool < default_pools + SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_lock);
    for (size_t i = 0; i < sizeof user_pools / sizeof user_pools[0]; i++)
        if (user_pools[i] == pool) user_pools[i] = NULL;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (current_pools[d] == pool) current_pools[d] = NULL;
    for (size_t b = 0; b < BUCKETS; b++)
        for (struct alloc *a = buckets[b]; a; a = a->next)
            if (a->pool == pool) a->pool = NULL;
    pool->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&mem_lock);
    free(pool);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    (void)minBytesToKeep;
    return check_pool(pool);
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    CUresult r = check_pool(pool);
    if (r) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        atomic_store(&pool->threshold, *(uint64_t *)value);
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        atomic_store(&pool->used_high, atomic_load(&pool->used));
        break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    CUresult r = check_pool(pool);
    if (r) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        *(uint64_t *)value = atomic_load(&pool->threshold);
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        *(uint64_t *)value = atomic_load(&pool->used);
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        *(uint64_t *)value = atomic_load(&pool->used_high);
        break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = 1;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    *pool_out = default_pool(dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    SIM_TRY(sim_device_ordinal(dev));
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    *pool = current_pool(dev);
    return CUDA_SUCCESS;
}

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    SIM_TRY(sim_device_ordinal(dev));
    SIM_TRY(check_pool(pool));
    if (pool->ordinal != dev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mem_lock);
    current_pools[dev] = pool;
    pthread_mutex_unlock(&mem_lock);
    return CUDA_SUCCESS;
}

/* -- virtual memory management ---------------------------------------------------------------- */

static CUresult check_prop(const CUmemAllocationProp *prop) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_device_ordinal(prop->location.id) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
    SIM_TRY(sim_ready());
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    SIM_TRY(check_prop(prop));
    *granularity = SIM_VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    SIM_TRY(sim_ready());
    SIM_TRY(check_prop(prop));
    if (!handle || size == 0 || size % SIM_VMM_GRANULARITY || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    int slot = sim_cuda_slot(prop->location.id);
    uint64_t gen = sim_mem_reserve(slot, size);
    if (!gen) return CUDA_ERROR_OUT_OF_MEMORY;
    struct phys *ph = calloc(1, sizeof *ph);
    if (!ph) {
        sim_mem_release(slot, size, gen);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ph->size = size;
    ph->gen = gen;
    ph->slot = slot;
    ph->refs = 1;
    ph->fd = memfd_create("gpushare-sim-vmm", MFD_CLOEXEC);
    if (ph->fd >= 0 && ftruncate(ph->fd, (off_t)size) != 0) {
        close(ph->fd);
        ph->fd = -1;
    }
    pthread_mutex_lock(&mem_lock);
    ph->next = physs;
    physs = ph;
    pthread_mutex_unlock(&mem_lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)ph;
    return CUDA_SUCCESS;
}

/* Caller holds mem_lock. */
static struct phys *find_phys(CUmemGenericAllocationHandle handle) {
    for (struct phys *p = physs; p; p = p->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)p == handle) return p;
    return NULL;
}

/* Drops one reference (caller holds mem_lock); frees the bytes with the last one. */
static void phys_unref(struct phys *ph) {
    if (--ph->refs > 0) return;
    for (struct phys **pp = &physs; *pp; pp = &(*pp)->next) {
        if (*pp == ph) {
            *pp = ph->next;
            break;
        }
    }
    if (ph->fd >= 0) close(ph->fd);
    sim_mem_release(ph->slot, ph->size, ph->gen);
    free(ph);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    SIM_TRY(sim_ready());
    pthread_mutex_lock(&mem_lock);
    struct phys *ph = find_phys(handle);
    if (ph) phys_unref(ph);
    pthread_mutex_unlock(&mem_lock);
    return ph ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                CUmemGenericAllocationHandle handle) {
    SIM_TRY(sim_ready());
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_lock);
    struct phys *ph = find_phys(handle);
    int slot = ph ? ph->slot : -1;
    pthread_mutex_unlock(&mem_lock);
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    for (int i = 0; i < sim_cuda_count(); i++)
        if (sim_cuda_slot(i) == slot) prop->location.id = i;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    SIM_TRY(sim_ready());
    if (!ptr || size == 0 || size % SIM_VMM_GRANULARITY || flags != 0 ||
        (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment < SIM_VMM_GRANULARITY) alignment = SIM_VMM_GRANULARITY;
    /* Reserve more, then trim to the alignment. */
    size_t span = size + alignment;
    void *p = mmap((void *)(uintptr_t)addr, span, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t start = ((uint64_t)(uintptr_t)p + alignment - 1) / alignment * alignment;
    if (start > (uint64_t)(uintptr_t)p) munmap(p, start - (uint64_t)(uintptr_t)p);
    uint64_t end = (uint64_t)(uintptr_t)p + span;
    if (end > start + size) munmap((void *)(uintptr_t)(start + size), end - (start + size));
    struct reservation *res = malloc(sizeof *res);
    if (!res) {
        munmap((void *)(uintptr_t)start, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    res->base = start;
    res->size = size;
    pthread_mutex_lock(&mem_lock);
    res->next = reservations;
    reservations = res;
    pthread_mutex_unlock(&mem_lock);
    *ptr = start;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    SIM_TRY(sim_ready());
    pthread_mutex_lock(&mem_lock);
    struct reservation **pp = &reservations;
    while (*pp && ((*pp)->base != ptr || (*pp)->size != size)) pp = &(*pp)->next;
    struct reservation *res = *pp;
    if (res) *pp = res->next;
    pthread_mutex_unlock(&mem_lock);
    if (!res) return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)(uintptr_t)ptr, size);
    free(res);
    return CUDA_SUCCESS;
}

/* Caller holds mem_lock. */
static int reserved(uint64_t ptr, uint64_t size) {
    for (struct reservation *r = reservations; r; r = r->next)
        if (ptr >= r->base && ptr - r->base <= r->size && size <= r->size - (ptr - r->base))
            return 1;
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    SIM_TRY(sim_ready());
    CUresult r = CUDA_SUCCESS;
    if (size == 0 || flags != 0 || ptr % SIM_VMM_GRANULARITY || size % SIM_VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    struct mapping *m = malloc(sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mem_lock);
    struct phys *ph = find_phys(handle);
    if (!ph || offset > ph->size || size > ph->size - offset || !reserved(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE;
    for (struct mapping *o = mappings; !r && o; o = o->next)
        if (ptr < o->base + o->size && o->base < ptr + size) r = CUDA_ERROR_ALREADY_MAPPED;
    if (!r) {
        void *want = (void *)(uintptr_t)ptr;
        void *got = ph->fd >= 0
                        ? mmap(want, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, ph->fd,
                               (off_t)offset)
                        : mmap(want, size, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        if (got == MAP_FAILED) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *m = (struct mapping){.base = ptr, .size = size, .phys = ph, .next = mappings};
            mappings = m;
            ph->refs++;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    if (r) free(m);
    return r;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    SIM_TRY(sim_ready());
    int found = 0;
    pthread_mutex_lock(&mem_lock);
    struct mapping **pp = &mappings;
    while (*pp) {
        struct mapping *m = *pp;
        if (m->base >= ptr && m->base + m->size <= ptr + size) {
            *pp = m->next;
            /* Back to a reserved, inaccessible range. */
            mmap((void *)(uintptr_t)m->base, m->size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
            phys_unref(m->phys);
            free(m);
            found = 1;
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    SIM_TRY(sim_ready());
    if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            sim_device_ordinal(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
    return sim_device_range(ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- arrays ----------------------------------------------------------------------------------- */

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case 0x01:
    case 0x08:
        return 1; /* (un)signed int8 */
    case 0x02:
    case 0x09:
    case 0x10:
        return 2; /* int16, half */
    case 0x03:
    case 0x0a:
    case 0x20:
        return 4; /* int32, float */
    default:
        return 4;
    }
}

static CUresult array_create(CUarray *pHandle, uint64_t w, uint64_t h, uint64_t d, CUarray_format f,
                             unsigned channels) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!pHandle || w == 0 || (channels != 1 && channels != 2 && channels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = w * (h ? h : 1) * (d ? d : 1) * channels * format_bytes(f);
    struct CUarray_st *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    a->gen = sim_mem_reserve(c->slot, bytes);
    if (!a->gen) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = MAGIC_ARRAY;
    a->slot = c->slot;
    a->bytes = bytes;
    a->ctx = c;
    pthread_mutex_lock(&mem_lock);
    a->next = arrays;
    arrays = a;
    pthread_mutex_unlock(&mem_lock);
    *pHandle = a;
    return CUDA_SUCCESS;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray) {
    if (!pAllocateArray) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height, 1,
                        pAllocateArray->Format, pAllocateArray->NumChannels);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray) {
    if (!pAllocateArray) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Width, pAllocateArray->Height,
                        pAllocateArray->Depth, pAllocateArray->Format, pAllocateArray->NumChannels);
}

CUresult cuArrayDestroy(CUarray hArray) {
    SIM_TRY(sim_ready());
    if (!hArray) return CUDA_ERROR_INVALID_HANDLE;
    int found = 0;
    pthread_mutex_lock(&mem_lock);
    for (struct CUarray_st **pp = &arrays; *pp; pp = &(*pp)->next) {
        if (*pp == hArray) {
            *pp = hArray->next;
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    if (!found) /* not a live array (checked by identity, not by reading the handle) */
        return CUDA_ERROR_INVALID_HANDLE;
    hArray->magic = MAGIC_DEAD;
    sim_mem_release(hArray->slot, hArray->bytes, hArray->gen);
    free(hArray);
    return CUDA_SUCCESS;
}
