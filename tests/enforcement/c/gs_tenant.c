/* gs_tenant - a test and benchmark tenant for the interposer, driving the CUDA driver API like a
 * framework does (dlopen("libcuda.so.1") + dlsym, so the interposer's dlsym path is used).
 *
 *   gs_tenant spin SECONDS KERNEL_US SYNC_EVERY   saturating loop of busy_us kernels on a
 *                                                 non-blocking stream; prints progress lines
 *   gs_tenant small SECONDS PERIOD_MS             a small kernel every PERIOD_MS: wait stats
 *   gs_tenant load SECONDS KERNEL_US PATTERN      a workload shape (load() below): sync, deep,
 *                                                 streams, graph, interactive; progress lines
 *   gs_tenant mem THREADS ITERS MAXBYTES SEED     random alloc/free from threads; invariants
 *   gs_tenant bench N                             ns per launch (busy_us(0)) and per direct call
 *   gs_tenant wake N                              the host's wake-up latency (N sleeps of 2 ms)
 *   gs_tenant futex N PERIOD_US                   the host's floor for a handoff: a thread in
 *                                                 one process wakes one sleeping in another on
 *                                                 a shared futex (N times, every PERIOD_US)
 *   gs_tenant info                                memory as the process sees it
 *   gs_tenant fork SECONDS KERNEL_US              spin in a forked child and in the parent
 *   gs_tenant paths                               every launch and allocation path once
 *
 * With GS_TENANT_WAIT_FILE=path it waits for that file before its first CUDA call (tests record
 * the pid in the ledger meanwhile). Output: JSON lines on stdout. Exit 3 when CUDA refuses
 * (CUDA_ERROR_NOT_PERMITTED), 2 on other errors.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpushare_cuda.h"

#define FN(name) static __typeof__(&name) p_##name
FN(cuInit);
FN(cuDeviceGet);
FN(cuDevicePrimaryCtxRetain);
FN(cuCtxSetCurrent);
FN(cuModuleLoadData);
FN(cuModuleGetFunction);
FN(cuLaunchKernel);
FN(cuStreamCreate);
FN(cuStreamSynchronize);
FN(cuMemAlloc_v2);
FN(cuMemFree_v2);
FN(cuMemGetInfo_v2);
FN(cuDeviceTotalMem_v2);
FN(cuDeviceGetCount);
FN(cuGetProcAddress_v2);
FN(cuCtxSynchronize);
FN(cuMemAllocAsync);
FN(cuMemFreeAsync);
FN(cuMemAllocManaged);
FN(cuMemAllocPitch_v2);
FN(cuMemCreate);
FN(cuMemRelease);
FN(cuLaunchKernelEx);
FN(cuGraphLaunch);
FN(cuEventCreate);
FN(cuEventRecord);
FN(cuEventSynchronize);
FN(cuEventQuery);
FN(cuEventElapsedTime);
FN(cuLaunchCooperativeKernel);
FN(cuStreamBeginCapture_v2);
FN(cuStreamEndCapture);
FN(cuGraphInstantiateWithFlags);
FN(cuArrayCreate_v2);
FN(cuArrayDestroy);
FN(cuMemAllocFromPoolAsync);
FN(cuDeviceGetDefaultMemPool);

static CUcontext ctx;
static CUfunction busy;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what, CUresult r) {
    printf("{\"error\":%d,\"where\":\"%s\"}\n", (int)r, what);
    fflush(stdout);
    _exit(r == CUDA_ERROR_NOT_PERMITTED ? 3 : 2);
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) die(#call, r_);                                                    \
    } while (0)

static void load(void) {
    const char *wait = getenv("GS_TENANT_WAIT_FILE");
    while (wait && access(wait, F_OK) != 0) usleep(2000);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        printf("{\"error\":-1,\"where\":\"dlopen %s\"}\n", dlerror());
        _exit(2);
    }
#define LOAD(name) p_##name = (__typeof__(&name))dlsym(lib, #name)
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuModuleLoadData);
    LOAD(cuModuleGetFunction);
    LOAD(cuStreamCreate);
    LOAD(cuStreamSynchronize);
    LOAD(cuMemAlloc_v2);
    LOAD(cuMemFree_v2);
    LOAD(cuMemGetInfo_v2);
    LOAD(cuDeviceTotalMem_v2);
    LOAD(cuDeviceGetCount);
    LOAD(cuGetProcAddress_v2);
    LOAD(cuCtxSynchronize);
    LOAD(cuMemAllocAsync);
    LOAD(cuMemFreeAsync);
    LOAD(cuMemAllocManaged);
    LOAD(cuMemAllocPitch_v2);
    LOAD(cuMemCreate);
    LOAD(cuMemRelease);
    LOAD(cuLaunchKernelEx);
    LOAD(cuGraphLaunch);
    LOAD(cuEventCreate);
    LOAD(cuEventRecord);
    LOAD(cuEventSynchronize);
    LOAD(cuEventQuery);
    LOAD(cuEventElapsedTime);
    LOAD(cuLaunchCooperativeKernel);
    LOAD(cuStreamBeginCapture_v2);
    LOAD(cuStreamEndCapture);
    LOAD(cuGraphInstantiateWithFlags);
    LOAD(cuArrayCreate_v2);
    LOAD(cuArrayDestroy);
    LOAD(cuMemAllocFromPoolAsync);
    LOAD(cuDeviceGetDefaultMemPool);
    CHECK(p_cuInit(0));
    /* launches go through cuGetProcAddress_v2 like the CUDA runtime's */
    CUdriverProcAddressQueryResult q;
    CHECK(p_cuGetProcAddress_v2("cuLaunchKernel", (void **)&p_cuLaunchKernel, 12000, 0, &q));
    CUdevice dev;
    CHECK(p_cuDeviceGet(&dev, 0));
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(p_cuCtxSetCurrent(ctx));
    CUmodule mod;
    CHECK(p_cuModuleLoadData(&mod, "gs_tenant"));
    CHECK(p_cuModuleGetFunction(&busy, mod, "busy_us"));
}

