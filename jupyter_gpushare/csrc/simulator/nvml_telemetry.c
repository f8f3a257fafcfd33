/* nvml_telemetry.c - the simulated NVML's live and product-specific answers: utilisation, power,
 * thermals, P-state and clocks (all following the device's load), ECC and row remapping, PCIe and
 * NVLink, encoder/decoder engines, MIG, field values and events.
 *
 * Load model: a device that did work in about the last second (sim_nvml_active) is in P0 at its
 * boost clocks, with its PCIe link at full speed; one idle for longer is in P8 at its idle clocks
 * (clock event reason "GPU idle"). Power and temperature scale with utilisation between the
 * product's idle and TDP figures (product.c). What the product lacks answers
 * NVML_ERROR_NOT_SUPPORTED, as the real driver does: fans on passively cooled data-centre boards,
 * MIG outside A100/H100/H200, page retirement on parts that remap rows instead, NVLink on PCIe
 * boards. Nothing here fails a device: ECC, remapping and XID counters are all zero.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim_nvml.h"

#define NVML_NVLINK_MAX_LINKS 18
#define ENGINE_PERIOD_US      167000u /* sampling period NVML reports for the video engines */

int sim_nvml_active(int slot) {
    return atomic_load(&sim_dev(slot)->busy_until) > sim_now_ns() || sim_utilisation(slot) > 0.0;
}

static const struct sim_product *product(struct sim_device *d) {
    return sim_product_of(d->name);
}

/* -- utilisation, temperature, power ---------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    SIM_NVML_DEVICE(h, d, u);
    double util = sim_utilisation(h->slot);
    u->gpu = (unsigned)(util * 100.0 + 0.5);
    u->memory = (unsigned)(util * 40.0 + 0.5); /* memory-bus activity: a fixed share of busy */
    return NVML_SUCCESS;
}

static unsigned gpu_temperature(int slot) {
    return (unsigned)(35.0 + 45.0 * sim_utilisation(slot) + 0.5); /* 35 °C idle .. 80 °C busy */
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensorType, unsigned int *temp) {
    SIM_NVML_DEVICE(h, d, temp && sensorType == NVML_TEMPERATURE_GPU);
    *temp = gpu_temperature(h->slot);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t h, nvmlTemperature_v1_t *temperature) {
    SIM_NVML_DEVICE(h, d, temperature);
    if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    temperature->temperature = (int)gpu_temperature(h->slot);
    return NVML_SUCCESS;
}

/* Thresholds: 0 shutdown, 1 slowdown, 2 memory max (HBM parts), 3 GPU max; the acoustic and
 * GPS thresholds (4..) belong to boards with fans or boost software and are not supported. */
nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t h, int thresholdType,
                                               unsigned int *temp) {
    SIM_NVML_DEVICE(h, d, temp && thresholdType >= 0);
    const struct sim_product *p = product(d);
    unsigned value = 0;
    switch (thresholdType) {
    case 0:
        value = p->shutdown_c;
        break;
    case 1:
        value = p->slowdown_c;
        break;
    case 2:
        value = p->mem_max_c;
        break;
    case 3:
        value = p->gpu_max_c;
        break;
    default:
        break;
    }
    if (!value) return NVML_ERROR_NOT_SUPPORTED;
    *temp = value;
    return NVML_SUCCESS;
}

static unsigned power_mw(struct sim_device *d, int slot) {
    const struct sim_product *p = product(d);
    unsigned idle = p->idle_w * 1000, tdp = p->tdp_w * 1000;
    return idle + (unsigned)((double)(tdp - idle) * sim_utilisation(slot));
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *power) {
    SIM_NVML_DEVICE(h, d, power);
    *power = power_mw(d, h->slot);
    return NVML_SUCCESS;
}

static unsigned long long energy_mj(struct sim_device *d, int slot) {
    const struct sim_product *p = product(d);
    uint64_t now = sim_now_ns();
    double alive_s = (double)(now - d->created_ns) / 1e9;
    double busy_s = (double)sim_busy_done(slot, now) / 1e9;
    return (unsigned long long)(1000.0 * (p->idle_w * alive_s + (p->tdp_w - p->idle_w) * busy_s));
}

