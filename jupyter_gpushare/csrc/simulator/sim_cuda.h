/* sim_cuda.h - objects of the simulated driver (one process's view), shared by the cuda_*.c files.
 *
 * Handles are pointers to these structs; each starts with a magic number so that a stale or
 * foreign handle is refused with CUDA_ERROR_INVALID_HANDLE/CONTEXT instead of being trusted.
 * Timing follows the model of sim_state.h: every stream remembers when its last operation ends
 * (`last_end`); synchronising means sleeping until that instant.
 */
#ifndef GPUSHARE_SIM_CUDA_H
#define GPUSHARE_SIM_CUDA_H

#pragma GCC visibility push(default)
#include "gpushare_cuda.h"
#pragma GCC visibility pop

#include <pthread.h>

#include "sim_state.h"

#define SIM_DRIVER_VERSION 13000
#define SIM_QUEUE_DEPTH    1024 /* launches in flight per stream before one blocks */
#define SIM_QUEUE_AHEAD_NS                                                                         \
    1000000000ull /* ... or work queued this far ahead of now
                                                (GPUSHARE_SIM_QUEUE_AHEAD_US overrides) */
#define SIM_VMM_GRANULARITY (2ull << 20)
#define SIM_MAX_JOINED      64

enum {
    MAGIC_CTX = 0x43545831,
    MAGIC_STREAM = 0x53545231,
    MAGIC_EVENT = 0x45564e31,
    MAGIC_MODULE = 0x4d4f4431,
    MAGIC_LIBRARY = 0x4c494231,
    MAGIC_FUNC = 0x46554e31,
    MAGIC_GRAPH = 0x47525031,
    MAGIC_GRAPH_EXEC = 0x47584531,
    MAGIC_POOL = 0x504f4c31,
    MAGIC_ARRAY = 0x41525231,
    MAGIC_DEAD = 0x44454144,
};

enum stream_kind { STREAM_LEGACY, STREAM_BLOCKING, STREAM_NON_BLOCKING };

struct CUstream_st {
    uint32_t magic;
    enum stream_kind kind;
    unsigned flags;
    int priority;
    struct CUctx_st *ctx;
    unsigned long long id;
    a64 last_end;                         /* when its last operation ends */
    a64 queued;                           /* launches so far; indexes `ring` */
    a64 ring[SIM_QUEUE_DEPTH];            /* end times of its recent launches (the queue bound) */
    _Atomic(struct CUgraph_st *) capture; /* graph being captured into, or NULL */
};

struct CUctx_st {
    uint32_t magic;
    int ordinal; /* CUDA ordinal (after CUDA_VISIBLE_DEVICES) */
    int slot;    /* device slot in the shared state */
    int primary;
    unsigned flags;
    _Atomic int alive;
    unsigned long long id;
    uint64_t charge;           /* generation of its GPUSHARE_SIM_CONTEXT_BYTES charge, or 0 */
    a64 blocking_end;          /* latest end on the legacy stream and the blocking streams */
    a64 all_end;               /* latest end of anything in this context */
    struct CUstream_st legacy; /* the legacy default stream (NULL, CU_STREAM_LEGACY) */
    struct CUctx_st *next_ctx; /* all contexts ever made (kept: handles stay readable) */
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    a64 time; /* when the recorded work completes; 0: never recorded */
    _Atomic(struct CUgraph_st *) capture;
};

struct CUfunc_st {
    uint32_t magic;
    int busy; /* a `busy_us` kernel: runs its first u64 parameter µs */
    struct CUmod_st *module;
    struct CUfunc_st *next;
    int max_dynamic_shared;
    char name[];
};

struct CUmod_st {
    uint32_t magic; /* MAGIC_MODULE or MAGIC_LIBRARY (a CUlibrary is a module) */
    pthread_mutex_t lock;
    struct CUfunc_st *funcs;
    struct CUmod_st *next; /* all loaded modules */
};

enum node_kind { NODE_KERNEL, NODE_COPY, NODE_SET8, NODE_SET16, NODE_SET32 };

struct graph_node {
    enum node_kind kind;
    uint64_t ns; /* kernel duration */
    void *dst;
    const void *src;
    size_t count; /* bytes for a copy, elements for a set */
    unsigned value;
};

struct CUgraph_st {
    uint32_t magic;
    pthread_mutex_t lock;
    struct graph_node *nodes;
    size_t count, cap;
    struct CUstream_st *origin;                 /* the stream whose capture made it */
    struct CUstream_st *joined[SIM_MAX_JOINED]; /* streams that joined through events */
    int njoined;
};

struct CUgraphExec_st {
    uint32_t magic;
    struct graph_node *nodes;
    size_t count;
    uint64_t total_ns;
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int slot;
    int ordinal;
    a64 used, used_high, threshold;
};

struct CUarray_st {
    uint32_t magic;
    int slot;
    uint64_t bytes;
    uint64_t gen;         /* generation of the memory charge (sim_mem_reserve) */
    struct CUctx_st *ctx; /* freed with its context */
    struct CUarray_st *next;
};

/* -- cuda_context.c --------------------------------------------------------------------------- */
/* The prologue of most entry points: returns the error of `call` (sim_ready(), sim_current_ctx(),
 * sim_device_ordinal(), a handle check) from the calling function. */
#define SIM_TRY(call)                                                                              \
    do {                                                                                           \
        CUresult try_ = (call);                                                                    \
        if (try_ != CUDA_SUCCESS) return try_;                                                     \
    } while (0)

CUresult sim_ready(void);                        /* cuInit done and state open */
struct CUctx_st *sim_current(void);              /* this thread's current context or NULL */
CUresult sim_current_ctx(struct CUctx_st **out); /* ... or an error */
CUresult sim_device_ordinal(CUdevice dev);       /* CUDA_SUCCESS when dev names a device */
uint64_t sim_kernel_default_ns(void);
uint64_t sim_queue_ahead_ns(void);

/* -- cuda_stream.c ---------------------------------------------------------------------------- */
/* Resolves a stream handle (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a stream); ptds says
 * the call came through a per-thread-default-stream entry point. */
CUresult sim_stream(CUstream h, int ptds, struct CUstream_st **out);
/* When everything issued before on `s` has finished (its dependencies included). */
uint64_t sim_stream_ready(struct CUstream_st *s);
/* Places dur_ns of device work on `s` (or records it into the stream's capture). */
CUresult sim_enqueue(struct CUstream_st *s, uint64_t dur_ns);
/* Captures a copy or set node when `s` is capturing; returns 1 if it did. */
int sim_capture_node(struct CUstream_st *s, const struct graph_node *node);
void sim_atomic_max(a64 *a, uint64_t v);

/* -- cuda_memory.c ---------------------------------------------------------------------------- */
void sim_free_context_memory(struct CUctx_st *ctx);
/* Whether [ptr, ptr+n) is device memory of this process: an allocation or a VMM mapping. */
int sim_device_range(uint64_t ptr, uint64_t n);

#endif
