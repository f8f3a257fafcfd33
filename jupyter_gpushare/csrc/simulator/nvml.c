/* nvml.c - the simulated libnvidia-ml.so.1: NVML's view of the simulated devices (init, system,
 * identity, memory, processes; clocks, power, thermals, errors, links, MIG, field values and
 * events are in nvml_telemetry.c).
 *
 * Everything is read from the shared state the simulated driver writes: memory in use (total and
 * per process), utilisation (busy fraction over the last second), and, derived from utilisation,
 * temperature, power, P-state and clocks. Like the real NVML it lists all devices of the machine
 * (GPUSHARE_SIM_DEVICES, after NVIDIA_VISIBLE_DEVICES) and ignores CUDA_VISIBLE_DEVICES. Each
 * query answers as the real driver does for that product (product.c): a feature the product lacks
 * is NVML_ERROR_NOT_SUPPORTED, never a missing symbol, so tools written for real GPUs (nvitop,
 * gpustat, DCGM-style collectors) run unchanged (tests/simulator/test_nvml_tools.py).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sim_nvml.h"

#define SIM_NVML_DRIVER  "580.82.07"
#define SIM_NVML_VERSION "13.580.82.07"
#define SIM_CUDA_VERSION 13000

static struct nvmlDevice_st handles[SIM_MAX_DEVICES];
static _Atomic int init_count;

nvmlReturn_t sim_nvml_ready(void) {
    return atomic_load(&init_count) > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

nvmlReturn_t sim_nvml_device(nvmlDevice_t h, struct sim_device **out) {
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!h || h < handles || h >= handles + sim_machine_count()) return NVML_ERROR_INVALID_ARGUMENT;
    if (!sim_dev_sound(h->slot)) return NVML_ERROR_GPU_IS_LOST; /* a damaged shared record */
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
    size_t n = strnlen(src, length); /* src may be shared state another process rewrites */
    if (n >= length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n);
    dst[n] = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = sim_nvml_ready();
    return r ? r : put_string(version, length, SIM_NVML_DRIVER);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = sim_nvml_ready();
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
    nvmlReturn_t r = sim_nvml_ready();
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
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned)sim_machine_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) {
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev) {
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!dev || index >= (unsigned)sim_machine_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev) {
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev) {
    nvmlReturn_t r = sim_nvml_ready();
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
    nvmlReturn_t r = sim_nvml_ready();
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

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *dev) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, dev);
}

static void serial_of(int slot, char *out, size_t cap) {
    snprintf(out, cap, "SIM%010u", (unsigned)slot);
}

nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *dev) {
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!serial || !dev) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < sim_machine_count(); i++) {
        char id[32];
        serial_of(handles[i].slot, id, sizeof id);
        if (strcmp(id, serial) == 0) {
            *dev = &handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* -- identity --------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    return put_string(name, length, d->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    return put_string(uuid, length, d->uuid);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    char buf[32];
    serial_of(h->slot, buf, sizeof buf);
    return put_string(serial, length, buf);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index) {
    SIM_NVML_DEVICE(h, d, index);
    *index = h->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minorNumber) {
    SIM_NVML_DEVICE(h, d, minorNumber);
    *minorNumber = (unsigned)h->slot;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    SIM_NVML_DEVICE(h, d, pci);
    memset(pci, 0, sizeof *pci);
    bus_id(h->slot, pci->busId, sizeof pci->busId);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", h->slot + 1);
    pci->bus = (unsigned)h->slot + 1;
    pci->pciDeviceId = sim_product_of(d->name)->pci_device_id;
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
    SIM_NVML_DEVICE(h, d, major && minor);
    unsigned tdp;
    sim_product(d->name, major, minor, &tdp);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t h, int *type) {
    SIM_NVML_DEVICE(h, d, type);
    *type = sim_product_of(d->name)->brand;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t h, unsigned int *arch) {
    SIM_NVML_DEVICE(h, d, arch);
    *arch = (unsigned)sim_product_of(d->name)->arch;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBoardPartNumber(nvmlDevice_t h, char *partNumber, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    char buf[32];
    snprintf(buf, sizeof buf, "SIM-%08X-0000", sim_product_of(d->name)->pci_device_id);
    return put_string(partNumber, length, buf);
}

nvmlReturn_t nvmlDeviceGetBoardId(nvmlDevice_t h, unsigned int *boardId) {
    SIM_NVML_DEVICE(h, d, boardId);
    *boardId = (unsigned)(h->slot + 1) << 8;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMultiGpuBoard(nvmlDevice_t h, unsigned int *multiGpuBool) {
    SIM_NVML_DEVICE(h, d, multiGpuBool);
    *multiGpuBool = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t h, char *version, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    return put_string(version, length, "92.00.00.00.01");
}

nvmlReturn_t nvmlDeviceGetInforomImageVersion(nvmlDevice_t h, char *version, unsigned int length) {
    SIM_NVML_DEVICE(h, d, 1);
    return put_string(version, length, "G500.0200.00.03");
}

nvmlReturn_t nvmlDeviceGetNumGpuCores(nvmlDevice_t h, unsigned int *numCores) {
    SIM_NVML_DEVICE(h, d, numCores);
    *numCores = d->sms * sim_product_of(d->name)->cores_per_sm;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t h, unsigned int *busWidth) {
    SIM_NVML_DEVICE(h, d, busWidth);
    *busWidth = sim_product_of(d->name)->bus_width;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t h, nvmlDeviceAttributes_t *attributes) {
    SIM_NVML_DEVICE(h, d, attributes);
    const struct sim_product *p = sim_product_of(d->name);
    *attributes = (nvmlDeviceAttributes_t){.multiprocessorCount = d->sms,
                                           .sharedCopyEngineCount = 7,
                                           .sharedDecoderCount = p->mig_slices ? 5 : 2,
                                           .sharedEncoderCount = 0,
                                           .sharedJpegCount = p->mig_slices ? 1 : 0,
                                           .sharedOfaCount = p->mig_slices ? 1 : 0,
                                           .gpuInstanceSliceCount = p->mig_slices,
                                           .computeInstanceSliceCount = p->mig_slices,
                                           .memorySizeMB = d->total_bytes >> 20};
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t h, nvmlDeviceAttributes_t *attributes) {
    return nvmlDeviceGetAttributes_v2(h, attributes);
}

static nvmlReturn_t constant(nvmlDevice_t h, int *out, int value) {
    SIM_NVML_DEVICE(h, d, out);
    *out = value;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 1); /* NVML_FEATURE_ENABLED, as on a data-centre machine */
}
nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 0); /* NVML_COMPUTEMODE_DEFAULT: processes share the GPU */
}
nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 0); /* NVML_GPU_VIRTUALIZATION_MODE_NONE: bare metal */
}
/* Data-centre boards drive no display: the display mode and display active are disabled. */
nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t h, int *display) {
    return constant(h, display, 0);
}
nvmlReturn_t nvmlDeviceGetDisplayActive(nvmlDevice_t h, int *isActive) {
    return constant(h, isActive, 0);
}
nvmlReturn_t nvmlDeviceGetAccountingMode(nvmlDevice_t h, int *mode) {
    return constant(h, mode, 0);
}

/* What a real Linux driver says NOT_SUPPORTED to on bare metal: driver models are Windows-only,
 * vGPU licensing needs a vGPU guest, and confidential computing is off. */
static nvmlReturn_t not_supported(nvmlDevice_t h, int args_ok) {
    SIM_NVML_DEVICE(h, d, args_ok);
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetDriverModel_v2(nvmlDevice_t h, int *current, int *pending) {
    return not_supported(h, current && pending);
}
nvmlReturn_t nvmlDeviceGetDriverModel(nvmlDevice_t h, int *current, int *pending) {
    return not_supported(h, current && pending);
}
nvmlReturn_t nvmlDeviceGetGridLicensableFeatures_v4(nvmlDevice_t h, void *features) {
    return not_supported(h, features != NULL);
}
nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t h,
                                                 nvmlConfComputeMemSizeInfo_t *memInfo) {
    return not_supported(h, memInfo != NULL);
}

/* -- topology: one node, every GPU under the same NUMA node; SXM boards also reach each other
 * over NVLink --------------------------------------------------------------------------------- */

#define TOPOLOGY_INTERNAL 0  /* NVML_TOPOLOGY_INTERNAL: the same device */
#define TOPOLOGY_NODE     40 /* NVML_TOPOLOGY_NODE: through the CPU's host bridges, one node */

static nvmlReturn_t cpu_set(unsigned int size, unsigned long *set) {
    if (!set || size == 0) return NVML_ERROR_INVALID_ARGUMENT;
    long cpus = sysconf(_SC_NPROCESSORS_CONF);
    unsigned bits = 8 * sizeof(unsigned long);
    for (unsigned i = 0; i < size; i++) {
        long first = (long)i * bits;
        long n = cpus - first;
        set[i] = n <= 0 ? 0 : (n >= (long)bits ? ~0ul : (1ul << n) - 1);
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t h, unsigned int cpuSetSize,
                                      unsigned long *cpuSet) {
    SIM_NVML_DEVICE(h, d, 1);
    return cpu_set(cpuSetSize, cpuSet);
}

nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t h, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet, unsigned int scope) {
    SIM_NVML_DEVICE(h, d, scope <= 1);
    return cpu_set(cpuSetSize, cpuSet);
}

nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t h, unsigned int nodeSetSize,
                                         unsigned long *nodeSet, unsigned int scope) {
    SIM_NVML_DEVICE(h, d, nodeSet && nodeSetSize > 0 && scope <= 1);
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    nodeSet[0] = 1; /* NUMA node 0 */
    return NVML_SUCCESS;
}

/* Only coherently attached GPUs (Grace Hopper) are NUMA nodes of their own. */
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t h, unsigned int *node) {
    SIM_NVML_DEVICE(h, d, node);
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 int *pathInfo) {
    SIM_NVML_DEVICE(device1, d1, pathInfo);
    SIM_NVML_DEVICE(device2, d2, 1);
    *pathInfo = device1 == device2 ? TOPOLOGY_INTERNAL : TOPOLOGY_NODE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t h, int level, unsigned int *count,
                                              nvmlDevice_t *deviceArray) {
    SIM_NVML_DEVICE(h, d, count && level >= 0);
    unsigned n = 0;
    for (int i = 0; i < sim_machine_count(); i++) {
        if (&handles[i] == h || level < TOPOLOGY_NODE) continue;
        if (deviceArray && n < *count) deviceArray[n] = &handles[i];
        n++;
    }
    if (deviceArray && n > *count) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetTopologyGpuSet(unsigned int cpuNumber, unsigned int *count,
                                         nvmlDevice_t *deviceArray) {
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!count || cpuNumber >= (unsigned)sysconf(_SC_NPROCESSORS_CONF))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = (unsigned)sim_machine_count();
    if (deviceArray) {
        if (n > *count) {
            *count = n;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (unsigned i = 0; i < n; i++) deviceArray[i] = &handles[i];
    }
    *count = n;
    return NVML_SUCCESS;
}

/* index: 0 read, 1 write, 2 NVLink, 3 atomics, 4 prop (PCIe). Peers reach each other over PCIe
 * (the simulated driver lets every pair access each other), over NVLink when both have it. */
nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int p2pIndex,
                                    int *p2pStatus) {
    SIM_NVML_DEVICE(device1, d1, p2pStatus && p2pIndex >= 0 && p2pIndex <= 4);
    SIM_NVML_DEVICE(device2, d2, 1);
    int ok = device1 != device2;
    if (p2pIndex == 2)
        ok = ok && sim_product_of(d1->name)->nvlinks && sim_product_of(d2->name)->nvlinks;
    *p2pStatus = ok ? 0 : 5; /* NVML_P2P_STATUS_OK, _NOT_SUPPORTED */
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
    SIM_NVML_DEVICE(h, d, mem);
    memory(d, &mem->total, &mem->free, &mem->used);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *mem) {
    SIM_NVML_DEVICE(h, d, mem);
    if (mem->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->reserved = 0;
    memory(d, &mem->total, &mem->free, &mem->used);
    return NVML_SUCCESS;
}

/* BAR1 (the CPU's window onto device memory): a few MiB mapped per process using the device. */
nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t h, nvmlBAR1Memory_t *bar1) {
    SIM_NVML_DEVICE(h, d, bar1);
    unsigned long long total = (unsigned long long)sim_product_of(d->name)->bar1_mib << 20;
    unsigned long long used = 1ull << 20;
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if (atomic_load(&sim_state->proc[i].pid) > 0 &&
            atomic_load(&sim_state->proc[i].dev[h->slot].contexts) > 0)
            used += 2ull << 20;
    if (used > total) used = total;
    *bar1 = (nvmlBAR1Memory_t){.bar1Total = total, .bar1Free = total - used, .bar1Used = used};
    return NVML_SUCCESS;
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
            int32_t host = atomic_load(&p->host_pid); /* the driver reports host pids */
            pids[n] = (unsigned)(host > 0 ? host : pid);
            /* the record is shared state: no process holds more than the whole device (what
             * the node agent's driver check charges a share comes from here) */
            uint64_t total = sim_state->dev[slot].total_bytes;
            mem[n] = bytes < total ? bytes : total;
        }
        n++;
    }
    return n;
}

