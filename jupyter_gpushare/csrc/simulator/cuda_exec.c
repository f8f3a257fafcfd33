/* cuda_exec.c - modules and functions, launches, streams, events and graphs (stream capture).
 *
 * A launch computes the kernel's duration (busy_us: its first parameter in µs; anything else:
 * the default of a few µs), waits only if the stream's queue is full, and places the kernel on
 * the device's time line (sim_schedule). Streams and events carry instants: a stream's last_end,
 * an event's completion time. Synchronising sleeps until the instant.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

static _Atomic unsigned long long next_stream_id = 1;

void sim_atomic_max(a64 *a, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak(a, &cur, v)) {
    }
}

/* -- streams: resolution and ordering --------------------------------------------------------- */

/* The per-thread default stream of each context this thread used. */
struct ptds_entry {
    struct CUctx_st *ctx;
    struct CUstream_st *stream;
    struct ptds_entry *next;
};
static __thread struct ptds_entry *ptds_list;
static pthread_key_t ptds_key;
static pthread_once_t ptds_once = PTHREAD_ONCE_INIT;

static void ptds_free(void *head)
{
    for (struct ptds_entry *e = head, *n; e; e = n) {
        n = e->next;
        e->stream->magic = MAGIC_DEAD;
        free(e->stream);
        free(e);
    }
}

static void ptds_key_init(void) { pthread_key_create(&ptds_key, ptds_free); }

static void stream_init(struct CUstream_st *s, struct CUctx_st *ctx, enum stream_kind kind,
                        unsigned flags, int priority)
{
    memset(s, 0, sizeof *s);
    s->magic = MAGIC_STREAM;
    s->kind = kind;
    s->flags = flags;
    s->priority = priority;
    s->ctx = ctx;
    s->id = atomic_fetch_add(&next_stream_id, 1);
}

static struct CUstream_st *per_thread_stream(struct CUctx_st *ctx)
{
    for (struct ptds_entry *e = ptds_list; e; e = e->next)
        if (e->ctx == ctx)
            return e->stream;
    pthread_once(&ptds_once, ptds_key_init);
    struct ptds_entry *e = malloc(sizeof *e);
    struct CUstream_st *s = malloc(sizeof *s);
    if (!e || !s) {
        free(e);
        free(s);
        return NULL;
    }
    stream_init(s, ctx, STREAM_BLOCKING, 0, 0);
    e->ctx = ctx;
    e->stream = s;
    e->next = ptds_list;
    ptds_list = e;
    pthread_setspecific(ptds_key, ptds_list);
    return s;
}

CUresult sim_stream(CUstream h, int ptds, struct CUstream_st **out)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct CUctx_st *c;
        if ((r = sim_current_ctx(&c)))
            return r;
        if (h == CU_STREAM_PER_THREAD || (h == NULL && ptds)) {
            *out = per_thread_stream(c);
            return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        }
        *out = &c->legacy;
        return CUDA_SUCCESS;
    }
    if (h->magic != MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!atomic_load(&h->ctx->alive))
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = h;
    return CUDA_SUCCESS;
}

/* Work on the legacy stream waits for all blocking streams; blocking streams wait for the
 * legacy stream; non-blocking streams wait only for themselves. */
uint64_t sim_stream_ready(struct CUstream_st *s)
{
    uint64_t own = atomic_load(&s->last_end);
    uint64_t other = 0;
    if (s->kind == STREAM_LEGACY)
        other = atomic_load(&s->ctx->blocking_end);
    else if (s->kind == STREAM_BLOCKING)
        other = atomic_load(&s->ctx->legacy.last_end);
    return own > other ? own : other;
}

static void note_end(struct CUstream_st *s, uint64_t end)
{
    sim_atomic_max(&s->last_end, end);
    if (s->kind != STREAM_NON_BLOCKING)
        sim_atomic_max(&s->ctx->blocking_end, end);
    sim_atomic_max(&s->ctx->all_end, end);
}

