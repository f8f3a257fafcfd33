/* gs.h - internals of libgpushare.so, the CUDA interposer (DEVELOPING.md, box 7).
 *
 * Files: dispatch.c (real symbols, dlsym and cuGetProcAddress); leases: admit.c (the slow path:
 * waiting for a lease, joining it, fail static), runahead.c (queued device time: marks, backlog,
 * drain estimate, runahead bound), backfill.c (filling the holder's host gaps, timing a launch
 * onto an idle stream, the idle clock), drain.c (the end of a lease: drain, direct handoff,
 * extension), agent.c (the agent thread), connect.c (the daemon connection: hello, lease
 * memory), init.c (env, init, fork, logging); memory.c (the cap: reserve/rollback, frees, memory queries incl.
 * NVML), launch.c (every launch path, streams, capture), release.c (a released share). The wire
 * format is in ../include/gpushare_wire.h.
 */
#ifndef GS_H
#define GS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "gpushare_cuda.h"
#include "gpushare_wire.h"

#define GS_MAX_GPUS 16

/* -- real driver entry points (dispatch.c) -------------------------------------------------- */
/* Every hooked symbol: our wrapper is exported under its name, the real one is real_<name>. */
/* clang-format off */
#define GS_HOOKS(X)                                                                           \
    X(cuInit) X(cuGetProcAddress) X(cuGetProcAddress_v2)                                       \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)      \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz)                             \
    X(cuGraphLaunch) X(cuGraphLaunch_ptsz)                                                     \
    X(cuStreamDestroy) X(cuStreamDestroy_v2)                                                   \
    X(cuStreamBeginCapture) X(cuStreamBeginCapture_v2) X(cuStreamBeginCapture_v2_ptsz)         \
    X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz)                                           \
    X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemAllocManaged)                 \
    X(cuMemFree_v2)                                                               \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync)                      \
    X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz)                   \
    X(cuMemCreate) X(cuMemRelease) X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) \
    X(cuMemGetInfo_v2) X(cuDeviceTotalMem_v2)                                                 \
    X(cuDevicePrimaryCtxRetain) X(cuCtxCreate_v2) X(cuCtxCreate_v3) X(cuCtxCreate_v4)         \
    X(cuGetErrorString)
/* clang-format on */

/* Real entry points we call but do not wrap. */
/* clang-format off */
#define GS_USES(X)                                                                            \
    X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice) X(cuEventCreate)                   \
    X(cuEventRecord) X(cuEventSynchronize) X(cuEventQuery) X(cuEventDestroy_v2)            \
    X(cuEventElapsedTime_v2)                \
    X(cuStreamIsCapturing) X(cuThreadExchangeStreamCaptureMode) X(cuCtxSynchronize)            \
    X(cuDeviceGetCount) X(cuDevicePrimaryCtxReset_v2) X(cuDevicePrimaryCtxRelease_v2)          \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2)
/* clang-format on */

#define GS_DECLARE_REAL(name) extern __typeof__(&name) real_##name;
GS_HOOKS(GS_DECLARE_REAL)
GS_USES(GS_DECLARE_REAL)
#undef GS_DECLARE_REAL

/* NVML (declared here: no NVML header either). */
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
/* Process lists (layouts of nvml.h): each entry starts with the pid, except
 * nvmlProcessUtilizationInfo_v1_t (after a time stamp). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct { /* _v2 and _v3 */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;
typedef struct {
    unsigned int version, mode, numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;
typedef struct {
    unsigned int version, processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_v1_t;
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                  nvmlProcessInfo_v1_t *infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                   nvmlProcessInfo_v1_t *infos);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_v1_t *infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                        nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                        nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                   nvmlProcessDetailList_v1_t *plist);
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeen);
nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                   nvmlProcessesUtilizationInfo_v1_t *info);
/* The NVML functions we wrap (memory.c: inside a share, memory info and process lists describe
 * the share); the real one is real_<name>. */
