/* cuda_stream.c - streams (resolution, ordering, the queue bound), launches and host functions.
 *
 * A launch computes the kernel's duration (busy_us: its first parameter in µs; anything else:
 * the default of a few µs), waits only if the stream's queue is full, and places the kernel on
 * the device's time line (sim_schedule). Streams carry an instant: when their last operation
 * ends (last_end). Synchronising sleeps until that instant.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

static _Atomic unsigned long long next_stream_id = 1;

void sim_atomic_max(a64 *a, uint64_t v) {
    uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak(a, &cur, v)) {}
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

static void ptds_free(void *head) {
    for (struct ptds_entry *e = head, *n; e; e = n) {
        n = e->next;
        e->stream->magic = MAGIC_DEAD;
        free(e->stream);
        free(e);
    }
}

static void ptds_key_init(void) {
    pthread_key_create(&ptds_key, ptds_free);
}

static void stream_init(struct CUstream_st *s, struct CUctx_st *ctx, enum stream_kind kind,
                        unsigned flags, int priority) {
    memset(s, 0, sizeof *s);
    s->magic = MAGIC_STREAM;
    s->kind = kind;
    s->flags = flags;
    s->priority = priority;
    s->ctx = ctx;
    s->id = atomic_fetch_add(&next_stream_id, 1);
}

static struct CUstream_st *per_thread_stream(struct CUctx_st *ctx) {
    for (struct ptds_entry *e = ptds_list; e; e = e->next)
        if (e->ctx == ctx) return e->stream;
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

CUresult sim_stream(CUstream h, int ptds, struct CUstream_st **out) {
    SIM_TRY(sim_ready());
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct CUctx_st *c;
        SIM_TRY(sim_current_ctx(&c));
        if (h == CU_STREAM_PER_THREAD || (h == NULL && ptds)) {
            *out = per_thread_stream(c);
            return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        }
        *out = &c->legacy;
        return CUDA_SUCCESS;
    }
    if (h->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    if (!atomic_load(&h->ctx->alive)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = h;
    return CUDA_SUCCESS;
}

/* Work on the legacy stream waits for all blocking streams; blocking streams wait for the
 * legacy stream; non-blocking streams wait only for themselves. */
uint64_t sim_stream_ready(struct CUstream_st *s) {
    uint64_t own = atomic_load(&s->last_end);
    uint64_t other = 0;
    if (s->kind == STREAM_LEGACY)
        other = atomic_load(&s->ctx->blocking_end);
    else if (s->kind == STREAM_BLOCKING)
        other = atomic_load(&s->ctx->legacy.last_end);
    return own > other ? own : other;
}

static void note_end(struct CUstream_st *s, uint64_t end) {
    sim_atomic_max(&s->last_end, end);
    if (s->kind != STREAM_NON_BLOCKING) sim_atomic_max(&s->ctx->blocking_end, end);
    sim_atomic_max(&s->ctx->all_end, end);
}

static int capture_append(struct CUgraph_st *g, const struct graph_node *node) {
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

int sim_capture_node(struct CUstream_st *s, const struct graph_node *node) {
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (!g) return 0;
    capture_append(g, node);
    return 1;
}

CUresult sim_enqueue(struct CUstream_st *s, uint64_t dur_ns) {
    struct graph_node node = {.kind = NODE_KERNEL, .ns = dur_ns};
    if (sim_capture_node(s, &node)) return CUDA_SUCCESS;
    /* The queue bound: a stream holds at most SIM_QUEUE_DEPTH launches, and not more than
     * sim_queue_ahead_ns() of work beyond now; past that the launch blocks like a real one. The
     * device runs work in the order it was placed (first come, first served across processes):
     * the bound is also how far one process's backlog can delay another's kernels. */
    uint64_t n = atomic_fetch_add(&s->queued, 1);
    a64 *cell = &s->ring[n % SIM_QUEUE_DEPTH];
    uint64_t oldest = atomic_load(cell);
    uint64_t now = sim_now_ns();
    if (oldest > now) sim_sleep_until(oldest);
    uint64_t ready = sim_stream_ready(s), ahead = sim_queue_ahead_ns();
    if (ready > now + ahead) sim_sleep_until(ready - ahead);
    uint64_t end = sim_schedule(s->ctx->slot, ready, dur_ns);
    atomic_store(cell, end);
    note_end(s, end);
    return CUDA_SUCCESS;
}

/* -- launches --------------------------------------------------------------------------------- */

/* The kernel's duration: busy_us reads its first parameter (u64 µs) from kernelParams or from
 * the CU_LAUNCH_PARAM_BUFFER_POINTER buffer in `extra`. */
static CUresult kernel_ns(struct CUfunc_st *f, void **kernelParams, void **extra, uint64_t *ns) {
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
        if (!buf || size < sizeof us) return CUDA_ERROR_INVALID_VALUE;
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
                       void **extra, int ptds) {
    SIM_TRY(sim_ready());
    if (!f || f->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
        (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (kernelParams && extra) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    SIM_TRY(sim_stream(hStream, ptds, &s));
    uint64_t ns;
    SIM_TRY(kernel_ns(f, kernelParams, extra, &ns));
    return sim_enqueue(s, ns);
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, extra, 0);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, extra, 1);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra, int ptds) {
    if (!config) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream, kernelParams, extra, ptds);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    return launch_ex(config, f, kernelParams, extra, 1);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, NULL, 0);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
                  kernelParams, NULL, 1);
}