static int capture_append(struct CUgraph_st *g, const struct graph_node *node)
{
    pthread_mutex_lock(&g->lock);
    if (g->count == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 16;
        struct graph_node *n = realloc(g->nodes, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&g->lock);
            return -1;
        }
        g->nodes = n;
        g->cap = cap;
    }
    g->nodes[g->count++] = *node;
    pthread_mutex_unlock(&g->lock);
    return 0;
}

int sim_capture_node(struct CUstream_st *s, const struct graph_node *node)
{
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (!g)
        return 0;
    capture_append(g, node);
    return 1;
}

CUresult sim_enqueue(struct CUstream_st *s, uint64_t dur_ns)
{
    struct graph_node node = {.kind = NODE_KERNEL, .ns = dur_ns};
    if (sim_capture_node(s, &node))
        return CUDA_SUCCESS;
    /* The queue bound: a stream holds at most SIM_QUEUE_DEPTH launches, and not more than
     * sim_queue_ahead_ns() of work beyond now; past that the launch blocks like a real one. The
     * device runs work in the order it was placed (first come, first served across processes):
     * the bound is also how far one process's backlog can delay another's kernels. */
    uint64_t n = atomic_fetch_add(&s->queued, 1);
    a64 *cell = &s->ring[n % SIM_QUEUE_DEPTH];
    uint64_t oldest = atomic_load(cell);
    uint64_t now = sim_now_ns();
    if (oldest > now)
        sim_sleep_until(oldest);
    uint64_t ready = sim_stream_ready(s), ahead = sim_queue_ahead_ns();
    if (ready > now + ahead)
        sim_sleep_until(ready - ahead);
    uint64_t end = sim_schedule(s->ctx->slot, ready, dur_ns);
    atomic_store(cell, end);
    note_end(s, end);
    return CUDA_SUCCESS;
}

/* -- modules, libraries, functions ------------------------------------------------------------ */

/* Loaded modules belong to the driver until unloaded (as with a real one, a program may drop
 * its handle and keep using the functions). */
static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUmod_st *modules;

static CUresult module_new(CUmodule *out, uint32_t magic)
{
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = magic;
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_lock(&modules_lock);
    m->next = modules;
    modules = m;
    pthread_mutex_unlock(&modules_lock);
    *out = m;
    return CUDA_SUCCESS;
}

static CUresult module_load(CUmodule *module, const void *image)
{
    struct CUctx_st *c;
    CUresult r = sim_current_ctx(&c);
    if (r)
        return r;
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, MAGIC_MODULE);
}

CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (fname && access(fname, R_OK) != 0)
        return sim_ready() ? sim_ready() : CUDA_ERROR_FILE_NOT_FOUND;
    return module_load(module, fname);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) { return module_load(module, image); }

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues)
{
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return module_load(module, image);
}

CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return module_load(module, fatCubin);
}

static void module_free(struct CUmod_st *m)
{
    pthread_mutex_lock(&modules_lock);
    for (struct CUmod_st **pp = &modules; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    }
    pthread_mutex_unlock(&modules_lock);
    m->magic = MAGIC_DEAD;
    for (struct CUfunc_st *f = m->funcs, *n; f; f = n) {
        n = f->next;
        f->magic = MAGIC_DEAD;
        free(f);
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

CUresult cuModuleUnload(CUmodule hmod)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!hmod || hmod->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(hmod);
    return CUDA_SUCCESS;
}

/* Any name resolves: the simulator has no code to check against. */
static CUresult module_function(struct CUmod_st *m, const char *name, struct CUfunc_st **out)
{
    if (!name || !out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&m->lock);
    struct CUfunc_st *f = m->funcs;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (!f) {
        size_t len = strlen(name);
        f = calloc(1, sizeof *f + len + 1);
        if (f) {
            f->magic = MAGIC_FUNC;
            f->busy = strstr(name, "busy_us") != NULL;
            f->module = m;
            memcpy(f->name, name, len + 1);
            f->next = m->funcs;
            m->funcs = f;
        }
    }
    pthread_mutex_unlock(&m->lock);
    *out = f;
    return f ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!hmod || hmod->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    return module_function(hmod, name, hfunc);
}

CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name)
{
    (void)dptr;
    (void)bytes;
    (void)name;
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!hmod || hmod->magic != MAGIC_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_FOUND; /* simulated modules have no globals */
}

CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = 2; /* CU_MODULE_LAZY_LOADING */
    return CUDA_SUCCESS;
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions)
{
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    CUmodule m;
    if ((r = module_new(&m, MAGIC_LIBRARY)))
        return r;
    *library = (CUlibrary)m;
    return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(CUlibrary library)
{
    struct CUmod_st *m = (struct CUmod_st *)library;
    if (!m || m->magic != MAGIC_LIBRARY)
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(m);
    return CUDA_SUCCESS;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    struct CUmod_st *m = (struct CUmod_st *)library;
    if (!m || m->magic != MAGIC_LIBRARY)
        return CUDA_ERROR_INVALID_HANDLE;
    struct CUfunc_st *f;
    CUresult r = module_function(m, name, &f);
    if (!r && pKernel)
        *pKernel = (CUkernel)f; /* a CUkernel is launchable as a CUfunction, as in CUDA 12 */
    return r;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    struct CUfunc_st *f = (struct CUfunc_st *)kernel;
    if (!f || f->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    *pFunc = f;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    if (!hfunc || hfunc->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 80; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = hfunc->max_dynamic_shared; break;
    default: *pi = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value)
{
    if (!hfunc || hfunc->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        hfunc->max_dynamic_shared = value;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    if (!hfunc || hfunc->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    *name = hfunc->name;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func,
                                                     int blockSize, size_t dynamicSMemSize)
{
    (void)dynamicSMemSize;
    if (!func || func->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!numBlocks || blockSize <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int b = 2048 / blockSize;
    *numBlocks = b > 32 ? 32 : (b < 1 ? 1 : b);
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                          CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                          size_t dynamicSMemSize, int blockSizeLimit)
{
    (void)blockSizeToDynamicSMemSize;
    (void)dynamicSMemSize;
    struct CUctx_st *c;
    CUresult r = sim_current_ctx(&c);
    if (r)
        return r;
    if (!func || func->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!minGridSize || !blockSize)
        return CUDA_ERROR_INVALID_VALUE;
    int block = blockSizeLimit > 0 && blockSizeLimit < 1024 ? blockSizeLimit : 1024;
    *blockSize = block;
    *minGridSize = (int)sim_dev(c->slot)->sms * (2048 / block);
    return CUDA_SUCCESS;
}

CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config)
{
    if (!hfunc || hfunc->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    return config >= 0 && config <= 3 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- launches --------------------------------------------------------------------------------- */

/* The kernel's duration: busy_us reads its first parameter (u64 µs) from kernelParams or from
 * the CU_LAUNCH_PARAM_BUFFER_POINTER buffer in `extra`. */
static CUresult kernel_ns(struct CUfunc_st *f, void **kernelParams, void **extra, uint64_t *ns)
{
    if (!f->busy) {
        *ns = sim_kernel_default_ns();
        return CUDA_SUCCESS;
    }
    uint64_t us = 0;
    if (kernelParams && kernelParams[0]) {
        memcpy(&us, kernelParams[0], sizeof us);
    } else if (extra) {
        const void *buf = NULL;
        size_t size = 0;
        for (int i = 0; extra[i] != CU_LAUNCH_PARAM_END && i < 64; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
                buf = extra[i + 1];
            else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1])
                size = *(size_t *)extra[i + 1];
        }
        if (!buf || size < sizeof us)
            return CUDA_ERROR_INVALID_VALUE;
        memcpy(&us, buf, sizeof us);
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (us > 3600ull * 1000000ull)
        return CUDA_ERROR_INVALID_VALUE; /* more than an hour: surely a bad argument */
    *ns = us * 1000ull;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream hStream, void **kernelParams,
                       void **extra, int ptds)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!f || f->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
        (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (kernelParams && extra)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    if ((r = sim_stream(hStream, ptds, &s)))
        return r;
    uint64_t ns;
    if ((r = kernel_ns(f, kernelParams, extra, &ns)))
        return r;
    return sim_enqueue(s, ns);
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, extra, 0);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, extra, 1);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra, int ptds)
{
    if (!config)
        return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream, kernelParams, extra,
                  ptds);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 1);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, NULL, 0);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                        unsigned int gridDimY, unsigned int gridDimZ,
                                        unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes,
                                        CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, NULL, 1);
}