/* clang-format off */
#define GS_NVML_HOOKS(X)                                                                      \
    X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)                                   \
    X(nvmlDeviceGetComputeRunningProcesses) X(nvmlDeviceGetComputeRunningProcesses_v2)         \
    X(nvmlDeviceGetComputeRunningProcesses_v3) X(nvmlDeviceGetGraphicsRunningProcesses)        \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2) X(nvmlDeviceGetGraphicsRunningProcesses_v3)    \
    X(nvmlDeviceGetMPSComputeRunningProcesses) X(nvmlDeviceGetMPSComputeRunningProcesses_v2)   \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3) X(nvmlDeviceGetRunningProcessDetailList)     \
    X(nvmlDeviceGetProcessUtilization) X(nvmlDeviceGetProcessesUtilizationInfo)
/* clang-format on */
#define GS_DECLARE_REAL(name) extern __typeof__(&name) real_##name;
GS_NVML_HOOKS(GS_DECLARE_REAL)
#undef GS_DECLARE_REAL
extern nvmlReturn_t (*real_nvmlDeviceGetUUID)(nvmlDevice_t, char *, unsigned int);

/* Resolves every real symbol once; safe from any thread. */
void gs_resolve(void);
/* The wrapper exported for a driver symbol name, or NULL when we do not wrap it. */
void *gs_wrapper_for(const char *name);

/* -- per-GPU state (leases) ------------------------------------------------------------------- */
#define GS_MARKS 16
/* a stream's drain event (struct gs_stream.event): timed (the lease is charged from it) and waited
 * for by sleeping in the driver until the device signals it, not by spinning (drain.c) */
#define GS_DRAIN_EVENT_FLAGS CU_EVENT_BLOCKING_SYNC
struct gs_mark { /* an event recorded before a launch (runahead bound) */
    CUevent event;
    uint64_t count; /* launches on the stream before it */
    /* 1: the mark before it was still queued when it was recorded; 2: a launch was (a first
     * estimate of the device time per launch: runahead.c) */
    int busy;
};

struct gs_stream { /* a stream this process launched on */
    CUcontext ctx;
    CUstream stream; /* normalised: 0/per-thread -> CU_STREAM_LEGACY */
    CUevent event;   /* created lazily in ctx */
    CUevent probe;   /* "is work still queued?" (the agent's idle check) */
    uint64_t lease;  /* lease_until of the last lease it was used under */
    /* runahead bound in device time (runahead.c: gs_runahead_bound) */
    uint64_t count;                 /* launches admitted on it (approximate across threads) */
    struct gs_mark marks[GS_MARKS]; /* oldest first from mhead: queued marks */
    unsigned mhead, mlen;
    CUevent ref_event;  /* the newest mark known complete ... */
    uint64_t ref_count; /* ... and the launches before it */
    int ref_valid;
    uint64_t launch_ns; /* device time per launch (EWMA of busy intervals), 0 unknown */
    /* one launch onto the idle stream timed from an event before it to one after it
     * (backfill.c): the device time of a launch where launch_ns cannot learn it (a sync after
     * every launch), and what a backfill launch is charged */
    CUevent t0, t1;
    int tstate;       /* 0 none, 1 t0 recorded (t1 after the launch), 2 both: to read */
    int tbackfill;    /* the timed launch is a backfill: charge it to the account */
    uint64_t solo_ns; /* device time per launch onto an idle stream (EWMA), 0 unknown */
    uint64_t prev_end, prev_lease,
        idle_from;             /* the idle clock (backfill.c): last timed launch's end */
    uint64_t t0_host, t_floor; /* a backfill's t0 (CLOCK_MONOTONIC) and when the holder's work
                                  ahead of it should be done: what it is charged from */
    struct gs_stream *next;
};