/* Host functions run on the calling thread once the stream reaches them: later work on the
 * stream is then ordered after them, as in CUDA. */
static CUresult host_func(CUstream hStream, CUhostFn fn, void *userData, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, ptds, &s);
    if (r) return r;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load(&s->capture)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_sleep_until(sim_stream_ready(s));
    fn(userData);
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    return host_func(hStream, fn, userData, 0);
}

CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData) {
    return host_func(hStream, fn, userData, 1);
}

struct callback_args {
    CUstreamCallback cb;
    CUstream stream;
    void *data;
};

static void run_callback(void *p) {
    struct callback_args *a = p;
    a->cb(a->stream, CUDA_SUCCESS, a->data);
}

static CUresult add_callback(CUstream hStream, CUstreamCallback callback, void *userData,
                             unsigned int flags, int ptds) {
    if (flags != 0 || !callback) return sim_ready() ? sim_ready() : CUDA_ERROR_INVALID_VALUE;
    struct callback_args a = {callback, hStream, userData};
    return host_func(hStream, run_callback, &a, ptds);
}

CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                             unsigned int flags) {
    return add_callback(hStream, callback, userData, flags, 0);
}

CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData,
                                  unsigned int flags) {
    return add_callback(hStream, callback, userData, flags, 1);
}

/* -- streams ---------------------------------------------------------------------------------- */

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = malloc(sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    stream_init(s, c, (flags & CU_STREAM_NON_BLOCKING) ? STREAM_NON_BLOCKING : STREAM_BLOCKING,
                flags, priority);
    *phStream = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    return cuStreamCreateWithPriority(phStream, Flags, 0);
}

static int is_special(CUstream h) {
    return h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD;
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    SIM_TRY(sim_ready());
    if (is_special(hStream) || hStream->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    /* Work already queued still completes: the device time line keeps it. */
    hStream->magic = MAGIC_DEAD;
    free(hStream);
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy(CUstream hStream) {
    return cuStreamDestroy_v2(hStream);
}

static CUresult stream_sync(CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (atomic_load(&s->capture)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sim_sleep_until(sim_stream_ready(s));
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    return stream_sync(hStream, 0);
}
CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    return stream_sync(hStream, 1);
}

static CUresult stream_query(CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    return sim_stream_ready(s) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream) {
    return stream_query(hStream, 0);
}
CUresult cuStreamQuery_ptsz(CUstream hStream) {
    return stream_query(hStream, 1);
}

static CUresult stream_wait_event(CUstream h, CUevent e, unsigned flags, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (!e || e->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = atomic_load(&e->capture);
    if (g) { /* joining a capture: this stream now records into the same graph */
        struct CUgraph_st *none = NULL;
        if (atomic_compare_exchange_strong(&s->capture, &none, g)) {
            pthread_mutex_lock(&g->lock);
            if (g->njoined < SIM_MAX_JOINED) g->joined[g->njoined++] = s;
            pthread_mutex_unlock(&g->lock);
        }
        return CUDA_SUCCESS;
    }
    uint64_t t = atomic_load(&e->time);
    if (t) note_end(s, t);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 0);
}

CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

#define STREAM_GETTER(NAME, PTDS, TYPE, EXPR)                                                      \
    CUresult NAME(CUstream hStream, TYPE *out) {                                                   \
        struct CUstream_st *s;                                                                     \
        CUresult r = sim_stream(hStream, PTDS, &s);                                                \
        if (r) return r;                                                                           \
        if (!out) return CUDA_ERROR_INVALID_VALUE;                                                 \
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
