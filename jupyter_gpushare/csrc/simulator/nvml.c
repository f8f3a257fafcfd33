/* nvml.c - the simulated libnvidia-ml.so.1: NVML's view of the simulated devices.
 *
 * Everything is read from the shared state the simulated driver writes: memory in use (total and
 * per process), utilisation (busy fraction over the last second), and, derived from utilisation,
 * temperature (35 °C idle .. 80 °C busy) and power (idle .. TDP). Like the real NVML it lists all
 * devices of the machine (GPUSHARE_SIM_DEVICES, after NVIDIA_VISIBLE_DEVICES) and ignores
 * CUDA_VISIBLE_DEVICES.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#pragma GCC visibility push(default)
#include "gpushare_nvml.h"
#pragma GCC visibility pop

#include "sim_state.h"

#define SIM_NVML_DRIVER  "580.82.07"
#define SIM_NVML_VERSION "13.580.82.07"
#define SIM_CUDA_VERSION 13000

struct nvmlDevice_st {
    unsigned index; /* machine ordinal */
    int slot;       /* state slot */
};

static struct nvmlDevice_st handles[SIM_MAX_DEVICES];
static _Atomic int init_count;

static nvmlReturn_t ready(void) {
    return atomic_load(&init_count) > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

/* The device behind a handle, or an error. */
static nvmlReturn_t device(nvmlDevice_t h, struct sim_device **out) {
    nvmlReturn_t r = ready();
    if (r) return r;
    if (!h || h < handles || h >= handles + sim_machine_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *out = sim_dev(h->slot);
    return NVML_SUCCESS;
}

/* -- init and system -------------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (sim_open(atomic_load(&init_count) == 0) != 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    for (int i = 0; i < sim_machine_count(); i++) {
        handles[i].index = (unsigned)i;
        handles[i].slot = sim_machine_slot(i);
    }
    atomic_fetch_add(&init_count, 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) {
    return nvmlInitWithFlags(0);
}
nvmlReturn_t nvmlInit(void) {
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void) {
    int n = atomic_load(&init_count);
    while (n > 0 && !atomic_compare_exchange_weak(&init_count, &n, n - 1)) {}
    return n > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NO_PERMISSION:
        return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED:
        return "Already Initialized";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED:
        return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT:
        return "Timeout";
    case NVML_ERROR_GPU_IS_LOST:
        return "GPU is lost";
    case NVML_ERROR_OPERATING_SYSTEM:
        return "Operating System Error";
    case NVML_ERROR_NO_DATA:
        return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
        return "Argument version mismatch";
    default:
        return "Unknown Error";
    }
}

static nvmlReturn_t put_string(char *dst, unsigned length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = ready();
    return r ? r : put_string(version, length, SIM_NVML_DRIVER);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = ready();
    return r ? r : put_string(version, length, SIM_NVML_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = SIM_CUDA_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length) {
    nvmlReturn_t r = ready();
    if (r) return r;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NVML_ERROR_NOT_FOUND;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return NVML_ERROR_NOT_FOUND;
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    return put_string(name, length, buf);
}

/* -- devices ---------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t r = ready();
    if (r) return r;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned)sim_machine_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) {
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev) {
    nvmlReturn_t r = ready();
    if (r) return r;
    if (!dev || index >= (unsigned)sim_machine_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev) {
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev) {
    nvmlReturn_t r = ready();
    if (r) return r;
    if (!uuid || !dev) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < sim_machine_count(); i++) {
        if (strcmp(sim_dev(handles[i].slot)->uuid, uuid) == 0) {
            *dev = &handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static void bus_id(int slot, char *out, size_t cap) {
    snprintf(out, cap, "00000000:%02X:00.0", slot + 1);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *dev) {
    nvmlReturn_t r = ready();
    if (r) return r;
    if (!pciBusId || !dev) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < sim_machine_count(); i++) {
        char id[32];
        bus_id(handles[i].slot, id, sizeof id);
        if (strcasecmp(id, pciBusId) == 0 || strcasecmp(id + 4, pciBusId) == 0) {
            *dev = &handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    return r ? r : put_string(name, length, d->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    return r ? r : put_string(uuid, length, d->uuid);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    char buf[32];
    snprintf(buf, sizeof buf, "SIM%010u", (unsigned)h->slot);
    return put_string(serial, length, buf);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = h->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minorNumber) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = (unsigned)h->slot;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    bus_id(h->slot, pci->busId, sizeof pci->busId);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", h->slot + 1);
    pci->bus = (unsigned)h->slot + 1;
    pci->pciDeviceId = 0x20B210DE;
    pci->pciSubSystemId = 0x147E10DE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(h, pci);
}
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(h, pci);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned tdp;
    sim_product(d->name, major, minor, &tdp);
    return NVML_SUCCESS;
}

/* -- memory ----------------------------------------------------------------------------------- */

static void memory(struct sim_device *d, unsigned long long *total, unsigned long long *free_b,
                   unsigned long long *used) {
    sim_reap(); /* memory of processes that died is free again */
    uint64_t u = atomic_load(&d->mem_used);
    if (u > d->total_bytes) u = d->total_bytes;
    *total = d->total_bytes;
    *used = u;
    *free_b = d->total_bytes - u;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *mem) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    memory(d, &mem->total, &mem->free, &mem->used);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *mem) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->reserved = 0;
    memory(d, &mem->total, &mem->free, &mem->used);
    return NVML_SUCCESS;
}

