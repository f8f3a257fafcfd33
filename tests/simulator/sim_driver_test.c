/* sim_driver_test.c - a driver-API program for the simulator's tests. It knows nothing about the
 * simulator: it dlopen()s libcuda.so.1 (whichever LD_LIBRARY_PATH finds) and uses only the CUDA
 * driver API, as any real program would.
 *
 *   sim_driver_test info                       devices as key=value lines
 *   sim_driver_test busy US COUNT [DEV [nb|b [START_NS]]]
 *                                              COUNT launches of busy_us(US) on one stream
 *                                              (nb: a non-blocking stream), from START_NS
 *                                              (CLOCK_MONOTONIC) if given; prints wall_ms,
 *                                              event_ms (cuEventElapsedTime around the launches),
 *                                              start_ns and end_ns
 *   sim_driver_test hold BYTES MS [DEV [fork]] allocate BYTES, keep the device busy for MS,
 *                                              print "ready", then sleep until killed (fork:
 *                                              first fork a child that sleeps; prints child=PID)
 *   sim_driver_test pulse BYTES PERCENT [DEV]  allocate BYTES, then forever: busy PERCENT of
 *                                              every 10 ms (a kernel, a sync, a sleep); prints
 *                                              "ready" after the first period
 *   sim_driver_test selftest                   exercise the whole API surface; exit 0 if all
 *                                              checks pass (used under ASan and TSan too)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpushare_cuda.h"
#include "gpushare_nvml.h"

static void *lib;

static void *sym(const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "missing symbol %s\n", name);
        exit(2);
    }
    return p;
}

/* Driver entry points, resolved from the library at start-up. */
#define FN(name) static __typeof__(name) *p_##name;
/* clang-format off */
#define FNS(X)                                                                                     \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName)          \
    X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute)                           \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxGetState)      \
    X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuCtxSetCurrent) X(cuCtxGetCurrent)                     \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxSynchronize)             \
    X(cuModuleLoadData) X(cuModuleGetFunction) X(cuModuleUnload) X(cuLibraryLoadData)              \
    X(cuLibraryGetKernel) X(cuKernelGetFunction) X(cuLibraryUnload) X(cuLaunchKernel)              \
    X(cuLaunchKernelEx) X(cuLaunchKernel_ptsz) X(cuStreamCreate) X(cuStreamDestroy_v2)             \
    X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent) X(cuEventCreate)                  \
    X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventElapsedTime_v2)                \
    X(cuEventDestroy_v2) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemGetInfo_v2)                       \
    X(cuMemcpyHtoD_v2) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoD_v2) X(cuMemcpyHtoDAsync_v2)               \
    X(cuMemsetD8_v2) X(cuMemsetD32_v2) X(cuMemAllocAsync) X(cuMemFreeAsync)                        \
    X(cuMemAllocManaged) X(cuMemAllocPitch_v2) X(cuDeviceGetDefaultMemPool) X(cuMemPoolCreate)     \
    X(cuMemPoolDestroy) X(cuMemAllocFromPoolAsync) X(cuMemGetAllocationGranularity)                \
    X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap)          \
    X(cuMemUnmap) X(cuMemSetAccess) X(cuArrayCreate_v2) X(cuArrayDestroy)                          \
    X(cuStreamBeginCapture_v2) X(cuStreamEndCapture) X(cuGraphInstantiateWithFlags)                \
    X(cuGraphLaunch) X(cuGraphExecDestroy) X(cuGraphDestroy) X(cuGetErrorName)                     \
    X(cuGetErrorString) X(cuGetProcAddress_v2) X(cuGetExportTable) X(cuMemPrefetchAsync_v2)      \
    X(cuMemAdvise_v2) X(cuStreamGetDevice) X(cuOccupancyMaxPotentialBlockSize)
/* clang-format on */
FNS(FN)
#define LOAD(name) p_##name = (__typeof__(name) *)sym(#name);

static const char *errname(CUresult r) {
    const char *s = "?";
    p_cuGetErrorName(r, &s);
    return s ? s : "?";
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, errname(r_));          \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define EXPECT(call, code)                                                                         \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != (code)) {                                                                        \
            fprintf(stderr, "%s:%d: %s -> %s, wanted %s\n", __FILE__, __LINE__, #call,             \
                    errname(r_), errname(code));                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define TRUE(cond)                                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond);                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char image[] = "simulated module image";