static CUresult launch_us(CUstream s, uint64_t us) {
    void *params[] = {&us};
    return p_cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
}

/* Saturating tenant: batches of SYNC_EVERY kernels, two batches always queued behind the one
 * being waited for (like a framework running ahead), so the tenant's own wake-ups do not leave
 * the device idle. Progress lines {"t": ns, "done_us": device µs completed}. */
static int spin(double seconds, uint64_t kernel_us, int sync_every) {
    load();
    CUstream s;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    const char *hold = getenv("GS_TENANT_HOLD_BYTES"); /* memory kept for the whole run */
    CUdeviceptr held = 0;
    if (hold) CHECK(p_cuMemAlloc_v2(&held, strtoull(hold, NULL, 10)));
    CUevent ev[3];
    for (int i = 0; i < 3; i++) CHECK(p_cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
    uint64_t start = now_ns(), end = start + (uint64_t)(seconds * 1e9), next_print = 0;
    uint64_t done = 0;
    long batch = 0;
    printf("{\"start\":%llu,\"pid\":%d}\n", (unsigned long long)start, (int)getpid());
    while (now_ns() < end) {
        for (int i = 0; i < sync_every; i++) CHECK(launch_us(s, kernel_us));
        CHECK(p_cuEventRecord(ev[batch % 3], s));
        if (batch > 1) { /* two batches stay queued */
            CHECK(p_cuEventSynchronize(ev[(batch - 2) % 3]));
            done += (uint64_t)sync_every * kernel_us;
        }
        batch++;
        uint64_t t = now_ns();
        if (t >= next_print) {
            printf("{\"t\":%llu,\"done_us\":%llu}\n", (unsigned long long)t,
                   (unsigned long long)done);
            fflush(stdout);
            next_print = t + 50000000ull;
        }
    }
    CHECK(p_cuStreamSynchronize(s));
    if (held) CHECK(p_cuMemFree_v2(held));
    done += (uint64_t)sync_every * kernel_us * (uint64_t)(batch > 1 ? 2 : batch);
    printf("{\"t\":%llu,\"done_us\":%llu,\"end\":true}\n", (unsigned long long)now_ns(),
           (unsigned long long)done);
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Interactive tenant: a 100 µs kernel every period; how long launch+sync took beyond it. */
static int small(double seconds, double period_ms) {
    load();
    CUstream s;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    size_t n = 0, cap = 100000;
    uint64_t *lat = malloc(cap * sizeof *lat);
    uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
    while (now_ns() < end && n < cap) {
        uint64_t t0 = now_ns();
        CHECK(launch_us(s, 100));
        CHECK(p_cuStreamSynchronize(s));
        uint64_t took = now_ns() - t0;
        lat[n++] = took > 100000 ? took - 100000 : 0;
        usleep((useconds_t)(period_ms * 1000));
    }
    qsort(lat, n, sizeof *lat, cmp_u64);
    printf("{\"n\":%zu,\"p50_us\":%.1f,\"p99_us\":%.1f,\"max_us\":%.1f}\n", n,
           n ? lat[n / 2] / 1e3 : 0.0, n ? lat[(n * 99) / 100] / 1e3 : 0.0,
           n ? lat[n - 1] / 1e3 : 0.0);
    free(lat);
    return 0;
}

/* -- workload shapes (the benchmark matrix) ------------------------------------------------- */

struct progress {
    uint64_t done_us, next_print;
};

static void progress_line(struct progress *p, int last) {
    uint64_t t = now_ns();
    if (!last && t < p->next_print) return;
    printf("{\"t\":%llu,\"done_us\":%llu%s}\n", (unsigned long long)t,
           (unsigned long long)p->done_us, last ? ",\"end\":true" : "");
    fflush(stdout);
    p->next_print = t + 50000000ull;
}

#define RING 64

/* A queue of launches on one stream, `depth` batches of `batch` launches deep: an event after
 * each batch, the oldest waited for once the ring is full. Each completed batch's device time is
 * known (the events are timed against `ref`, recorded on the idle stream at the start: its device
 * time is the host clock then), and lines {"q": k, "dt": device ns, "dd": device µs of this
 * queue done by then} say it, at most every 50 ms of device time per queue, so a benchmark can
 * count the device time a tenant got inside a window exactly (enforcement_support.
 * device_shares) however long the tenant itself was blocked around the window's edges. */
struct queue {
    CUstream s;
    CUevent ev[RING];
    long head, tail; /* batches recorded [head, tail) */
    int index;
    CUevent ref;
    uint64_t ref_ns, done_us, printed_dt;
};

static int queues; /* queues made by this process (a forked one numbers from 16 x its rank) */

static void queue_init(struct queue *q) {
    CHECK(p_cuStreamCreate(&q->s, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < RING; i++) CHECK(p_cuEventCreate(&q->ev[i], CU_EVENT_DEFAULT));
    q->head = q->tail = 0;
    q->index = queues++;
    q->done_us = q->printed_dt = 0;
    CHECK(p_cuEventCreate(&q->ref, CU_EVENT_DEFAULT));
    q->ref_ns = now_ns();
    CHECK(p_cuEventRecord(q->ref, q->s));
}

/* The oldest batch is done: count it, and say when the device finished it. */
static void queue_retire(struct queue *q, uint64_t batch_us, struct progress *p, int last) {
    float ms = 0;
    q->done_us += batch_us;
    p->done_us += batch_us;
    if (p_cuEventElapsedTime && p_cuEventElapsedTime(&ms, q->ref, q->ev[q->head % RING]) == 0) {
        uint64_t dt = q->ref_ns + (uint64_t)((double)ms * 1e6);
        /* a report every 50 ms of device time; 1 ms of slack: elapsed times are floats, and
         * two kernels exactly 50 ms apart could read 49.999 ms, skip a report and place the
         * skipped kernel's work next to a later one (a window over-counted by a kernel) */
        if (last || dt + 1000000ull >= q->printed_dt + 50000000ull) {
            printf("{\"q\":%d,\"dt\":%llu,\"dd\":%llu}\n", q->index, (unsigned long long)dt,
                   (unsigned long long)q->done_us);
            q->printed_dt = dt;
        }
    }
    q->head++;
}

/* Records the end of a batch; waits for the oldest while more than `depth` are queued. */
static void queue_batch(struct queue *q, long depth, uint64_t batch_us, struct progress *p) {
    CHECK(p_cuEventRecord(q->ev[q->tail % RING], q->s));
    q->tail++;
    /* progress as the device makes it (not as the queue is waited for) */
    while (q->head < q->tail && p_cuEventQuery(q->ev[q->head % RING]) == CUDA_SUCCESS)
        queue_retire(q, batch_us, p, 0);
    while (q->tail - q->head > depth) {
        CHECK(p_cuEventSynchronize(q->ev[q->head % RING]));
        queue_retire(q, batch_us, p, 0);
    }
}

static void queue_drain(struct queue *q, uint64_t batch_us, struct progress *p) {
    while (q->head < q->tail) {
        CHECK(p_cuEventSynchronize(q->ev[q->head % RING]));
        queue_retire(q, batch_us, p, q->head + 1 == q->tail);
    }
}

/* Workload shapes, each saturating unless said otherwise; progress lines as spin's:
 *   sync         a cuStreamSynchronize after every launch (nothing queued ahead);
 *   deep         launches never wait until ~2 s of device time (at most 1024 launches) is
 *                queued: a framework running far ahead;
 *   streams      four non-blocking streams, each with two batches queued;
 *   graph        a CUDA graph of kernels (about 2 ms of device time, at least one kernel)
 *                replayed, two replays queued;
 *   pipelined    spin's shape (batches of 8 launches, two batches queued) with the device-time
 *                reports of a queue: spin's progress counts a batch when it is waited for, so
 *                with long kernels a window edge misplaces up to a batch (8 x 100 ms);
 *   interactive  bursts: 5 ms of kernels then a sync and 45 ms of think time (about 0.1 of the
 *                device when alone); prints the burst latency beyond its device time at the end.
 */
static int load_pattern(double seconds, uint64_t kernel_us, const char *pattern) {
    load();
    if (kernel_us == 0) kernel_us = 1;
    /* GS_TENANT_PROCESSES=N: N processes of the share run the shape (forked children) */
    const char *procs = getenv("GS_TENANT_PROCESSES");
    int children = procs ? atoi(procs) - 1 : 0, is_child = 0;
    pid_t kids[16];
    if (children > 16) children = 16;
    fflush(stdout);
    for (int i = 0; i < children; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            is_child = 1;
            children = 0;
            queues = 16 * (i + 1);
            CHECK(p_cuCtxSetCurrent(ctx));
            break;
        }
    }
    struct progress p = {0, 0};
    uint64_t start = now_ns(), end = start + (uint64_t)(seconds * 1e9);
    printf("{\"start\":%llu,\"pid\":%d,\"pattern\":\"%s\"}\n", (unsigned long long)start,
           (int)getpid(), pattern);
    if (strcmp(pattern, "sync") == 0) {
        CUstream s;
        CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        while (now_ns() < end) {
            CHECK(launch_us(s, kernel_us));
            CHECK(p_cuStreamSynchronize(s));
            p.done_us += kernel_us;
            progress_line(&p, 0);
        }
    } else if (strcmp(pattern, "deep") == 0) {
        struct queue q;
        queue_init(&q);
        long queued = (long)(2000000 / kernel_us); /* launches in ~2 s of device time */
        if (queued > 1024) queued = 1024;
        if (queued < 2) queued = 2;
        long batch = queued / 32 > 0 ? queued / 32 : 1, depth = queued / batch;
        while (now_ns() < end) {
            for (long i = 0; i < batch; i++) CHECK(launch_us(q.s, kernel_us));
            queue_batch(&q, depth, (uint64_t)batch * kernel_us, &p);
            progress_line(&p, 0);
        }
        queue_drain(&q, (uint64_t)batch * kernel_us, &p);
    } else if (strcmp(pattern, "streams") == 0) {
        struct queue q[4];
        for (int k = 0; k < 4; k++) queue_init(&q[k]);
        long batch = (long)(2000 / kernel_us) > 1 ? (long)(2000 / kernel_us) : 1;
        while (now_ns() < end) {
            for (int k = 0; k < 4; k++) {
                for (long i = 0; i < batch; i++) CHECK(launch_us(q[k].s, kernel_us));
                queue_batch(&q[k], 2, (uint64_t)batch * kernel_us, &p);
            }
            progress_line(&p, 0);
        }
        for (int k = 0; k < 4; k++) queue_drain(&q[k], (uint64_t)batch * kernel_us, &p);
    } else if (strcmp(pattern, "graph") == 0) {
        struct queue q;
        queue_init(&q);
        CUstream cap;
        CHECK(p_cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
        long nodes = (long)(2000 / kernel_us) > 1 ? (long)(2000 / kernel_us) : 1;
        if (nodes > 256) nodes = 256;
        CUgraph graph = NULL;
        CUgraphExec exec = NULL;
        CHECK(p_cuStreamBeginCapture_v2(cap, CU_STREAM_CAPTURE_MODE_RELAXED));
        for (long i = 0; i < nodes; i++) CHECK(launch_us(cap, kernel_us));
        CHECK(p_cuStreamEndCapture(cap, &graph));
        CHECK(p_cuGraphInstantiateWithFlags(&exec, graph, 0));
        while (now_ns() < end) {
            CHECK(p_cuGraphLaunch(exec, q.s));
            queue_batch(&q, 2, (uint64_t)nodes * kernel_us, &p);
            progress_line(&p, 0);
        }
        queue_drain(&q, (uint64_t)nodes * kernel_us, &p);
    } else if (strcmp(pattern, "pipelined") == 0) {
        struct queue q;
        queue_init(&q);
        while (now_ns() < end) {
            for (int i = 0; i < 8; i++) CHECK(launch_us(q.s, kernel_us));
            queue_batch(&q, 2, 8 * kernel_us, &p);
            progress_line(&p, 0);
        }
        queue_drain(&q, 8 * kernel_us, &p);
    } else if (strcmp(pattern, "interactive") == 0) {
        CUstream s;
        CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        long burst = (long)(5000 / kernel_us) > 1 ? (long)(5000 / kernel_us) : 1;
        size_t n = 0, cap = 100000;
        uint64_t *lat = malloc(cap * sizeof *lat);
        if (!lat) return 2;
        while (now_ns() < end && n < cap) {
            uint64_t t0 = now_ns();
            for (long i = 0; i < burst; i++) CHECK(launch_us(s, kernel_us));
            CHECK(p_cuStreamSynchronize(s));
            uint64_t took = now_ns() - t0, work = (uint64_t)burst * kernel_us * 1000ull;
            lat[n++] = took > work ? took - work : 0;
            p.done_us += (uint64_t)burst * kernel_us;
            progress_line(&p, 0);
            usleep(45000);
        }
        qsort(lat, n, sizeof *lat, cmp_u64);
        printf("{\"bursts\":%zu,\"burst_us\":%llu,\"wait_p50_us\":%.1f,\"wait_p99_us\":%.1f}\n", n,
               (unsigned long long)burst * kernel_us, n ? lat[n / 2] / 1e3 : 0.0,
               n ? lat[(n * 99) / 100] / 1e3 : 0.0);
        free(lat);
    } else {
        fprintf(stderr, "gs_tenant load: unknown pattern %s\n", pattern);
        return 64;
    }
    for (int i = 0; i < children; i++) waitpid(kids[i], NULL, 0);
    progress_line(&p, 1);
    if (is_child) _exit(0);
    return 0;
}

/* -- memory stress -------------------------------------------------------------------------- */
static size_t max_bytes;
static int iters;
static _Atomic long allocs, ooms, errors, over_cap;
static size_t cap_seen;

struct held {
    CUdeviceptr p;
    size_t n;
    int kind; /* 0 alloc, 1 async, 2 managed, 3 pitch */
};

static void *mem_thread(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    CHECK(p_cuCtxSetCurrent(ctx));
    struct held held[64];
    int nheld = 0;
    for (int i = 0; i < iters; i++) {
        if (nheld > 0 && (nheld == 64 || rand_r(&seed) % 2)) {
            int k = (int)(rand_r(&seed) % (unsigned)nheld);
            CUresult r =
                held[k].kind == 1 ? p_cuMemFreeAsync(held[k].p, NULL) : p_cuMemFree_v2(held[k].p);
            if (r != CUDA_SUCCESS) errors++;
            held[k] = held[--nheld];
            continue;
        }
        size_t n = 1 + (size_t)rand_r(&seed) % max_bytes;
        int kind = (int)(rand_r(&seed) % 4);
        CUdeviceptr p = 0;
        CUresult r;
        size_t pitch = 0;
        if (kind == 1 && p_cuMemAllocAsync)
            r = p_cuMemAllocAsync(&p, n, NULL);
        else if (kind == 2 && p_cuMemAllocManaged)
            r = p_cuMemAllocManaged(&p, n, CU_MEM_ATTACH_GLOBAL);
        else if (kind == 3 && p_cuMemAllocPitch_v2)
            r = p_cuMemAllocPitch_v2(&p, &pitch, n, 1, 4);
        else {
            kind = 0;
            r = p_cuMemAlloc_v2(&p, n);
        }
        if (r == CUDA_SUCCESS) {
            allocs++;
            held[nheld++] = (struct held){p, n, kind};
            size_t fr, tot;
            if (p_cuMemGetInfo_v2(&fr, &tot) == CUDA_SUCCESS && tot > cap_seen) over_cap++;
        } else if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            ooms++;
        } else {
            errors++;
        }
    }
    for (int k = 0; k < nheld; k++) {
        CUresult r =
            held[k].kind == 1 ? p_cuMemFreeAsync(held[k].p, NULL) : p_cuMemFree_v2(held[k].p);
        if (r != CUDA_SUCCESS) errors++;
    }
    return NULL;
}

static int mem(int threads, int n, size_t maxb, unsigned seed) {
    load();
    size_t fr, tot;
    CHECK(p_cuMemGetInfo_v2(&fr, &tot));
    cap_seen = tot;
    max_bytes = maxb;
    iters = n;
    pthread_t t[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, mem_thread, (void *)(uintptr_t)(seed * 7919u + (unsigned)i));
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    CHECK(p_cuCtxSynchronize());
    size_t fr2, tot2;
    CHECK(p_cuMemGetInfo_v2(&fr2, &tot2));
    printf("{\"allocs\":%ld,\"ooms\":%ld,\"errors\":%ld,\"over_cap\":%ld,\"total\":%zu,"
           "\"free_before\":%zu,\"free_after\":%zu}\n",
           (long)allocs, (long)ooms, (long)errors, (long)over_cap, tot, fr, fr2);
    return errors ? 2 : 0;
}

/* -- fast-path cost -------------------------------------------------------------------------- */
static int bench(long n) {
    load();
    CUstream s;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < 1000; i++) CHECK(launch_us(s, 0)); /* warm up, take the lease */
    CHECK(p_cuStreamSynchronize(s));
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t t0 = now_ns();
        for (long i = 0; i < n; i++) CHECK(launch_us(s, 0));
        uint64_t t1 = now_ns();
        CHECK(p_cuStreamSynchronize(s));
        double per = (double)(t1 - t0) / (double)n;
        if (per < best) best = per;
    }
    printf("{\"ns_per_launch\":%.1f,\"n\":%ld}\n", best, n);
    return 0;
}