/* Energy since the device was made (mJ): idle power all along plus the rest while busy. */
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, unsigned long long *energy) {
    SIM_NVML_DEVICE(h, d, energy);
    *energy = energy_mj(d, h->slot);
    return NVML_SUCCESS;
}

static nvmlReturn_t power_limit(nvmlDevice_t h, unsigned int *limit) {
    SIM_NVML_DEVICE(h, d, limit);
    *limit = product(d)->tdp_w * 1000;
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

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t h, unsigned int *minLimit,
                                                          unsigned int *maxLimit) {
    SIM_NVML_DEVICE(h, d, minLimit && maxLimit);
    *minLimit = product(d)->min_limit_w * 1000;
    *maxLimit = product(d)->tdp_w * 1000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementMode(nvmlDevice_t h, int *mode) {
    SIM_NVML_DEVICE(h, d, mode);
    *mode = 1; /* NVML_FEATURE_ENABLED */
    return NVML_SUCCESS;
}

/* Passively cooled data-centre boards have no fan of their own. */
nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int *speed) {
    SIM_NVML_DEVICE(h, d, speed);
    return NVML_ERROR_NOT_SUPPORTED;
}

/* -- P-state and clocks ----------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t h, int *pState) {
    SIM_NVML_DEVICE(h, d, pState);
    *pState = sim_nvml_active(h->slot) ? 0 : 8;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t h, int *pState) {
    return nvmlDeviceGetPerformanceState(h, pState);
}

/* clock types: 0 graphics, 1 SM, 2 memory, 3 video */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    SIM_NVML_DEVICE(h, d, clock && type >= 0 && type <= 3);
    const struct sim_product *p = product(d);
    *clock = sim_nvml_active(h->slot) ? p->max_clock[type] : p->idle_clock[type];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    SIM_NVML_DEVICE(h, d, clock && type >= 0 && type <= 3);
    *clock = product(d)->max_clock[type];
    return NVML_SUCCESS;
}

/* Application clocks (the target a busy board runs at) are its boost clocks here. */
nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t h, int type, unsigned int *clock) {
    return nvmlDeviceGetMaxClockInfo(h, type, clock);
}
nvmlReturn_t nvmlDeviceGetDefaultApplicationsClock(nvmlDevice_t h, int type, unsigned int *clock) {
    return nvmlDeviceGetMaxClockInfo(h, type, clock);
}
nvmlReturn_t nvmlDeviceGetMaxCustomerBoostClock(nvmlDevice_t h, int type, unsigned int *clock) {
    return nvmlDeviceGetMaxClockInfo(h, type, clock);
}

/* clock ids: 0 current, 1 application target, 2 application default, 3 customer boost max */
nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t h, int type, int id, unsigned int *clock) {
    SIM_NVML_DEVICE(h, d, clock && type >= 0 && type <= 3 && id >= 0 && id <= 3);
    return id == 0 ? nvmlDeviceGetClockInfo(h, type, clock)
                   : nvmlDeviceGetMaxClockInfo(h, type, clock);
}

/* Boost is managed by the driver on data-centre boards (nvidia-smi shows N/A). */
nvmlReturn_t nvmlDeviceGetAutoBoostedClocksEnabled(nvmlDevice_t h, int *isEnabled,
                                                   int *defaultIsEnabled) {
    SIM_NVML_DEVICE(h, d, isEnabled && defaultIsEnabled);
    return NVML_ERROR_NOT_SUPPORTED;
}

#define REASON_GPU_IDLE 0x1ull
#define REASONS_SUPPORTED                                                                          \
    0xFFull /* idle, app clocks, SW power cap, HW slowdown, sync boost, SW
                                     and HW thermal, HW power brake */

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long *reasons) {
    SIM_NVML_DEVICE(h, d, reasons);
    *reasons = sim_nvml_active(h->slot) ? 0 : REASON_GPU_IDLE;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h,
                                                       unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(h, reasons);
}
nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t h,
                                                      unsigned long long *supported) {
    SIM_NVML_DEVICE(h, d, supported);
    *supported = REASONS_SUPPORTED;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t h,
                                                         unsigned long long *supported) {
    return nvmlDeviceGetSupportedClocksEventReasons(h, supported);
}