/* Host functions run on the calling thread once the stream reaches them: later work on the
 * stream is then ordered after them, as in CUDA. */
static CUresult host_func(CUstream hStream, CUhostFn fn, void *userData, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, ptds, &s);
    if (r)
        return r;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load(&s->capture))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_sleep_until(sim_stream_ready(s));
    fn(userData);
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    return host_func(hStream, fn, userData, 0);
}

CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    return host_func(hStream, fn, userData, 1);
}

struct callback_args {
    CUstreamCallback cb;
    CUstream stream;
    void *data;
};

static void run_callback(void *p)
{
    struct callback_args *a = p;
    a->cb(a->stream, CUDA_SUCCESS, a->data);
}

static CUresult add_callback(CUstream hStream, CUstreamCallback callback, void *userData,
                             unsigned int flags, int ptds)
{
    if (flags != 0 || !callback)
        return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    struct callback_args a = {callback, hStream, userData};
    return host_func(hStream, run_callback, &a, ptds);
}

CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                             unsigned int flags)
{
    return add_callback(hStream, callback, userData, flags, 0);
}

CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData,
                                  unsigned int flags)
{
    return add_callback(hStream, callback, userData, flags, 1);
}

/* -- streams ---------------------------------------------------------------------------------- */

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    struct CUctx_st *c;
    CUresult r = sim_current_ctx(&c);
    if (r)
        return r;
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = malloc(sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (priority > 0)
        priority = 0;
    if (priority < -5)
        priority = -5;
    stream_init(s, c, (flags & CU_STREAM_NON_BLOCKING) ? STREAM_NON_BLOCKING : STREAM_BLOCKING,
                flags, priority);
    *phStream = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return cuStreamCreateWithPriority(phStream, Flags, 0);
}

static int is_special(CUstream h)
{
    return h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD;
}

CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    if (is_special(hStream) || hStream->magic != MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    /* Work already queued still completes: the device time line keeps it. */
    hStream->magic = MAGIC_DEAD;
    free(hStream);
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy(CUstream hStream) { return cuStreamDestroy_v2(hStream); }

static CUresult stream_sync(CUstream h, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (atomic_load(&s->capture))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_sleep_until(sim_stream_ready(s));
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    return sim_stream_ready(s) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, 0); }
CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, 1); }

static CUresult stream_wait_event(CUstream h, CUevent e, unsigned flags, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~1u)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = atomic_load(&e->capture);
    if (g) { /* joining a capture: this stream now records into the same graph */
        struct CUgraph_st *none = NULL;
        if (atomic_compare_exchange_strong(&s->capture, &none, g)) {
            pthread_mutex_lock(&g->lock);
            if (g->njoined < SIM_MAX_JOINED)
                g->joined[g->njoined++] = s;
            pthread_mutex_unlock(&g->lock);
        }
        return CUDA_SUCCESS;
    }
    uint64_t t = atomic_load(&e->time);
    if (t)
        note_end(s, t);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(hStream, hEvent, Flags, 0);
}

CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

#define STREAM_GETTER(NAME, PTDS, TYPE, EXPR)                                                      \
    CUresult NAME(CUstream hStream, TYPE *out)                                                     \
    {                                                                                              \
        struct CUstream_st *s;                                                                     \
        CUresult r = sim_stream(hStream, PTDS, &s);                                                \
        if (r)                                                                                     \
            return r;                                                                              \
        if (!out)                                                                                  \
            return CUDA_ERROR_INVALID_VALUE;                                                       \
        *out = (EXPR);                                                                             \
        return CUDA_SUCCESS;                                                                       \
    }