static int info(void) {
    load();
    size_t fr, tot, dtot;
    int count;
    CHECK(p_cuMemGetInfo_v2(&fr, &tot));
    CHECK(p_cuDeviceTotalMem_v2(&dtot, 0));
    CHECK(p_cuDeviceGetCount(&count));
    CUdeviceptr p;
    CUresult big = p_cuMemAlloc_v2(&p, tot + 1);
    if (big == CUDA_SUCCESS) p_cuMemFree_v2(p);
    printf("{\"free\":%zu,\"total\":%zu,\"device_total\":%zu,\"count\":%d,\"over_total\":%d}\n", fr,
           tot, dtot, count, (int)big);
    return 0;
}

/* Every launch and allocation path once; prints {"path": CUresult, ...}. Under a refused or
 * released share every one must return CUDA_ERROR_NOT_PERMITTED (800), except launches captured
 * into a graph (they run when the graph is launched). */
static int paths(void) {
    const char *wait = getenv("GS_TENANT_WAIT_FILE");
    while (wait && access(wait, F_OK) != 0) usleep(2000);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 2;
#define L(name) p_##name = (__typeof__(&name))dlsym(lib, #name)
    L(cuInit);
    L(cuDeviceGet);
    L(cuDevicePrimaryCtxRetain);
    L(cuCtxSetCurrent);
    L(cuModuleLoadData);
    L(cuModuleGetFunction);
    L(cuStreamCreate);
    L(cuStreamSynchronize);
    L(cuGetProcAddress_v2);
    L(cuMemFree_v2);
    if (!p_cuInit || p_cuInit(0) != CUDA_SUCCESS) return 2;
    CUdriverProcAddressQueryResult q;
    /* everything else through cuGetProcAddress_v2, like the CUDA runtime does */
    /* base names, as the runtime asks: the driver picks the versioned symbol (cuMemAlloc ->
     * cuMemAlloc_v2, cuStreamBeginCapture -> _v2, ...) and the interposer must map it to its
     * wrapper of that version */
#define GP(name, base) p_cuGetProcAddress_v2(base, (void **)&p_##name, 12000, 0, &q)
    GP(cuLaunchKernel, "cuLaunchKernel");
    GP(cuLaunchKernelEx, "cuLaunchKernelEx");
    GP(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel");
    GP(cuGraphLaunch, "cuGraphLaunch");
    GP(cuStreamBeginCapture_v2, "cuStreamBeginCapture");
    GP(cuStreamEndCapture, "cuStreamEndCapture");
    GP(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
    GP(cuMemAlloc_v2, "cuMemAlloc");
    GP(cuMemAllocPitch_v2, "cuMemAllocPitch");
    GP(cuMemAllocManaged, "cuMemAllocManaged");
    GP(cuMemAllocAsync, "cuMemAllocAsync");
    GP(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync");
    GP(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool");
    GP(cuMemCreate, "cuMemCreate");
    GP(cuMemRelease, "cuMemRelease");
    GP(cuArrayCreate_v2, "cuArrayCreate");
    GP(cuArrayDestroy, "cuArrayDestroy");
    GP(cuMemFreeAsync, "cuMemFreeAsync");
#define NEED(name)                                                                                 \
    if (!p_##name) {                                                                               \
        printf("{\"error\":-1,\"where\":\"%s\"}\n", #name);                                        \
        return 2;                                                                                  \
    }
    /* clang-format off */
    NEED(cuLaunchKernel) NEED(cuLaunchKernelEx) NEED(cuLaunchCooperativeKernel) NEED(cuGraphLaunch)
    NEED(cuStreamBeginCapture_v2) NEED(cuStreamEndCapture) NEED(cuGraphInstantiateWithFlags)
    NEED(cuMemAlloc_v2) NEED(cuMemAllocPitch_v2) NEED(cuMemAllocManaged) NEED(cuMemAllocAsync)
    NEED(cuMemAllocFromPoolAsync) NEED(cuDeviceGetDefaultMemPool) NEED(cuMemCreate)
    NEED(cuMemRelease) NEED(cuArrayCreate_v2) NEED(cuArrayDestroy) NEED(cuMemFreeAsync)
        /* clang-format on */
        __typeof__(&cuLaunchKernel) ptsz = NULL;
    p_cuGetProcAddress_v2("cuLaunchKernel", (void **)&ptsz, 12000,
                          CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &q);
    CUdevice dev;
    CHECK(p_cuDeviceGet(&dev, 0));
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(p_cuCtxSetCurrent(ctx));
    CUmodule mod;
    CHECK(p_cuModuleLoadData(&mod, "gs_tenant"));
    CHECK(p_cuModuleGetFunction(&busy, mod, "busy_us"));
    CUstream s, cap;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(p_cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
    uint64_t us = 10;
    void *params[] = {&us};
    /* a graph captured (and instantiated) while the share holds: launched at the end, after a
     * release too */
    CUgraph graph = NULL;
    CUgraphExec exec = NULL;
    CUresult r = p_cuStreamBeginCapture_v2(cap, CU_STREAM_CAPTURE_MODE_RELAXED);
    CUresult captured = p_cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, cap, params, NULL);
    CUresult end = p_cuStreamEndCapture(cap, &graph);
    CUresult instantiated =
        graph ? p_cuGraphInstantiateWithFlags(&exec, graph, 0) : CUDA_ERROR_INVALID_VALUE;
    const char *gate2 = getenv("GS_TENANT_GATE2"); /* the test may release the share here */
    long long released_bytes = -2;                 /* -2: not released here */
    if (gate2) {
        printf("{\"ready\":true}\n");
        fflush(stdout);
        while (access(gate2, F_OK) != 0) usleep(2000);
        /* Released: the interposer frees this process's GPU memory and resets its contexts,
         * in the agent thread whenever it next looks (within 100 ms) or at once here, as the
         * notebook side does right after a release. Here, so that every path below meets the
         * same state (a reset in the middle made the calls after it fail for another reason). */
        long long (*release_memory)(void) =
            (long long (*)(void))dlsym(RTLD_DEFAULT, "gpushare_release_memory");
        released_bytes = release_memory ? release_memory() : -3;
    }
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    printf("{\"cuLaunchKernel\":%d",
           (int)p_cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
    printf(",\"cuLaunchKernel_ptsz\":%d",
           ptsz ? (int)ptsz(busy, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL) : -1);
    printf(",\"cuLaunchKernelEx\":%d", (int)p_cuLaunchKernelEx(&cfg, busy, params, NULL));
    printf(",\"cuLaunchCooperativeKernel\":%d",
           (int)p_cuLaunchCooperativeKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, params));
    printf(",\"capture\":%d,\"captured_launch\":%d,\"end_capture\":%d", (int)r, (int)captured,
           (int)end);
    printf(",\"cuGraphLaunch\":%d", exec ? (int)p_cuGraphLaunch(exec, s) : -(int)instantiated);
    CUdeviceptr d = 0;
    size_t pitch;
    r = p_cuMemAlloc_v2(&d, 1 << 20);
    printf(",\"cuMemAlloc_v2\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuMemFree_v2(d);
    r = p_cuMemAllocPitch_v2(&d, &pitch, 1000, 100, 4);
    printf(",\"cuMemAllocPitch_v2\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuMemFree_v2(d);
    r = p_cuMemAllocManaged(&d, 1 << 20, CU_MEM_ATTACH_GLOBAL);
    printf(",\"cuMemAllocManaged\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuMemFree_v2(d);
    r = p_cuMemAllocAsync(&d, 1 << 20, s);
    printf(",\"cuMemAllocAsync\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuMemFreeAsync(d, s);
    CUmemoryPool pool;
    if (p_cuDeviceGetDefaultMemPool(&pool, dev) == CUDA_SUCCESS) {
        r = p_cuMemAllocFromPoolAsync(&d, 1 << 20, pool, s);
        printf(",\"cuMemAllocFromPoolAsync\":%d", (int)r);
        if (r == CUDA_SUCCESS) p_cuMemFreeAsync(d, s);
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h;
    r = p_cuMemCreate(&h, 2 << 20, &prop, 0);
    printf(",\"cuMemCreate\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuMemRelease(h);
    CUDA_ARRAY_DESCRIPTOR desc = {256, 256, 0x20, 1};
    CUarray arr;
    r = p_cuArrayCreate_v2(&arr, &desc);
    printf(",\"cuArrayCreate_v2\":%d", (int)r);
    if (r == CUDA_SUCCESS) p_cuArrayDestroy(arr);
    p_cuStreamSynchronize(s);
    printf(",\"released_bytes\":%lld}\n", released_bytes);
    return 0;
}

static int forked(double seconds, uint64_t kernel_us) {
    load();
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        CHECK(p_cuCtxSetCurrent(ctx));
        CUstream s;
        CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        uint64_t end = now_ns() + (uint64_t)(seconds * 1e9), done = 0;
        while (now_ns() < end) {
            CHECK(launch_us(s, kernel_us));
            CHECK(p_cuStreamSynchronize(s));
            done += kernel_us;
        }
        printf("{\"who\":\"child\",\"done_us\":%llu}\n", (unsigned long long)done);
        fflush(stdout);
        _exit(0);
    }
    CUstream s;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    uint64_t end = now_ns() + (uint64_t)(seconds * 1e9), done = 0;
    while (now_ns() < end) {
        CHECK(launch_us(s, kernel_us));
        CHECK(p_cuStreamSynchronize(s));
        done += kernel_us;
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("{\"who\":\"parent\",\"done_us\":%llu,\"child_status\":%d}\n", (unsigned long long)done,
           status);
    return 0;
}

/* The host's own wake-up latency, for context next to handoff figures: how late N sleeps of
 * 2 ms (CLOCK_MONOTONIC, absolute, 1 ns timer slack) wake up. No CUDA. */
static int wake(int n) {
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    uint64_t *late = malloc((size_t)n * sizeof *late);
    if (!late) return 2;
    for (int i = 0; i < n; i++) {
        uint64_t t = now_ns() + 2000000ull;
        struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {}
        late[i] = now_ns() - t;
    }
    qsort(late, (size_t)n, sizeof *late, cmp_u64);
    printf("{\"n\":%d,\"p50_us\":%.1f,\"p99_us\":%.1f,\"max_us\":%.1f}\n", n, late[n / 2] / 1e3,
           late[(n * 99) / 100] / 1e3, late[n - 1] / 1e3);
    free(late);
    return 0;
}

static void print_latencies(const char *name, uint64_t *v, int n, int last) {
    qsort(v, (size_t)n, sizeof *v, cmp_u64);
    printf("\"%s\":{\"n\":%d,\"p50_us\":%.1f,\"p99_us\":%.1f,\"p999_us\":%.1f,\"max_us\":%.1f}%s",
           name, n, v[n / 2] / 1e3, v[(n * 99) / 100] / 1e3, v[(n * 999) / 1000] / 1e3,
           v[n - 1] / 1e3, last ? "}\n" : ",");
}

/* The host's floor for a lease handoff, measured with the primitives a handoff uses: the
 * previous holder's agent thread sleeps until just before the drain should end (nanosleep, 1 ns
 * timer slack), notices the end and stores the grant, then FUTEX_WAKEs the next holder's thread,
 * which sleeps in FUTEX_WAIT on the shared board (another process, default timer slack) and
 * launches. Here a parent process sleeps until an absolute time T every PERIOD_US, stores its
 * clock and wakes a child blocked on a futex in a shared mapping; the child reads the clock.
 * Printed: "timer" (T -> the parent runs), "futex" (the parent's wake call -> the child runs:
 * what a handoff cannot avoid once the drain's end is seen) and "timer_futex" (T -> the child
 * runs: a handoff whose drain end were noticed by a timer). No CUDA. */
struct futex_probe {
    _Atomic uint32_t seq;
    _Atomic uint64_t woke_at; /* the parent's clock just before FUTEX_WAKE */
    _Atomic uint64_t due;     /* T */
    _Atomic uint32_t done;
    uint64_t futex[1 << 16], both[1 << 16];
};

static int futex_floor(int n, uint64_t period_us) {
    if (n > (1 << 16)) n = 1 << 16;
    struct futex_probe *p =
        mmap(NULL, sizeof *p, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    uint64_t *timer = malloc((size_t)n * sizeof *timer);
    if (p == MAP_FAILED || !timer) return 2;
    pid_t child = fork();
    if (child < 0) return 2;
    if (child == 0) {
        for (int i = 0; i < n; i++) {
            uint32_t seq = (uint32_t)i;
            while (atomic_load(&p->seq) == seq)
                syscall(SYS_futex, (uint32_t *)&p->seq, FUTEX_WAIT, seq, NULL, NULL, 0);
            uint64_t t = now_ns();
            p->futex[i] = t - atomic_load(&p->woke_at);
            p->both[i] = t - atomic_load(&p->due);
            atomic_store(&p->done, (uint32_t)i + 1);
        }
        _exit(0);
    }
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    for (int i = 0; i < n; i++) {
        uint64_t t = now_ns() + period_us * 1000ull;
        struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {}
        uint64_t w = now_ns();
        timer[i] = w - t;
        atomic_store(&p->due, t);
        atomic_store(&p->woke_at, w);
        atomic_fetch_add(&p->seq, 1);
        syscall(SYS_futex, (uint32_t *)&p->seq, FUTEX_WAKE, 1, NULL, NULL, 0);
        while (atomic_load(&p->done) != (uint32_t)i + 1) { /* the child has read the clock */
            struct timespec w50 = {0, 50000};
            nanosleep(&w50, NULL);
        }
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("{");
    print_latencies("timer", timer, n, 0);
    print_latencies("futex", p->futex, n, 0);
    print_latencies("timer_futex", p->both, n, 1);
    free(timer);
    munmap(p, sizeof *p);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 5 && strcmp(argv[1], "spin") == 0)
        return spin(atof(argv[2]), strtoull(argv[3], NULL, 10), atoi(argv[4]));
    if (argc >= 4 && strcmp(argv[1], "small") == 0) return small(atof(argv[2]), atof(argv[3]));
    if (argc >= 5 && strcmp(argv[1], "load") == 0)
        return load_pattern(atof(argv[2]), strtoull(argv[3], NULL, 10), argv[4]);
    if (argc >= 6 && strcmp(argv[1], "mem") == 0)
        return mem(atoi(argv[2]), atoi(argv[3]), strtoull(argv[4], NULL, 10),
                   (unsigned)atoi(argv[5]));
    if (argc >= 3 && strcmp(argv[1], "bench") == 0) return bench(atol(argv[2]));
    if (argc >= 3 && strcmp(argv[1], "wake") == 0 && atoi(argv[2]) > 0) return wake(atoi(argv[2]));
    if (argc >= 4 && strcmp(argv[1], "futex") == 0 && atoi(argv[2]) > 0)
        return futex_floor(atoi(argv[2]), strtoull(argv[3], NULL, 10));
    if (argc >= 2 && strcmp(argv[1], "info") == 0) return info();
    if (argc >= 2 && strcmp(argv[1], "paths") == 0) return paths();
    if (argc >= 4 && strcmp(argv[1], "fork") == 0)
        return forked(atof(argv[2]), strtoull(argv[3], NULL, 10));
    fprintf(stderr, "usage: see the comment at the top of gs_tenant.c\n");
    return 64;
}