/* Time held below the requested clocks by a policy (power, thermal, ...): never, here. */
nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t h, int perfPolicyType,
                                          nvmlViolationTime_t *violTime) {
    SIM_NVML_DEVICE(h, d, violTime && perfPolicyType >= 0 && perfPolicyType <= 11);
    *violTime = (nvmlViolationTime_t){.referenceTime = sim_nvml_wall_us(), .violationTime = 0};
    return NVML_SUCCESS;
}

/* -- ECC, retired pages, remapped rows -------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t h, int *current, int *pending) {
    SIM_NVML_DEVICE(h, d, current && pending);
    *current = *pending = 1; /* enabled, as data-centre boards ship */
    return NVML_SUCCESS;
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int errorType, int counterType,
                                         unsigned long long *eccCounts) {
    SIM_NVML_DEVICE(h, d,
                    eccCounts && errorType >= 0 && errorType <= 1 && counterType >= 0 &&
                        counterType <= 1);
    *eccCounts = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDetailedEccErrors(nvmlDevice_t h, int errorType, int counterType,
                                            nvmlEccErrorCounts_t *eccCounts) {
    SIM_NVML_DEVICE(h, d,
                    eccCounts && errorType >= 0 && errorType <= 1 && counterType >= 0 &&
                        counterType <= 1);
    *eccCounts = (nvmlEccErrorCounts_t){0};
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t h, int errorType, int counterType,
                                             int locationType, unsigned long long *count) {
    SIM_NVML_DEVICE(h, d,
                    count && errorType >= 0 && errorType <= 1 && counterType >= 0 &&
                        counterType <= 1 && locationType >= 0 && locationType <= 7);
    *count = 0;
    return NVML_SUCCESS;
}

/* Page retirement: Volta and Turing; Ampere and later data-centre parts remap rows instead. */
nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t h, int cause, unsigned int *pageCount,
                                          unsigned long long *addresses,
                                          unsigned long long *timestamps) {
    SIM_NVML_DEVICE(h, d, pageCount && cause >= 0 && cause <= 1);
    (void)addresses;
    (void)timestamps;
    if (product(d)->row_remapping) return NVML_ERROR_NOT_SUPPORTED;
    *pageCount = 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t h, int cause, unsigned int *pageCount,
                                       unsigned long long *addresses) {
    return nvmlDeviceGetRetiredPages_v2(h, cause, pageCount, addresses, NULL);
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int *isPending) {
    SIM_NVML_DEVICE(h, d, isPending);
    *isPending = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred) {
    SIM_NVML_DEVICE(h, d, corrRows && uncRows && isPending && failureOccurred);
    if (!product(d)->row_remapping) return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = *uncRows = *isPending = *failureOccurred = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRowRemapperHistogram(nvmlDevice_t h,
                                               nvmlRowRemapperHistogramValues_t *values) {
    SIM_NVML_DEVICE(h, d, values);
    if (!product(d)->row_remapping) return NVML_ERROR_NOT_SUPPORTED;
    *values = (nvmlRowRemapperHistogramValues_t){.max = 640}; /* every bank: all spare rows */
    return NVML_SUCCESS;
}

/* -- PCIe ------------------------------------------------------------------------------------- */

/* An idle board trains its link down to generation 1 and back up when work arrives. */
static unsigned pcie_gen_now(struct sim_device *d, int slot) {
    return sim_nvml_active(slot) ? product(d)->pcie_gen : 1;
}

static unsigned lane_mbps(unsigned gen) { /* NVML_PCIE_LINK_MAX_SPEED_* */
    static const unsigned mbps[] = {0, 2500, 5000, 8000, 16000, 32000};
    return gen < sizeof mbps / sizeof mbps[0] ? mbps[gen] : 0;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t h, unsigned int *currLinkGen) {
    SIM_NVML_DEVICE(h, d, currLinkGen);
    *currLinkGen = pcie_gen_now(d, h->slot);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t h, unsigned int *maxLinkGen) {
    SIM_NVML_DEVICE(h, d, maxLinkGen);
    *maxLinkGen = product(d)->pcie_gen;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t h, unsigned int *maxLinkGen) {
    return nvmlDeviceGetMaxPcieLinkGeneration(h, maxLinkGen);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t h, unsigned int *currLinkWidth) {
    SIM_NVML_DEVICE(h, d, currLinkWidth);
    *currLinkWidth = product(d)->pcie_width;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t h, unsigned int *maxLinkWidth) {
    return nvmlDeviceGetCurrPcieLinkWidth(h, maxLinkWidth);
}
nvmlReturn_t nvmlDeviceGetPcieLinkMaxSpeed(nvmlDevice_t h, unsigned int *maxSpeed) {
    SIM_NVML_DEVICE(h, d, maxSpeed);
    *maxSpeed = lane_mbps(product(d)->pcie_gen);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPcieSpeed(nvmlDevice_t h, unsigned int *pcieSpeed) {
    SIM_NVML_DEVICE(h, d, pcieSpeed);
    *pcieSpeed = lane_mbps(pcie_gen_now(d, h->slot));
    return NVML_SUCCESS;
}

/* KB/s over the last 20 ms (counter 0 TX, 1 RX). Copies take no bus time in the simulator; what
 * remains is launch and doorbell traffic while the device works. */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t h, int counter, unsigned int *value) {
    SIM_NVML_DEVICE(h, d, value && counter >= 0 && counter <= 1);
    *value = sim_nvml_active(h->slot) ? (counter == 0 ? 96u : 288u) : 0u;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t h, unsigned int *value) {
    SIM_NVML_DEVICE(h, d, value);
    *value = 0;
    return NVML_SUCCESS;
}

/* -- NVLink (SXM boards on an HGX baseboard: every link up; PCIe boards have none) ------------- */

static nvmlReturn_t nvlink(struct sim_device *d, unsigned link) {
    if (link >= NVML_NVLINK_MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
    return link < product(d)->nvlinks ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, int *isActive) {
    SIM_NVML_DEVICE(h, d, isActive);
    nvmlReturn_t r = nvlink(d, link);
    if (r == NVML_SUCCESS) *isActive = 1;
    return r;
}

nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t h, unsigned int link, unsigned int *version) {
    SIM_NVML_DEVICE(h, d, version);
    nvmlReturn_t r = nvlink(d, link);
    if (r == NVML_SUCCESS) *version = product(d)->nvlink_version;
    return r;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t h, unsigned int link, int counter,
                                             unsigned long long *counterValue) {
    SIM_NVML_DEVICE(h, d, counterValue && counter >= 0 && counter <= 4);
    nvmlReturn_t r = nvlink(d, link);
    if (r == NVML_SUCCESS) *counterValue = 0;
    return r;
}

/* -- video engines ---------------------------------------------------------------------------- */

/* No simulated program uses the encoders, decoders, JPEG or optical-flow engines: they report 0 %
 * over the engines' sampling period (JPEG and OFA exist from Ampere on). */
static nvmlReturn_t engine(nvmlDevice_t h, unsigned int *utilization, unsigned int *period,
                           int min_arch) {
    SIM_NVML_DEVICE(h, d, utilization && period);
    if (product(d)->arch < min_arch) return NVML_ERROR_NOT_SUPPORTED;
    *utilization = 0;
    *period = ENGINE_PERIOD_US;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t h, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs) {
    return engine(h, utilization, samplingPeriodUs, 0);
}
nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t h, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs) {
    return engine(h, utilization, samplingPeriodUs, 0);
}
nvmlReturn_t nvmlDeviceGetJpgUtilization(nvmlDevice_t h, unsigned int *utilization,
                                         unsigned int *samplingPeriodUs) {
    return engine(h, utilization, samplingPeriodUs, SIM_ARCH_AMPERE);
}
nvmlReturn_t nvmlDeviceGetOfaUtilization(nvmlDevice_t h, unsigned int *utilization,
                                         unsigned int *samplingPeriodUs) {
    return engine(h, utilization, samplingPeriodUs, SIM_ARCH_AMPERE);
}