/* -- utilisation, temperature, power ---------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    double util = sim_utilisation(h->slot);
    u->gpu = (unsigned)(util * 100.0 + 0.5);
    u->memory = (unsigned)(util * 40.0 + 0.5); /* memory-bus activity: a fixed share of busy */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensorType, unsigned int *temp) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!temp || sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)(35.0 + 45.0 * sim_utilisation(h->slot) + 0.5);
    return NVML_SUCCESS;
}

static void power_range(struct sim_device *d, unsigned *idle_mw, unsigned *tdp_mw) {
    int major, minor;
    unsigned tdp;
    sim_product(d->name, &major, &minor, &tdp);
    unsigned idle = tdp / 4 < 60 ? tdp / 4 : 60;
    *idle_mw = idle * 1000;
    *tdp_mw = tdp * 1000;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *power) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned idle, tdp;
    power_range(d, &idle, &tdp);
    *power = idle + (unsigned)((double)(tdp - idle) * sim_utilisation(h->slot));
    return NVML_SUCCESS;
}

/* Energy since the device was made (mJ): idle power all along plus the rest while busy. */
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, unsigned long long *energy) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!energy) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned idle, tdp;
    power_range(d, &idle, &tdp);
    uint64_t now = sim_now_ns();
    double alive_s = (double)(now - d->created_ns) / 1e9;
    double busy_s = (double)sim_busy_done(h->slot, now) / 1e9;
    *energy = (unsigned long long)(idle * alive_s + (tdp - idle) * busy_s);
    return NVML_SUCCESS;
}

static nvmlReturn_t power_limit(nvmlDevice_t h, unsigned int *limit) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned idle, tdp;
    power_range(d, &idle, &tdp);
    *limit = tdp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int *limit) {
    return power_limit(h, limit);
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t h, unsigned int *limit) {
    return power_limit(h, limit);
}
nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t h, unsigned int *limit) {
    return power_limit(h, limit);
}

static nvmlReturn_t constant(nvmlDevice_t h, int *out, int value) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = value;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 1);
}
nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 0);
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int *isPending) {
    return constant(h, isPending, 0);
}

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t h, int *pState) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!pState) return NVML_ERROR_INVALID_ARGUMENT;
    *pState = atomic_load(&d->busy_until) > sim_now_ns() ? 0 : 8;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int *speed) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!speed) return NVML_ERROR_INVALID_ARGUMENT;
    *speed = (unsigned)(30.0 + 50.0 * sim_utilisation(h->slot) + 0.5);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!clock || type < 0 || type > 3) return NVML_ERROR_INVALID_ARGUMENT;
    static const unsigned mhz[] = {1410, 1410, 1593, 1275}; /* graphics, SM, memory, video */
    *clock = atomic_load(&d->busy_until) > sim_now_ns() || type == 2 ? mhz[type] : 210;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!clock || type < 0 || type > 3) return NVML_ERROR_INVALID_ARGUMENT;
    static const unsigned mhz[] = {1410, 1410, 1593, 1275};
    *clock = mhz[type];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *currentMode,
                                  unsigned int *pendingMode) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    (void)currentMode;
    (void)pendingMode;
    return r ? r : NVML_ERROR_NOT_SUPPORTED;
}

