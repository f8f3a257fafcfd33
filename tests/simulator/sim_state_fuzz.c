/* sim_state_fuzz.c - one pass over the simulated driver's and NVML's calls that read the shared
 * state, for tests/simulator/test_sim_state_fuzz.py. Whatever the state holds, every call must
 * return (an error code is fine): the program exits 0 once all returned, and the test fails on a
 * signal (SIGSEGV, SIGBUS, ...) or a hang. Results are ignored on purpose; the CUDA part stops at
 * the first call whose result the next one needs.
 *
 *   sim_state_fuzz [cuda|nvml|both]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpushare_cuda.h"
#include "gpushare_nvml.h"

#define GET(lib, name) __typeof__(name) *p_##name = (__typeof__(name) *)dlsym(lib, #name)

static void cuda_pass(void *lib) {
    GET(lib, cuInit);
    GET(lib, cuDeviceGetCount);
    GET(lib, cuDeviceGet);
    GET(lib, cuDeviceGetName);
    GET(lib, cuDeviceGetUuid_v2);
    GET(lib, cuDeviceTotalMem_v2);
    GET(lib, cuDeviceGetAttribute);
    GET(lib, cuDevicePrimaryCtxRetain);
    GET(lib, cuCtxSetCurrent);
    GET(lib, cuMemGetInfo_v2);
    GET(lib, cuMemAlloc_v2);
    GET(lib, cuMemFree_v2);
    GET(lib, cuModuleLoadData);
    GET(lib, cuModuleGetFunction);
    GET(lib, cuLaunchKernel);
    GET(lib, cuCtxSynchronize);
    GET(lib, cuOccupancyMaxPotentialBlockSize);
    if (!p_cuInit || !p_cuLaunchKernel || !p_cuOccupancyMaxPotentialBlockSize) return;
    if (p_cuInit(0) != CUDA_SUCCESS) return;
    int n = 0;
    if (p_cuDeviceGetCount(&n) != CUDA_SUCCESS) return;
    for (int i = 0; i < n && i < 64; i++) {
        CUdevice d;
        char name[128];
        CUuuid uuid;
        size_t total, free_b;
        int value;
        if (p_cuDeviceGet(&d, i) != CUDA_SUCCESS) continue;
        p_cuDeviceGetName(name, sizeof name, d);
        p_cuDeviceGetUuid_v2(&uuid, d);
        p_cuDeviceTotalMem_v2(&total, d);
        for (int a = 1; a < 120; a++) p_cuDeviceGetAttribute(&value, (CUdevice_attribute)a, d);
        CUcontext ctx;
        if (p_cuDevicePrimaryCtxRetain(&ctx, d) != CUDA_SUCCESS) continue;
        if (p_cuCtxSetCurrent(ctx) != CUDA_SUCCESS) continue;
        p_cuMemGetInfo_v2(&free_b, &total);
        CUdeviceptr ptr;
        if (p_cuMemAlloc_v2(&ptr, 1 << 20) == CUDA_SUCCESS) p_cuMemFree_v2(ptr);
        CUmodule mod;
        CUfunction f;
        if (p_cuModuleLoadData(&mod, "fuzz module") != CUDA_SUCCESS) continue;
        if (p_cuModuleGetFunction(&f, mod, "busy_us") != CUDA_SUCCESS) continue;
        int grid, block;
        p_cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 0);
        uint64_t us = 200;
        void *args[] = {&us};
        for (int k = 0; k < 3; k++) p_cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL);
        p_cuCtxSynchronize();
    }
}

static void nvml_pass(void *lib) {
    GET(lib, nvmlInit_v2);
    GET(lib, nvmlShutdown);
    GET(lib, nvmlDeviceGetCount_v2);
    GET(lib, nvmlDeviceGetHandleByIndex_v2);
    GET(lib, nvmlDeviceGetHandleByUUID);
    GET(lib, nvmlDeviceGetName);
    GET(lib, nvmlDeviceGetUUID);
    GET(lib, nvmlDeviceGetMemoryInfo);
    GET(lib, nvmlDeviceGetUtilizationRates);
    GET(lib, nvmlDeviceGetTemperature);
    GET(lib, nvmlDeviceGetPowerUsage);
    GET(lib, nvmlDeviceGetBAR1MemoryInfo);
    GET(lib, nvmlDeviceGetComputeRunningProcesses_v3);
    GET(lib, nvmlDeviceGetProcessUtilization);
    if (!p_nvmlInit_v2 || !p_nvmlDeviceGetProcessUtilization) return;
    if (p_nvmlInit_v2() != NVML_SUCCESS) return;
    unsigned n = 0;
    p_nvmlDeviceGetCount_v2(&n);
    for (unsigned i = 0; i < n && i < 64; i++) {
        nvmlDevice_t h;
        if (p_nvmlDeviceGetHandleByIndex_v2(i, &h) != NVML_SUCCESS) continue;
        char text[96];
        nvmlMemory_t memory;
        nvmlUtilization_t util;
        nvmlBAR1Memory_t bar1;
        unsigned value;
        nvmlDevice_t again;
        p_nvmlDeviceGetName(h, text, sizeof text);
        p_nvmlDeviceGetName(h, text, 8); /* too short: an error, not an overrun */
        if (p_nvmlDeviceGetUUID(h, text, sizeof text) == NVML_SUCCESS)
            p_nvmlDeviceGetHandleByUUID(text, &again);
        p_nvmlDeviceGetMemoryInfo(h, &memory);
        p_nvmlDeviceGetUtilizationRates(h, &util);
        p_nvmlDeviceGetTemperature(h, 0, &value);
        p_nvmlDeviceGetPowerUsage(h, &value);
        p_nvmlDeviceGetBAR1MemoryInfo(h, &bar1);
        nvmlProcessInfo_t infos[300];
        unsigned count = 300;
        p_nvmlDeviceGetComputeRunningProcesses_v3(h, &count, infos);
        count = 0;
        p_nvmlDeviceGetComputeRunningProcesses_v3(h, &count, NULL);
        nvmlProcessUtilizationSample_t samples[300];
        count = 300;
        p_nvmlDeviceGetProcessUtilization(h, samples, &count, 0);
    }
    p_nvmlShutdown();
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "both";
    if (strcmp(what, "nvml") != 0) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!cuda) {
            fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
            return 2;
        }
        cuda_pass(cuda);
    }
    if (strcmp(what, "cuda") != 0) {
        void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!nvml) {
            fprintf(stderr, "dlopen libnvidia-ml.so.1: %s\n", dlerror());
            return 2;
        }
        nvml_pass(nvml);
    }
    return 0;
}