struct gs_gpu {
    char uuid[64];
    struct gpushare_wire_header *header; /* the lease board's header; NULL while not connected */
    /* Our slot's three mappings (wire.py), each `local` before the first connection:
     * - slot: the lease board, shared read-write with the GPU's other tenants: lease fields
     *   only (lease_until/start, grant_seq, joined, waiters, drain_end/eta, first_launch,
     *   launches);
     * - policy: mapped read-only (the agent writes it): state, generation, mem_cap,
     *   request_ppm, limit_ppm, runahead_ns, allocation;
     * - account: this allocation's own: mem_used, mem_peak, oom_count, lease_waits, wait_ns,
     *   fs_next_ns (fail static: the share's pacing, admit.c). */
    struct gpushare_wire_slot *_Atomic slot;
    struct gpushare_wire_slot *_Atomic policy;
    struct gpushare_wire_slot *_Atomic account;
    struct gpushare_wire_slot *policy_slots; /* the policy mapping's slots (others' state) */
    struct gpushare_wire_slot local;         /* stand-in slot before the first connection */
    uint64_t generation;
    int slot_index; /* our slot in the shared file (-1: local) */
    void *map;
    uint64_t map_id[3][2];         /* dev/ino of board, policy, account (a reconnect may
                                            hand us the same files) */
    _Atomic uint64_t joined_lease; /* lease this process joined (0: none) */
    _Atomic uint64_t last_launch_ns;
    _Atomic uint64_t proc_mem; /* bytes this process holds (moved on remap) */
    pthread_mutex_t streams_lock;
    struct gs_stream *streams;
    /* device-side timing of a lease: an event recorded at this process's first launch */
    CUevent start_event;
    CUcontext start_ctx;
    uint64_t start_lease;   /* lease the start event belongs to */
    uint64_t untimed_lease; /* an extended lease: charged by the wall clock (see try_extend) */
    uint64_t join_ns;       /* CLOCK_MONOTONIC when this process joined it */
    uint64_t start_host_ns; /* CLOCK_MONOTONIC when start_event was recorded on an idle stream:
                                its device time (a clock anchor for drain estimates) */
};

struct gs_global {
    int enabled; /* GPUSHARE_SOCKET set: enforce; otherwise pass through */
    int ngpus;
    struct gs_gpu gpu[GS_MAX_GPUS];
    char allocation[64];
    char socket_path[108];
    double request; /* from env until the daemon answers */
    uint64_t quantum_ns;
    _Atomic int connected;
    _Atomic int failstatic; /* daemon unreachable: self-limit at the request share */
    _Atomic int denied;     /* refused / released: launches and allocations fail */
    _Atomic int capturing;  /* streams currently capturing (process-wide) */
    int sock;
    pthread_mutex_t sock_lock;
    int wake_pipe[2]; /* pokes the agent thread */
    char deny_reason[256];
    int runahead_launches;     /* launches on a stream between two runahead checks */
    uint64_t last_connect_try; /* the agent's last reconnection attempt */
    _Atomic int agent_running;
};
extern struct gs_global gs;

/* Once per process (and again in a forked child): env, daemon connection, agent thread. */
void gs_init(void);
static inline uint64_t gs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The GPU of the calling thread's current context (NULL: not ours / not enforced). */
struct gs_gpu *gs_current_gpu(void);
struct gs_gpu *gs_gpu_of_ordinal(int ordinal);

/* Launch admission: CUDA_SUCCESS when the caller may launch on `stream` now (waits for a lease
 * if needed); CUDA_ERROR_NOT_PERMITTED when the share was refused or released. */
CUresult gs_admit_slow(struct gs_gpu *g, CUstream stream);

struct gs_tls {
    uint64_t lease;  /* lease this thread last launched under */
    CUstream stream; /* ... on this stream */
    struct gs_gpu *gpu;
    int budget;             /* launches before the next runahead check */
    int given;              /* the budget the last slow path gave (launch counting) */
    struct gs_stream *tail; /* record its t1 after this launch (backfill.c), else NULL */
    struct gs_gpu *tail_gpu;
};
extern __thread struct gs_tls gs_tl;

/* The fast path: one atomic load of the slot's lease, one vDSO clock read, two compares. */
static inline CUresult gs_admit(struct gs_gpu *g, CUstream stream) {
    uint64_t until = atomic_load_explicit(&g->slot->lease_until_ns, memory_order_acquire);
    if (__builtin_expect(until == gs_tl.lease && stream == gs_tl.stream && gs_tl.gpu == g &&
                             --gs_tl.budget > 0,
                         1)) {
        uint64_t now = gs_now();
        if (__builtin_expect(now < until, 1)) {
            atomic_store_explicit(&g->last_launch_ns, now, memory_order_relaxed);
            return CUDA_SUCCESS;
        }
    }
    return gs_admit_slow(g, stream);
}