/* -- processes -------------------------------------------------------------------------------- */

/* Processes with a context or memory on the device. Fills up to cap entries; returns how many
 * there are. */
static unsigned list_processes(int slot, unsigned cap, unsigned *pids, unsigned long long *mem) {
    sim_reap();
    unsigned n = 0;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &sim_state->proc[i];
        int32_t pid = atomic_load(&p->pid);
        if (pid <= 0) continue;
        struct sim_proc_device *pd = &p->dev[slot];
        uint64_t bytes = atomic_load(&pd->mem);
        if (atomic_load(&pd->contexts) == 0 && bytes == 0) continue;
        if (n < cap) {
            pids[n] = (unsigned)pid;
            mem[n] = bytes;
        }
        n++;
    }
    return n;
}

static nvmlReturn_t running(nvmlDevice_t h, unsigned int *infoCount, nvmlProcessInfo_t *infos,
                            nvmlProcessInfo_v1_t *infos_v1) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned pids[SIM_MAX_PROCS];
    unsigned long long mem[SIM_MAX_PROCS];
    unsigned n = list_processes(h->slot, SIM_MAX_PROCS, pids, mem);
    if (n > *infoCount || (n > 0 && !infos && !infos_v1)) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        if (infos)
            infos[i] = (nvmlProcessInfo_t){.pid = pids[i],
                                           .usedGpuMemory = mem[i],
                                           .gpuInstanceId = 0xFFFFFFFFu,
                                           .computeInstanceId = 0xFFFFFFFFu};
        else
            infos_v1[i] = (nvmlProcessInfo_v1_t){.pid = pids[i], .usedGpuMemory = mem[i]};
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return running(h, infoCount, infos, NULL);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return running(h, infoCount, infos, NULL);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t h, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos) {
    return running(h, infoCount, NULL, infos);
}

static nvmlReturn_t no_processes(nvmlDevice_t h, unsigned int *infoCount) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}

static unsigned long long wall_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
}

/* A process's share of the device since its previous sample (at least 100 ms ago). Its queued
 * work is assumed to run back to back until its last kernel ends, so work of other processes
 * interleaved with it makes this an underestimate while both are queued. */
static unsigned process_util(struct sim_proc_device *pd, uint64_t now) {
    uint64_t busy = atomic_load(&pd->busy), last_end = atomic_load(&pd->last_end);
    uint64_t pending = last_end > now ? last_end - now : 0;
    uint64_t done = busy > pending ? busy - pending : 0;
    uint64_t t0 = atomic_load(&pd->sample_t), done0 = atomic_load(&pd->sample_busy);
    unsigned util = 0;
    if (t0 && now > t0 && done >= done0) {
        double u = (double)(done - done0) / (double)(now - t0);
        util = (unsigned)((u > 1 ? 1 : u) * 100.0 + 0.5);
    }
    if (!t0 || now - t0 >= 100000000ull) {
        atomic_store(&pd->sample_t, now);
        atomic_store(&pd->sample_busy, done);
    }
    return util;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    struct sim_device *d;
    nvmlReturn_t r = device(h, &d);
    if (r) return r;
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long stamp = wall_us();
    if (lastSeenTimeStamp >= stamp) return NVML_ERROR_NOT_FOUND;
    unsigned pids[SIM_MAX_PROCS];
    unsigned long long mem[SIM_MAX_PROCS];
    unsigned n = list_processes(h->slot, SIM_MAX_PROCS, pids, mem);
    if (!utilization || n > *processSamplesCount) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    uint64_t now = sim_now_ns();
    unsigned k = 0;
    for (int i = 0; i < SIM_MAX_PROCS && k < n; i++) {
        struct sim_proc *p = &sim_state->proc[i];
        int32_t pid = atomic_load(&p->pid);
        if (pid <= 0 || (unsigned)pid != pids[k]) continue;
        utilization[k] = (nvmlProcessUtilizationSample_t){
            .pid = pids[k], .timeStamp = stamp, .smUtil = process_util(&p->dev[h->slot], now)};
        k++;
    }
    *processSamplesCount = k;
    return NVML_SUCCESS;
}
