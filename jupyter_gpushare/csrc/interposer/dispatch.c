/* dispatch.c - where the real driver functions come from, and how callers reach our wrappers.
 *
 * Three ways into the driver are covered:
 *  1. direct linking: our exported wrappers interpose (LD_PRELOAD);
 *  2. dlsym(handle, "cu…"/"nvml…"): our dlsym returns the wrapper when the real lookup succeeds;
 *  3. cuGetProcAddress / cuGetProcAddress_v2 (how the CUDA runtime finds every entry point): the
 *     real call answers first; the returned pointer is matched against the real pointers of the
 *     versioned symbols we wrap (so "cuLaunchKernel" with the per-thread flag maps to the _ptsz
 *     wrapper, an old cudaVersion to the old variant), and our wrapper is returned. A driver that
 *     answers with our own wrapper (it looked the name up globally) is recognised too, so a
 *     wrapper never ends up calling itself.
 * Real symbols are looked up in libcuda.so.1 / libnvidia-ml.so.1 opened explicitly (they are often
 * dlopen-ed RTLD_LOCAL by the application, out of reach of RTLD_NEXT).
 *
 * Known limit of replacing dlsym: glibc resolves dlsym(RTLD_NEXT, name) relative to its caller,
 * which is now this library; such lookups find the next definition after libgpushare.so rather
 * than after the original caller. kernel_env() therefore puts libgpushare.so last in LD_PRELOAD
 * (a preloaded library that looks itself up with RTLD_NEXT then still finds the real function).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gs.h"

#define GS_DEFINE_REAL(name) __typeof__(&name) real_##name;
GS_HOOKS(GS_DEFINE_REAL)
GS_USES(GS_DEFINE_REAL)
GS_NVML_HOOKS(GS_DEFINE_REAL)
#undef GS_DEFINE_REAL
nvmlReturn_t (*real_nvmlDeviceGetUUID)(nvmlDevice_t, char *, unsigned int);

static void *(*real_dlsym)(void *, const char *);
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static void *libcuda;
static void *libnvml;

struct gs_entry {
    const char *name;
    void **real;
    void *wrapper;
};

#define GS_ENTRY(name) {#name, (void **)&real_##name, (void *)&name},
static const struct gs_entry entries[] = {GS_HOOKS(GS_ENTRY) GS_NVML_HOOKS(GS_ENTRY)};
#undef GS_ENTRY
#define NENTRIES (sizeof(entries) / sizeof(entries[0]))

static void *lookup(void *lib, const char *name) {
    void *p = lib ? real_dlsym(lib, name) : NULL;
    if (!p) p = real_dlsym(RTLD_NEXT, name);
    return p;
}

/* Only glibc's dlsym, without pthread_once or locks: sanitizer runtimes call dlsym while they
 * start, before their interceptors work. Idempotent, so a race just repeats it. */
static void resolve_dlsym(void) {
    if (__atomic_load_n(&real_dlsym, __ATOMIC_ACQUIRE)) return;
    void *(*p)(void *, const char *) = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17"); /* aarch64 */
    __atomic_store_n(&real_dlsym, p, __ATOMIC_RELEASE);
}

static void resolve(void) {
    resolve_dlsym();
    libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    libnvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!libnvml) libnvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    for (size_t i = 0; i < NENTRIES; i++) {
        int nvml = strncmp(entries[i].name, "nvml", 4) == 0;
        void *p = lookup(nvml ? libnvml : libcuda, entries[i].name);
        if (p == entries[i].wrapper) p = NULL; /* never call ourselves */
        __atomic_store_n(entries[i].real, p, __ATOMIC_RELEASE);
    }
#define GS_RESOLVE_USED(name) real_##name = (__typeof__(&name))lookup(libcuda, #name);
    GS_USES(GS_RESOLVE_USED)
#undef GS_RESOLVE_USED
    if (!real_cuEventElapsedTime_v2) /* drivers before 12.8: the same call without the suffix */
        real_cuEventElapsedTime_v2 =
            (__typeof__(&cuEventElapsedTime_v2))lookup(libcuda, "cuEventElapsedTime");
    real_nvmlDeviceGetUUID =
        (nvmlReturn_t (*)(nvmlDevice_t, char *, unsigned int))lookup(libnvml, "nvmlDeviceGetUUID");
}

void gs_resolve(void) {
    pthread_once(&resolve_once, resolve);
}

void *gs_wrapper_for(const char *name) {
    if (!name || (name[0] != 'c' && name[0] != 'n')) return NULL;
    for (size_t i = 0; i < NENTRIES; i++)
        if (strcmp(entries[i].name, name) == 0) return entries[i].wrapper;
    return NULL;
}

/* The wrapper standing for a real pointer returned by cuGetProcAddress, or NULL. */
static void *wrapper_for_pointer(void *p) {
    for (size_t i = 0; i < NENTRIES; i++) {
        void *real = __atomic_load_n(entries[i].real, __ATOMIC_ACQUIRE);
        if ((real && p == real) || p == entries[i].wrapper) return entries[i].wrapper;
    }
    return NULL;
}

__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name) {
    resolve_dlsym();
    if (!real_dlsym) return NULL;
    void *p = real_dlsym(handle, name);
    if (p && (strncmp(name, "cu", 2) == 0 || strncmp(name, "nvml", 4) == 0)) {
        void *w = gs_wrapper_for(name);
        if (w) {
            gs_resolve(); /* the wrapper needs the real symbols */
            return w;
        }
    }
    return p;
}

/* A symbol obtained through cuGetProcAddress: keep what the driver gave unless it is one of the
 * functions we wrap (recognised by its address). */
static void *substitute(const char *symbol, void *p) {
    if (!p) return p;
    void *w = wrapper_for_pointer(p);
    if (w) return w;
    /* A variant we did not resolve (unusual version): wrap by name only when the driver gave
     * exactly the plain symbol's address, otherwise leave it alone rather than guess. */
    (void)symbol;
    return p;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    gs_resolve();
    if (!real_cuGetProcAddress) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = substitute(symbol, *pfn);
    return r;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    gs_resolve();
    if (!real_cuGetProcAddress_v2) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS && pfn) *pfn = substitute(symbol, *pfn);
    return r;
}