/* Stream bookkeeping (launch.c / drain.c). */
void gs_stream_forget(CUstream stream);
int gs_stream_capturing(CUstream stream);

/* -- memory (memory.c) ---------------------------------------------------------------------- */
/* Reserves bytes against g's cap: 0 ok, -1 over the cap (counted as an OOM refusal). */
int gs_mem_reserve(struct gs_gpu *g, uint64_t bytes);
void gs_mem_unreserve(struct gs_gpu *g, uint64_t bytes);
void gs_mem_track(uint64_t key, int kind, struct gs_gpu *g, uint64_t bytes);
/* Forgets a tracked allocation and gives its bytes back; 0 when it was not tracked. */
uint64_t gs_mem_untrack(uint64_t key, int kind);
void gs_mem_reset_after_fork(void);

/* Frees every tracked allocation with the real driver; returns the bytes (release.c uses it). */
uint64_t gs_mem_free_all(void);

/* -- a released share (release.c) ------------------------------------------------------------ */
#define GS_RELEASED_REASON                                                                         \
    "the GPU share of this kernel was released and its GPU memory freed; this process cannot "     \
    "use a GPU again. Restart the kernel to get a new share (`%gpushare request` in the "          \
    "notebook reserves one first)"
/* The agent's periodic check: frees the process's GPU memory once its share is released. */
void gs_check_released(void);

void gs_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void gs_deny_message(void);

/* -- lease internals (init.c, connect.c, admit.c, runahead.c, drain.c, agent.c) -------------- */
#define GS_DEFAULT_QUANTUM_NS 20000000ull
/* init.c: refuses every launch and allocation from now on, with `reason` */
void gs_deny(const char *reason);
void gs_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t timeout_ns);
void gs_sleep_ns(uint64_t ns);
void gs_atomic_max64(_Atomic uint64_t *p, uint64_t v);
void gs_dec_floor(_Atomic uint32_t *p);
/* connect.c: 0 connected, -1 daemon unreachable (fail static), -2 refused (denied) */
int gs_connect_and_hello(void);
void gs_disconnect(void);
int gs_agent_pids(unsigned *pids, int max, unsigned *self); /* the agent's `pids` (NVML) */
void gs_send_line(const char *line);
void gs_send_lease_msg(const char *op, struct gs_gpu *g, uint64_t lease);
/* agent.c */
void gs_agent_start(void);
void gs_poke_agent(void);
/* drain.c */
struct gs_stream *gs_note_stream(struct gs_gpu *g, CUstream stream, uint64_t lease);
int gs_streams_busy(struct gs_gpu *g, uint64_t lease);
void gs_finish_lease(struct gs_gpu *g, uint64_t lease);
int gs_try_extend(struct gs_gpu *g, uint64_t lease);
/* runahead.c (streams_lock held for gs_drain_eta) */
uint64_t gs_drain_eta(struct gs_gpu *g, struct gs_stream *e);
void gs_runahead_check(struct gs_gpu *g, struct gs_stream *e);
int gs_runahead_bound(struct gs_gpu *g, struct gs_stream *e, uint64_t prior, uint64_t bound,
                      uint64_t lease);
/* backfill.c: the holder says when its queue should be done (and times a launch onto its idle
 * stream); a waiting share backfills the holder's host gap (1: launch now, else *look_ns: when to
 * look again, 0 nothing to wait for); after a launch, the timing event behind it */
void gs_holder_queue(struct gs_gpu *g, struct gs_stream *e, int budget, uint64_t bound,
                     uint64_t lease);
int gs_backfill(struct gs_gpu *g, CUstream stream, uint64_t *look_ns);
void gs_before_launch(void);
void gs_after_launch(CUresult r);
/* The launch wrappers' tail: one thread-local load when nothing is timed (launch.c). */
static inline void gs_launching(void) {
    if (__builtin_expect(gs_tl.tail != NULL, 0)) gs_before_launch();
}
static inline CUresult gs_launched(CUresult r) {
    if (__builtin_expect(gs_tl.tail != NULL, 0)) gs_after_launch(r);
    return r;
}

#endif