nvmlReturn_t nvmlDeviceGetEncoderStats(nvmlDevice_t h, unsigned int *sessionCount,
                                       unsigned int *averageFps, unsigned int *averageLatency) {
    SIM_NVML_DEVICE(h, d, sessionCount && averageFps && averageLatency);
    *sessionCount = *averageFps = *averageLatency = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEncoderSessions(nvmlDevice_t h, unsigned int *sessionCount,
                                          nvmlEncoderSessionInfo_t *sessionInfos) {
    SIM_NVML_DEVICE(h, d, sessionCount);
    (void)sessionInfos;
    *sessionCount = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFBCStats(nvmlDevice_t h, nvmlFBCStats_t *fbcStats) {
    SIM_NVML_DEVICE(h, d, fbcStats);
    *fbcStats = (nvmlFBCStats_t){0};
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFBCSessions(nvmlDevice_t h, unsigned int *sessionCount,
                                      nvmlFBCSessionInfo_t *sessionInfo) {
    SIM_NVML_DEVICE(h, d, sessionCount);
    (void)sessionInfo;
    *sessionCount = 0;
    return NVML_SUCCESS;
}

/* -- MIG (A100, H100, H200: capable, disabled; gpushare shares whole GPUs by time) ------------ */

static nvmlReturn_t mig_capable(struct sim_device *d) {
    return product(d)->mig_slices ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *currentMode,
                                  unsigned int *pendingMode) {
    SIM_NVML_DEVICE(h, d, currentMode && pendingMode);
    nvmlReturn_t r = mig_capable(d);
    if (r == NVML_SUCCESS) *currentMode = *pendingMode = 0; /* NVML_DEVICE_MIG_DISABLE */
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count) {
    SIM_NVML_DEVICE(h, d, count);
    nvmlReturn_t r = mig_capable(d);
    if (r == NVML_SUCCESS) *count = product(d)->mig_slices;
    return r;
}

/* MIG disabled: there is no MIG device at any index. */
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index,
                                                 nvmlDevice_t *migDevice) {
    SIM_NVML_DEVICE(h, d, migDevice);
    nvmlReturn_t r = mig_capable(d);
    if (r != NVML_SUCCESS) return r;
    return index < product(d)->mig_slices ? NVML_ERROR_NOT_FOUND : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *isMigDevice) {
    SIM_NVML_DEVICE(h, d, isMigDevice);
    *isMigDevice = 0;
    return NVML_SUCCESS;
}

/* Every handle is a whole GPU's, so none is a MIG device's. */
nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                          nvmlDevice_t *device) {
    SIM_NVML_DEVICE(migDevice, d, device);
    return NVML_ERROR_INVALID_ARGUMENT;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id) {
    SIM_NVML_DEVICE(h, d, id);
    return NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id) {
    SIM_NVML_DEVICE(h, d, id);
    return NVML_ERROR_NOT_SUPPORTED;
}

/* -- field values (how DCGM and exporters read counters in bulk) ------------------------------ */

enum { VT_DOUBLE = 0, VT_UINT = 1, VT_ULL = 3, VT_SLL = 4 };

static nvmlReturn_t field(struct sim_device *d, int slot, unsigned id, unsigned scope, int *type,
                          nvmlValue_t *v) {
    const struct sim_product *p = product(d);
    *type = VT_ULL;
    v->ullVal = 0;
    switch (id) {
    case 1: /* NVML_FI_DEV_ECC_CURRENT */
    case 2: /* NVML_FI_DEV_ECC_PENDING */
        *type = VT_UINT;
        v->uiVal = 1;
        return NVML_SUCCESS;
    case 3: /* ECC single/double bit, volatile/aggregate totals */
    case 4:
    case 5:
    case 6:
        return NVML_SUCCESS;
    case 29: /* NVML_FI_DEV_RETIRED_SBE, _DBE, _PENDING */
    case 30:
    case 31:
        return p->row_remapping ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
    case 74: /* NVML_FI_DEV_PERF_POLICY_POWER, _THERMAL: violation time, ns */
    case 75:
        return NVML_SUCCESS;
    case 82: /* NVML_FI_DEV_MEMORY_TEMP */
        if (!p->hbm) return NVML_ERROR_NOT_SUPPORTED;
        *type = VT_UINT;
        v->uiVal = gpu_temperature(slot) + 4;
        return NVML_SUCCESS;
    case 83: /* NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ */
        v->ullVal = energy_mj(d, slot);
        return NVML_SUCCESS;
    case 90: /* NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON */
        if (!p->nvlinks) return NVML_ERROR_NOT_SUPPORTED;
        *type = VT_UINT;
        v->uiVal = p->nvlink_mbps;
        return NVML_SUCCESS;
    case 91: /* NVML_FI_DEV_NVLINK_LINK_COUNT */
        *type = VT_UINT;
        v->uiVal = p->nvlinks;
        return NVML_SUCCESS;
    case 66: /* NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL, _C1_TOTAL */
    case 73:
    case 138: /* NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _RX, _RAW_TX, _RAW_RX (KiB, per link) */
    case 139:
    case 140:
    case 141:
        if (!p->nvlinks) return NVML_ERROR_NOT_SUPPORTED;
        if (id >= 138 && scope != 0xFFFFFFFFu && scope >= p->nvlinks)
            return NVML_ERROR_INVALID_ARGUMENT;
        return NVML_SUCCESS;
    case 94: /* NVML_FI_DEV_PCIE_REPLAY_COUNTER */
        return NVML_SUCCESS;
    case 142: /* NVML_FI_DEV_REMAPPED_COR, _UNC, _PENDING, _FAILURE */
    case 143:
    case 144:
    case 145:
        *type = VT_UINT;
        v->uiVal = 0;
        return p->row_remapping ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
    case 185: /* NVML_FI_DEV_POWER_AVERAGE, _INSTANT (mW) */
    case 186:
        *type = VT_UINT;
        v->uiVal = power_mw(d, slot);
        return NVML_SUCCESS;
    case 197: /* NVML_FI_DEV_PCIE_COUNT_TX_BYTES, _RX_BYTES */
    case 198:
        return NVML_SUCCESS;
    default:
        return NVML_ERROR_NOT_SUPPORTED;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int valuesCount, nvmlFieldValue_t *values) {
    SIM_NVML_DEVICE(h, d, values && valuesCount >= 0);
    long long stamp = (long long)sim_nvml_wall_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *f = &values[i];
        f->timestamp = stamp;
        f->latencyUsec = 0;
        f->nvmlReturn = field(d, h->slot, f->fieldId, f->scopeId, &f->valueType, &f->value);
    }
    return NVML_SUCCESS;
}

/* -- events (health watchers: XID, ECC, P-state, clocks) -------------------------------------- */

#define EVENT_SET_MAGIC 0x4e564553u
#define EVENTS_BASE     0x1Full /* single/double-bit ECC, P-state, XID critical, clock */
#define EVENT_MIG       0x100ull

struct nvmlEventSet_st {
    unsigned magic;
    unsigned long long types;
};

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *eventTypes) {
    SIM_NVML_DEVICE(h, d, eventTypes);
    *eventTypes = EVENTS_BASE | (product(d)->mig_slices ? EVENT_MIG : 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t r = sim_nvml_ready();
    if (r) return r;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long eventTypes,
                                      nvmlEventSet_t set) {
    SIM_NVML_DEVICE(h, d, set && set->magic == EVENT_SET_MAGIC);
    unsigned long long supported = EVENTS_BASE | (product(d)->mig_slices ? EVENT_MIG : 0);
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    set->types |= eventTypes;
    return NVML_SUCCESS;
}

/* A healthy simulated GPU raises no events: waiting times out. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                 unsigned int timeoutms) {
    if (!set || set->magic != EVENT_SET_MAGIC || !data) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec left = {.tv_sec = timeoutms / 1000,
                            .tv_nsec = (long)(timeoutms % 1000) * 1000000};
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {}
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}