static nvmlReturn_t running(nvmlDevice_t h, unsigned int *infoCount, nvmlProcessInfo_t *infos,
                            nvmlProcessInfo_v1_t *infos_v1) {
    SIM_NVML_DEVICE(h, d, infoCount);
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

/* No graphics or MPS clients on the simulated devices. */
static nvmlReturn_t no_processes(nvmlDevice_t h, unsigned int *infoCount) {
    SIM_NVML_DEVICE(h, d, infoCount);
    *infoCount = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t h, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t h, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t h, unsigned int *infoCount,
                                                     nvmlProcessInfo_v1_t *infos) {
    (void)infos;
    return no_processes(h, infoCount);
}

/* The newer form of the three lists above (mode 0 compute, 1 graphics, 2 MPS). */
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t h,
                                                   nvmlProcessDetailList_v1_t *plist) {
    SIM_NVML_DEVICE(h, d, plist);
    if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (plist->mode > 2) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned pids[SIM_MAX_PROCS];
    unsigned long long mem[SIM_MAX_PROCS];
    unsigned n = plist->mode == 0 ? list_processes(h->slot, SIM_MAX_PROCS, pids, mem) : 0;
    if (n > plist->numProcArrayEntries || (n > 0 && !plist->procArray)) {
        plist->numProcArrayEntries = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++)
        plist->procArray[i] = (nvmlProcessDetail_v1_t){.pid = pids[i],
                                                       .usedGpuMemory = mem[i],
                                                       .gpuInstanceId = 0xFFFFFFFFu,
                                                       .computeInstanceId = 0xFFFFFFFFu};
    plist->numProcArrayEntries = n;
    return NVML_SUCCESS;
}

unsigned long long sim_nvml_wall_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
}

/* A process's share of the device since its previous sample (at least 100 ms ago; the first one
 * is taken by the driver at the process's first launch). Its queued work is assumed to run back
 * to back until its last kernel ends, so work of other processes interleaved with it makes this
 * an underestimate while both are queued. */
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

/* Per-process samples of the device's processes: up to cap, returns how many there are. */
static unsigned process_samples(int slot, unsigned cap, unsigned *pids, unsigned *sm) {
    unsigned long long mem[SIM_MAX_PROCS];
    unsigned all[SIM_MAX_PROCS];
    unsigned n = list_processes(slot, SIM_MAX_PROCS, all, mem);
    uint64_t now = sim_now_ns();
    unsigned k = 0;
    for (int i = 0; i < SIM_MAX_PROCS && k < n && k < cap; i++) {
        struct sim_proc *p = &sim_state->proc[i];
        int32_t pid = atomic_load(&p->pid);
        int32_t host = atomic_load(&p->host_pid);
        if (pid <= 0 || (unsigned)(host > 0 ? host : pid) != all[k]) continue;
        pids[k] = all[k];
        sm[k] = process_util(&p->dev[slot], now);
        k++;
    }
    return n < cap ? k : n;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    SIM_NVML_DEVICE(h, d, processSamplesCount);
    unsigned long long stamp = sim_nvml_wall_us();
    if (lastSeenTimeStamp >= stamp) return NVML_ERROR_NOT_FOUND;
    unsigned cap = utilization ? *processSamplesCount : 0;
    unsigned pids[SIM_MAX_PROCS], sm[SIM_MAX_PROCS];
    unsigned n = process_samples(h->slot, cap < SIM_MAX_PROCS ? cap : SIM_MAX_PROCS, pids, sm);
    if (!utilization || n > *processSamplesCount) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++)
        utilization[k] = (nvmlProcessUtilizationSample_t){
            .pid = pids[k], .timeStamp = stamp, .smUtil = sm[k], .memUtil = sm[k] * 2 / 5};
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t h,
                                                   nvmlProcessesUtilizationInfo_v1_t *info) {
    SIM_NVML_DEVICE(h, d, info);
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long stamp = sim_nvml_wall_us();
    if (info->lastSeenTimeStamp >= stamp) return NVML_ERROR_NOT_FOUND;
    unsigned cap = info->procUtilArray ? info->processSamplesCount : 0;
    unsigned pids[SIM_MAX_PROCS], sm[SIM_MAX_PROCS];
    unsigned n = process_samples(h->slot, cap < SIM_MAX_PROCS ? cap : SIM_MAX_PROCS, pids, sm);
    if (!info->procUtilArray || n > info->processSamplesCount) {
        info->processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++)
        info->procUtilArray[k] = (nvmlProcessUtilizationInfo_v1_t){
            .timeStamp = stamp, .pid = pids[k], .smUtil = sm[k], .memUtil = sm[k] * 2 / 5};
    info->processSamplesCount = n;
    return NVML_SUCCESS;
}