static CUfunction busy_fn(void) {
    CUmodule mod;
    CUfunction f;
    CHECK(p_cuModuleLoadData(&mod, image));
    CHECK(p_cuModuleGetFunction(&f, mod, "busy_us"));
    return f;
}

static void launch_busy(CUfunction f, uint64_t us, CUstream s) {
    void *args[] = {&us};
    CHECK(p_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, NULL));
}

static CUcontext setup(int dev) {
    CUcontext ctx;
    CUdevice d;
    CHECK(p_cuInit(0));
    CHECK(p_cuDeviceGet(&d, dev));
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(p_cuCtxSetCurrent(ctx));
    return ctx;
}

/* -- modes ------------------------------------------------------------------------------------ */

static int cmd_info(void) {
    int n, version;
    CHECK(p_cuInit(0));
    CHECK(p_cuDriverGetVersion(&version));
    CHECK(p_cuDeviceGetCount(&n));
    printf("driver=%d\ncount=%d\n", version, n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        char name[128];
        size_t total;
        CUuuid u;
        int sms, major, minor;
        CHECK(p_cuDeviceGet(&d, i));
        CHECK(p_cuDeviceGetName(name, sizeof name, d));
        CHECK(p_cuDeviceTotalMem_v2(&total, d));
        CHECK(p_cuDeviceGetUuid_v2(&u, d));
        CHECK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d));
        CHECK(p_cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d));
        CHECK(p_cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d));
        printf("name%d=%s\ntotal%d=%zu\nsms%d=%d\ncc%d=%d.%d\nuuid%d=", i, name, i, total, i, sms,
               i, major, minor, i);
        for (int k = 0; k < 16; k++) printf("%02x", (unsigned char)u.bytes[k]);
        printf("\n");
    }
    return 0;
}