STREAM_GETTER(cuStreamGetFlags, 0, unsigned int, s->flags)
STREAM_GETTER(cuStreamGetFlags_ptsz, 1, unsigned int, s->flags)
STREAM_GETTER(cuStreamGetPriority, 0, int, s->priority)
STREAM_GETTER(cuStreamGetPriority_ptsz, 1, int, s->priority)
STREAM_GETTER(cuStreamGetCtx, 0, CUcontext, s->ctx)
STREAM_GETTER(cuStreamGetCtx_ptsz, 1, CUcontext, s->ctx)
STREAM_GETTER(cuStreamGetId, 0, unsigned long long, s->id)
STREAM_GETTER(cuStreamGetId_ptsz, 1, unsigned long long, s->id)
STREAM_GETTER(cuStreamGetDevice, 0, CUdevice, s->ctx->ordinal)
STREAM_GETTER(cuStreamGetDevice_ptsz, 1, CUdevice, s->ctx->ordinal)

/* -- events ----------------------------------------------------------------------------------- */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct CUctx_st *c;
    CUresult r = sim_current_ctx(&c);
    if (r)
        return r;
    if (!phEvent || (Flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = Flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream h, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (g) {
        atomic_store(&e->capture, g);
        return CUDA_SUCCESS;
    }
    atomic_store(&e->capture, NULL);
    uint64_t now = sim_now_ns();
    uint64_t ready = sim_stream_ready(s);
    atomic_store(&e->time, ready > now ? ready : now);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0); }
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return event_record(hEvent, hStream, 1);
}

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    if (flags & ~1u)
        return CUDA_ERROR_INVALID_VALUE;
    return event_record(hEvent, hStream, 0);
}

CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    if (flags & ~1u)
        return CUDA_ERROR_INVALID_VALUE;
    return event_record(hEvent, hStream, 1);
}

static CUresult check_event(CUevent e)
{
    CUresult r = sim_ready();
    if (r)
        return r;
    return e && e->magic == MAGIC_EVENT ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventQuery(CUevent hEvent)
{
    CUresult r = check_event(hEvent);
    if (r)
        return r;
    return atomic_load(&hEvent->time) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent)
{
    CUresult r = check_event(hEvent);
    if (r)
        return r;
    sim_sleep_until(atomic_load(&hEvent->time));
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    CUresult r = check_event(hStart);
    if (!r)
        r = check_event(hEnd);
    if (r)
        return r;
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t a = atomic_load(&hStart->time), b = atomic_load(&hEnd->time);
    if (!a || !b)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = sim_now_ns();
    if (a > now || b > now)
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)((int64_t)(b - a)) / 1e6);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CUresult r = check_event(hEvent);
    if (r)
        return r;
    hEvent->magic = MAGIC_DEAD;
    free(hEvent);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent hEvent) { return cuEventDestroy_v2(hEvent); }

/* -- graphs (stream capture) ------------------------------------------------------------------ */

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (mode < 0 || mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    if (s->kind == STREAM_LEGACY)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC_GRAPH;
    pthread_mutex_init(&g->lock, NULL);
    g->origin = s;
    struct CUgraph_st *none = NULL;
    if (!atomic_compare_exchange_strong(&s->capture, &none, g)) {
        free(g);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode, 0);
}

CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (!g || g->origin != s)
        return CUDA_ERROR_ILLEGAL_STATE;
    atomic_store(&s->capture, NULL);
    /* Streams that joined through events leave the capture with it. */
    pthread_mutex_lock(&g->lock);
    for (int i = 0; i < g->njoined; i++) {
        struct CUgraph_st *expected = g;
        if (g->joined[i]->magic == MAGIC_STREAM)
            atomic_compare_exchange_strong(&g->joined[i]->capture, &expected, NULL);
    }
    g->njoined = 0;
    pthread_mutex_unlock(&g->lock);
    *phGraph = g;
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph, 0);
}

CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph, 1);
}

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *status, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = atomic_load(&s->capture) ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                       : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return is_capturing(hStream, captureStatus, 0);
}

CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return is_capturing(hStream, captureStatus, 1);
}

static CUresult capture_info(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                             CUgraph *graph, const CUgraphNode **deps, size_t *ndeps, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (status)
        *status = g ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    if (id)
        *id = (cuuint64_t)(uintptr_t)g;
    if (graph)
        *graph = g;
    if (deps)
        *deps = NULL;
    if (ndeps)
        *ndeps = 0;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                   cuuint64_t *id_out, CUgraph *graph_out,
                                   const CUgraphNode **dependencies_out, size_t *numDependencies_out)
{
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 0);
}

CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                        cuuint64_t *id_out, CUgraph *graph_out,
                                        const CUgraphNode **dependencies_out,
                                        size_t *numDependencies_out)
{
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 1);
}

CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                   cuuint64_t *id_out, CUgraph *graph_out,
                                   const CUgraphNode **dependencies_out,
                                   const CUgraphEdgeData **edgeData_out,
                                   size_t *numDependencies_out)
{
    if (edgeData_out)
        *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 0);
}

CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                        cuuint64_t *id_out, CUgraph *graph_out,
                                        const CUgraphNode **dependencies_out,
                                        const CUgraphEdgeData **edgeData_out,
                                        size_t *numDependencies_out)
{
    if (edgeData_out)
        *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 1);
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    static __thread int current;
    if (!mode || *mode < 0 || *mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    int old = current;
    current = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags)
{
    (void)flags;
    CUresult r = sim_ready();
    if (r)
        return r;
    if (!hGraph || hGraph->magic != MAGIC_GRAPH)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!phGraphExec)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *x = calloc(1, sizeof *x);
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&hGraph->lock);
    if (hGraph->count) {
        x->nodes = malloc(hGraph->count * sizeof *x->nodes);
        if (!x->nodes) {
            pthread_mutex_unlock(&hGraph->lock);
            free(x);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        memcpy(x->nodes, hGraph->nodes, hGraph->count * sizeof *x->nodes);
    }
    x->count = hGraph->count;
    pthread_mutex_unlock(&hGraph->lock);
    for (size_t i = 0; i < x->count; i++)
        if (x->nodes[i].kind == NODE_KERNEL)
            x->total_ns += x->nodes[i].ns;
    x->magic = MAGIC_GRAPH_EXEC;
    *phGraphExec = x;
    return CUDA_SUCCESS;
}

/* The CUDA 11 signature, still exported as cuGraphInstantiate / cuGraphInstantiate_v2. */
CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize)
{
    if (phErrorNode)
        *phErrorNode = NULL;
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize)
{
    return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

static void run_copy_nodes(const struct CUgraphExec_st *x)
{
    for (size_t i = 0; i < x->count; i++) {
        const struct graph_node *n = &x->nodes[i];
        switch (n->kind) {
        case NODE_COPY: memmove(n->dst, n->src, n->count); break;
        case NODE_SET8: memset(n->dst, (int)(n->value & 0xff), n->count); break;
        case NODE_SET16:
            for (size_t k = 0; k < n->count; k++)
                ((uint16_t *)n->dst)[k] = (uint16_t)n->value;
            break;
        case NODE_SET32:
            for (size_t k = 0; k < n->count; k++)
                ((uint32_t *)n->dst)[k] = n->value;
            break;
        case NODE_KERNEL: break;
        }
    }
}

/* A graph runs as one piece of device work lasting its kernels' total time. */
static CUresult graph_launch(CUgraphExec x, CUstream h, int ptds)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r)
        return r;
    if (!x || x->magic != MAGIC_GRAPH_EXEC)
        return CUDA_ERROR_INVALID_HANDLE;
    run_copy_nodes(x);
    return sim_enqueue(s, x->total_ns);
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 1);
}

CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, 0, &s);
    if (r)
        return r;
    return hGraphExec && hGraphExec->magic == MAGIC_GRAPH_EXEC ? CUDA_SUCCESS
                                                               : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    if (!hGraphExec || hGraphExec->magic != MAGIC_GRAPH_EXEC)
        return CUDA_ERROR_INVALID_HANDLE;
    hGraphExec->magic = MAGIC_DEAD;
    free(hGraphExec->nodes);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    if (!hGraph || hGraph->magic != MAGIC_GRAPH)
        return CUDA_ERROR_INVALID_HANDLE;
    hGraph->magic = MAGIC_DEAD;
    free(hGraph->nodes);
    pthread_mutex_destroy(&hGraph->lock);
    free(hGraph);
    return CUDA_SUCCESS;
}