static int cmd_busy(int argc, char **argv) {
    uint64_t us = strtoull(argv[2], NULL, 10);
    int count = atoi(argv[3]);
    int dev = argc > 4 ? atoi(argv[4]) : 0;
    int nb = argc > 5 && strcmp(argv[5], "nb") == 0;
    uint64_t start_ns = argc > 6 ? strtoull(argv[6], NULL, 10) : 0;
    setup(dev);
    CUfunction f = busy_fn();
    CUstream s;
    CUevent a, b;
    CHECK(p_cuStreamCreate(&s, nb ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT));
    CHECK(p_cuEventCreate(&a, CU_EVENT_DEFAULT));
    CHECK(p_cuEventCreate(&b, CU_EVENT_DEFAULT));
    if (start_ns) { /* a common start instant for several processes (CLOCK_MONOTONIC) */
        struct timespec ts = {(time_t)(start_ns / 1000000000ull), (long)(start_ns % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {}
    }
    double t0 = now_ms();
    CHECK(p_cuEventRecord(a, s));
    for (int i = 0; i < count; i++) launch_busy(f, us, s);
    CHECK(p_cuEventRecord(b, s));
    double launched = now_ms();
    CHECK(p_cuStreamSynchronize(s));
    double t1 = now_ms();
    float ms;
    CHECK(p_cuEventElapsedTime_v2(&ms, a, b));
    printf("launch_ms=%.3f\nwall_ms=%.3f\nevent_ms=%.3f\nstart_ns=%.0f\nend_ns=%.0f\n",
           launched - t0, t1 - t0, ms, t0 * 1e6, t1 * 1e6);
    CHECK(p_cuEventDestroy_v2(a));
    CHECK(p_cuEventDestroy_v2(b));
    CHECK(p_cuStreamDestroy_v2(s));
    return 0;
}

static int cmd_hold(int argc, char **argv) {
    size_t bytes = strtoull(argv[2], NULL, 10);
    uint64_t ms = strtoull(argv[3], NULL, 10);
    int dev = argc > 4 ? atoi(argv[4]) : 0;
    int fork_child = argc > 5 && strcmp(argv[5], "fork") == 0;
    setup(dev);
    CUdeviceptr p = 0;
    if (bytes) CHECK(p_cuMemAlloc_v2(&p, bytes));
    if (fork_child) { /* a child that outlives us and never uses CUDA (like a worker process) */
        pid_t child = fork();
        if (child == 0) {
            for (;;) pause();
        }
        printf("child=%d\n", (int)child);
    }
    CUfunction f = busy_fn();
    /* Busy in 10 ms kernels (the launches block once a second of work is queued). */
    for (uint64_t done = 0; done < ms; done += 10) {
        launch_busy(f, 10000, NULL);
        if (done == 0) {
            printf("ready\n");
            fflush(stdout);
        }
    }
    for (;;) pause();
}

static int cmd_pulse(int argc, char **argv) {
    size_t bytes = strtoull(argv[2], NULL, 10);
    uint64_t percent = strtoull(argv[3], NULL, 10);
    int dev = argc > 4 ? atoi(argv[4]) : 0;
    if (percent > 100) percent = 100;
    setup(dev);
    CUdeviceptr p = 0;
    if (bytes) CHECK(p_cuMemAlloc_v2(&p, bytes));
    CUfunction f = busy_fn();
    for (int first = 1;; first = 0) {
        launch_busy(f, percent * 100, NULL);
        CHECK(p_cuCtxSynchronize());
        if (first) {
            printf("ready\n");
            fflush(stdout);
        }
        usleep((useconds_t)((100 - percent) * 100));
    }
}

/* -- selftest --------------------------------------------------------------------------------- */

struct worker {
    CUcontext ctx;
    CUfunction f;
    int launches;
};

static void *worker_main(void *arg) {
    struct worker *w = arg;
    CHECK(p_cuCtxSetCurrent(w->ctx));
    CUstream s;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < w->launches; i++) {
        launch_busy(w->f, 20, s);
        if (i % 16 == 0) (void)p_cuStreamQuery(s);
    }
    /* The per-thread default stream too. */
    uint64_t us = 10;
    void *args[] = {&us};
    CHECK(p_cuLaunchKernel_ptsz(w->f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
    CUdeviceptr p;
    CHECK(p_cuMemAlloc_v2(&p, 4096));
    CHECK(p_cuMemsetD8_v2(p, 7, 4096));
    CHECK(p_cuMemFree_v2(p));
    CHECK(p_cuStreamSynchronize(s));
    CHECK(p_cuStreamDestroy_v2(s));
    return NULL;
}

static void test_errors_and_entry_points(void) {
    const char *s;
    CHECK(p_cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    TRUE(strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    CHECK(p_cuGetErrorString(CUDA_ERROR_NOT_READY, &s));
    TRUE(strlen(s) > 0);
    EXPECT(p_cuGetErrorName((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    void *fn;
    CUdriverProcAddressQueryResult st;
    CHECK(p_cuGetProcAddress_v2("cuMemAlloc", &fn, 12000, 0, &st));
    TRUE(fn == (void *)p_cuMemAlloc_v2 && st == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(p_cuGetProcAddress_v2("cuLaunchKernel", &fn, 12000,
                                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    TRUE(fn == (void *)p_cuLaunchKernel_ptsz);
    CHECK(p_cuGetProcAddress_v2("cuCtxCreate", &fn, 13000, 0, &st));
    TRUE(fn == (void *)p_cuCtxCreate_v4);
    EXPECT(p_cuGetProcAddress_v2("cuNoSuchThing", &fn, 12000, 0, &st), CUDA_ERROR_NOT_FOUND);
    TRUE(st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    const void *table;
    CUuuid id = {{0}};
    EXPECT(p_cuGetExportTable(&table, &id), CUDA_ERROR_NOT_SUPPORTED);
}

static void test_contexts(void) {
    CUcontext prim, mine, cur, popped;
    CUdevice d;
    unsigned flags;
    int active;
    CHECK(p_cuDeviceGet(&d, 0));
    CHECK(p_cuDevicePrimaryCtxRetain(&prim, d));
    CHECK(p_cuDevicePrimaryCtxGetState(d, &flags, &active));
    TRUE(active == 1);
    size_t free0, free1, total;
    CHECK(p_cuMemGetInfo_v2(&free0, &total)); /* the primary context is current */
    CHECK(p_cuCtxCreate_v4(&mine, NULL, 0, d));
    CHECK(p_cuCtxGetCurrent(&cur));
    TRUE(cur == mine);
    CHECK(p_cuCtxPushCurrent_v2(prim));
    CHECK(p_cuCtxGetCurrent(&cur));
    TRUE(cur == prim);
    CHECK(p_cuCtxPopCurrent_v2(&popped));
    TRUE(popped == prim);
    CHECK(p_cuCtxGetDevice(&d));
    TRUE(d == 0);
    CUdeviceptr p;
    CUarray arr;
    CUDA_ARRAY_DESCRIPTOR desc = {256, 256, 0x20, 1};
    CHECK(p_cuMemAlloc_v2(&p, 1 << 20));
    CHECK(p_cuArrayCreate_v2(&arr, &desc));
    CHECK(p_cuMemGetInfo_v2(&free1, &total));
    TRUE(free0 - free1 >= (1 << 20) + 256 * 256 * 4); /* and what the context takes */
    CHECK(p_cuCtxDestroy_v2(mine));                   /* frees p and arr with the context */
    CHECK(p_cuMemGetInfo_v2(&free1, &total));
    TRUE(free1 == free0);
    CHECK(p_cuCtxGetCurrent(&cur));
    TRUE(cur == prim);
    EXPECT(p_cuCtxPushCurrent_v2(mine), CUDA_ERROR_CONTEXT_IS_DESTROYED);
}

static void test_memory(void) {
    size_t free0, total, free1;
    CHECK(p_cuMemGetInfo_v2(&free0, &total));
    TRUE(free0 <= total && total > 0);
    CUdeviceptr a, b;
    CHECK(p_cuMemAlloc_v2(&a, 1 << 20));
    CHECK(p_cuMemAlloc_v2(&b, 1 << 20));
    CHECK(p_cuMemGetInfo_v2(&free1, &total));
    TRUE(free0 - free1 >= 2u << 20);
    char host[256], back[256];
    for (int i = 0; i < 256; i++) host[i] = (char)i;
    CHECK(p_cuMemcpyHtoD_v2(a, host, sizeof host));
    CHECK(p_cuMemcpyDtoD_v2(b, a, sizeof host));
    CHECK(p_cuMemcpyDtoH_v2(back, b, sizeof back));
    TRUE(memcmp(host, back, sizeof host) == 0);
    CHECK(p_cuMemsetD32_v2(a, 0x01020304u, 64));
    CHECK(p_cuMemcpyDtoH_v2(back, a, 8));
    TRUE(back[0] == 4 && back[3] == 1 && back[4] == 4);
    EXPECT(p_cuMemcpyHtoD_v2(a + (2u << 20), host, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT(p_cuMemAlloc_v2(&b, total + 1), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(p_cuMemFree_v2(a));
    EXPECT(p_cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);
    CHECK(p_cuMemFree_v2(b));

    CUdeviceptr m, pitched;
    size_t pitch;
    CHECK(p_cuMemAllocManaged(&m, 4096, CU_MEM_ATTACH_GLOBAL));
    CUmemLocation here = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CHECK(p_cuMemAdvise_v2(m, 4096, 1, here));
    CHECK(p_cuMemPrefetchAsync_v2(m, 4096, here, 0, NULL));
    EXPECT(p_cuMemPrefetchAsync_v2(m + 8192, 4096, here, 0, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK(p_cuMemFree_v2(m));
    CHECK(p_cuMemAllocPitch_v2(&pitched, &pitch, 1000, 10, 4));
    TRUE(pitch >= 1000);
    CHECK(p_cuMemFree_v2(pitched));

    /* Stream-ordered and pools. */
    CUstream s;
    CUmemoryPool def, pool;
    CHECK(p_cuStreamCreate(&s, 0));
    CHECK(p_cuMemAllocAsync(&a, 8192, s));
    CHECK(p_cuMemcpyHtoDAsync_v2(a, host, sizeof host, s));
    CHECK(p_cuMemFreeAsync(a, s));
    CHECK(p_cuDeviceGetDefaultMemPool(&def, 0));
    CUmemPoolProps props = {0};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CHECK(p_cuMemPoolCreate(&pool, &props));
    CHECK(p_cuMemAllocFromPoolAsync(&a, 4096, pool, s));
    CHECK(p_cuMemFreeAsync(a, s));
    CHECK(p_cuMemPoolDestroy(pool));
    CHECK(p_cuStreamSynchronize(s));
    CHECK(p_cuStreamDestroy_v2(s));

    /* Virtual memory management: two mappings of one allocation share bytes. */
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    size_t gran;
    CHECK(p_cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h;
    CUdeviceptr va1, va2;
    CHECK(p_cuMemCreate(&h, gran, &prop, 0));
    CHECK(p_cuMemAddressReserve(&va1, gran, 0, 0, 0));
    CHECK(p_cuMemAddressReserve(&va2, gran, 0, 0, 0));
    CHECK(p_cuMemMap(va1, gran, 0, h, 0));
    CHECK(p_cuMemMap(va2, gran, 0, h, 0));
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(p_cuMemSetAccess(va1, gran, &acc, 1));
    CHECK(p_cuMemRelease(h)); /* still mapped: the bytes live on */
    CHECK(p_cuMemsetD8_v2(va1, 0x5a, 128));
    CHECK(p_cuMemcpyDtoH_v2(back, va2, 128));
    TRUE(back[0] == 0x5a && back[127] == 0x5a);
    CHECK(p_cuMemUnmap(va1, gran));
    CHECK(p_cuMemUnmap(va2, gran));
    CHECK(p_cuMemAddressFree(va1, gran));
    CHECK(p_cuMemAddressFree(va2, gran));

    CUarray arr;
    CUDA_ARRAY_DESCRIPTOR desc = {64, 64, 0x20, 4};
    CHECK(p_cuArrayCreate_v2(&arr, &desc));
    CHECK(p_cuArrayDestroy(arr));

    CHECK(p_cuMemGetInfo_v2(&free1, &total));
    TRUE(free1 == free0);
}

static void test_timing(CUfunction f) {
    CUstream s;
    CUevent a, b;
    CHECK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(p_cuEventCreate(&a, 0));
    CHECK(p_cuEventCreate(&b, 0));
    CHECK(p_cuEventRecord(a, s));
    launch_busy(f, 30000, s);
    CHECK(p_cuEventRecord(b, s));
    EXPECT(p_cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    EXPECT(p_cuEventQuery(b), CUDA_ERROR_NOT_READY);
    float ms;
    EXPECT(p_cuEventElapsedTime_v2(&ms, a, b), CUDA_ERROR_NOT_READY);
    CHECK(p_cuEventSynchronize(b));
    CHECK(p_cuEventQuery(b));
    CHECK(p_cuEventElapsedTime_v2(&ms, a, b));
    TRUE(ms >= 29.99f && ms <= 30.5f);
    /* A kernel through cuLaunchKernelEx and the extra-buffer parameter form. */
    uint64_t us = 5000;
    size_t size = sizeof us;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &us, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                     CU_LAUNCH_PARAM_END};
    CUlaunchConfig cfg = {1, 1, 1, 64, 1, 1, 0, s, NULL, 0};
    CHECK(p_cuEventRecord(a, s));
    CHECK(p_cuLaunchKernelEx(&cfg, f, NULL, extra));
    CHECK(p_cuEventRecord(b, s));
    CHECK(p_cuStreamSynchronize(s));
    CHECK(p_cuEventElapsedTime_v2(&ms, a, b));
    TRUE(ms >= 4.99f && ms <= 5.5f);
    /* Graph capture: three kernels replayed as one launch. */
    CUgraph g;
    CUgraphExec x;
    CHECK(p_cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    for (int i = 0; i < 3; i++) launch_busy(f, 4000, s);
    CHECK(p_cuStreamEndCapture(s, &g));
    CHECK(p_cuGraphInstantiateWithFlags(&x, g, 0));
    CHECK(p_cuEventRecord(a, s));
    CHECK(p_cuGraphLaunch(x, s));
    CHECK(p_cuEventRecord(b, s));
    CHECK(p_cuEventSynchronize(b));
    CHECK(p_cuEventElapsedTime_v2(&ms, a, b));
    TRUE(ms >= 11.99f && ms <= 12.5f);
    CHECK(p_cuGraphExecDestroy(x));
    CHECK(p_cuGraphDestroy(g));
    /* Another stream waits on an event of this one. */
    CUstream s2;
    CHECK(p_cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    launch_busy(f, 20000, s);
    CHECK(p_cuEventRecord(a, s));
    CHECK(p_cuStreamWaitEvent(s2, a, 0));
    EXPECT(p_cuStreamQuery(s2), CUDA_ERROR_NOT_READY);
    CHECK(p_cuStreamSynchronize(s2));
    CHECK(p_cuEventQuery(a));
    CHECK(p_cuEventDestroy_v2(a));
    CHECK(p_cuEventDestroy_v2(b));
    CHECK(p_cuStreamDestroy_v2(s2));
    CHECK(p_cuStreamDestroy_v2(s));
}

static void test_library_and_threads(CUcontext ctx, CUfunction f) {
    CUlibrary lib;
    CUkernel k;
    CUfunction kf;
    CHECK(p_cuLibraryLoadData(&lib, image, NULL, NULL, 0, NULL, NULL, 0));
    CHECK(p_cuLibraryGetKernel(&k, lib, "_Z7busy_usy"));
    CHECK(p_cuKernelGetFunction(&kf, k));
    launch_busy(kf, 100, NULL);
    CHECK(p_cuCtxSynchronize());
    CHECK(p_cuLibraryUnload(lib));
    int grid, block;
    CHECK(p_cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 256));
    TRUE(block == 256 && grid > 0);
    CUstream s;
    CUdevice dev = -1;
    CHECK(p_cuStreamCreate(&s, 0));
    CHECK(p_cuStreamGetDevice(s, &dev));
    TRUE(dev == 0);
    CHECK(p_cuStreamDestroy_v2(s));

    enum { THREADS = 4 };
    pthread_t t[THREADS];
    struct worker w = {ctx, f, 200};
    for (int i = 0; i < THREADS; i++) TRUE(pthread_create(&t[i], NULL, worker_main, &w) == 0);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    CHECK(p_cuCtxSynchronize());
}

/* The simulated NVML, loaded into the same process: it sees this process's memory and work. */
static void test_nvml(CUfunction f) {
    void *nv = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    TRUE(nv != NULL);
#define NV(name)                                                                                   \
    __typeof__(name) *nv_##name = (__typeof__(name) *)dlsym(nv, #name);                            \
    TRUE(nv_##name);
    /* clang-format off */
    NV(nvmlInit_v2) NV(nvmlShutdown) NV(nvmlDeviceGetCount_v2) NV(nvmlDeviceGetHandleByIndex_v2)
    NV(nvmlDeviceGetName) NV(nvmlDeviceGetComputeRunningProcesses_v3)
    NV(nvmlDeviceGetUtilizationRates) NV(nvmlDeviceGetMemoryInfo)
    NV(nvmlDeviceGetRunningProcessDetailList) NV(nvmlDeviceGetProcessUtilization)
    NV(nvmlDeviceGetFieldValues) NV(nvmlDeviceGetPerformanceState) NV(nvmlDeviceGetClockInfo)
    NV(nvmlEventSetCreate) NV(nvmlDeviceRegisterEvents) NV(nvmlEventSetWait_v2)
    NV(nvmlEventSetFree) NV(nvmlDeviceGetTopologyNearestGpus) NV(nvmlDeviceGetMigMode)
    CUdeviceptr p;
    /* clang-format on */
    CHECK(p_cuMemAlloc_v2(&p, 3u << 20));
    launch_busy(f, 200000, NULL);
    TRUE(nv_nvmlInit_v2() == NVML_SUCCESS);
    unsigned n, k = 8, found = 0;
    nvmlDevice_t h;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    TRUE(nv_nvmlDeviceGetCount_v2(&n) == NVML_SUCCESS && n >= 1);
    TRUE(nv_nvmlDeviceGetHandleByIndex_v2(0, &h) == NVML_SUCCESS);
    TRUE(nv_nvmlDeviceGetName(h, name, sizeof name) == NVML_SUCCESS && strlen(name) > 0);
    nvmlProcessInfo_t info[8];
    TRUE(nv_nvmlDeviceGetComputeRunningProcesses_v3(h, &k, info) == NVML_SUCCESS);
    for (unsigned i = 0; i < k; i++)
        found |= info[i].pid == (unsigned)getpid() && info[i].usedGpuMemory >= 3u << 20;
    TRUE(found);
    nvmlUtilization_t util;
    TRUE(nv_nvmlDeviceGetUtilizationRates(h, &util) == NVML_SUCCESS && util.gpu <= 100);
    nvmlMemory_t mem;
    TRUE(nv_nvmlDeviceGetMemoryInfo(h, &mem) == NVML_SUCCESS);
    TRUE(mem.used >= 3u << 20 && mem.total == mem.used + mem.free);
    /* the calls monitoring tools make, from several threads' view of the same state */
    nvmlProcessDetail_v1_t detail[8];
    nvmlProcessDetailList_v1_t list = {nvmlProcessDetailList_v1, 0, 8, detail};
    TRUE(nv_nvmlDeviceGetRunningProcessDetailList(h, &list) == NVML_SUCCESS);
    TRUE(list.numProcArrayEntries == k);
    nvmlProcessUtilizationSample_t samples[8];
    unsigned ns = 8;
    TRUE(nv_nvmlDeviceGetProcessUtilization(h, samples, &ns, 0) == NVML_SUCCESS && ns == k);
    nvmlFieldValue_t fields[3] = {{.fieldId = 91}, {.fieldId = 83}, {.fieldId = 100000}};
    TRUE(nv_nvmlDeviceGetFieldValues(h, 3, fields) == NVML_SUCCESS);
    TRUE(fields[0].nvmlReturn == NVML_SUCCESS && fields[2].nvmlReturn == NVML_ERROR_NOT_SUPPORTED);
    int pstate;
    unsigned clock, current, pending;
    launch_busy(f, 200000, NULL); /* busy now, however slowly the checks above ran */
    TRUE(nv_nvmlDeviceGetPerformanceState(h, &pstate) == NVML_SUCCESS && pstate == 0);
    TRUE(nv_nvmlDeviceGetClockInfo(h, 1, &clock) == NVML_SUCCESS && clock > 210);
    TRUE(nv_nvmlDeviceGetMigMode(h, &current, &pending) == NVML_SUCCESS && current == 0);
    nvmlEventSet_t set;
    nvmlEventData_t event;
    TRUE(nv_nvmlEventSetCreate(&set) == NVML_SUCCESS);
    TRUE(nv_nvmlDeviceRegisterEvents(h, 8, set) == NVML_SUCCESS); /* XID critical errors */
    TRUE(nv_nvmlEventSetWait_v2(set, &event, 1) == NVML_ERROR_TIMEOUT);
    TRUE(nv_nvmlEventSetFree(set) == NVML_SUCCESS);
    unsigned near = 0;
    TRUE(nv_nvmlDeviceGetTopologyNearestGpus(h, 50, &near, NULL) == NVML_SUCCESS && near == n - 1);
    TRUE(nv_nvmlShutdown() == NVML_SUCCESS);
    CHECK(p_cuMemFree_v2(p));
    CHECK(p_cuCtxSynchronize());
    dlclose(nv);
}

static int cmd_selftest(void) {
    EXPECT(p_cuDeviceGetCount(&(int){0}), CUDA_ERROR_NOT_INITIALIZED);
    CUcontext ctx = setup(0);
    test_errors_and_entry_points();
    test_contexts();
    CUfunction f = busy_fn();
    test_memory();
    test_timing(f);
    test_library_and_threads(ctx, f);
    test_nvml(f);
    CHECK(p_cuDevicePrimaryCtxRelease_v2(0));
    printf("selftest ok\n");
    return 0;
}

int main(int argc, char **argv) {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return 2;
    }
    FNS(LOAD)
    if (argc >= 2 && strcmp(argv[1], "info") == 0) return cmd_info();
    if (argc >= 4 && strcmp(argv[1], "busy") == 0) return cmd_busy(argc, argv);
    if (argc >= 4 && strcmp(argv[1], "hold") == 0) return cmd_hold(argc, argv);
    if (argc >= 4 && strcmp(argv[1], "pulse") == 0) return cmd_pulse(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "selftest") == 0) return cmd_selftest();
    fprintf(stderr,
            "usage: %s info | busy US COUNT [DEV [nb|b [START_NS]]] | hold BYTES MS [DEV [fork]] | "
            "pulse BYTES PERCENT [DEV] | "
            "selftest\n",
            argv[0]);
    return 2;
}
