/* sim_nvml.h - internals of the simulated libnvidia-ml.so.1, shared by nvml.c (init, identity,
 * memory, processes) and nvml_telemetry.c (clocks, power, thermals, errors, links, MIG, fields,
 * events). */
#ifndef GPUSHARE_SIM_NVML_H
#define GPUSHARE_SIM_NVML_H

#pragma GCC visibility push(default)
#include "gpushare_nvml.h"
#pragma GCC visibility pop

#include "sim_state.h"

struct nvmlDevice_st {
    unsigned index; /* machine ordinal */
    int slot;       /* state slot */
};

/* NVML_SUCCESS once nvmlInit has been called (and not undone), else NVML_ERROR_UNINITIALIZED. */
nvmlReturn_t sim_nvml_ready(void);

/* The device behind a handle: NVML_ERROR_UNINITIALIZED before nvmlInit, INVALID_ARGUMENT for a
 * handle that is not one of ours. */
nvmlReturn_t sim_nvml_device(nvmlDevice_t h, struct sim_device **out);

/* The prologue of every per-device query: declares `d` (the device behind handle `h`) and
 * returns the error for a bad handle, or NVML_ERROR_INVALID_ARGUMENT when `args_ok` (the
 * caller's output pointers, as a real driver checks them) is false. */
#define SIM_NVML_DEVICE(h, d, args_ok)                                                             \
    struct sim_device *d;                                                                          \
    do {                                                                                           \
        nvmlReturn_t prologue_ = sim_nvml_device((h), &d);                                         \
        if (prologue_ != NVML_SUCCESS) return prologue_;                                           \
        if (!(args_ok)) return NVML_ERROR_INVALID_ARGUMENT;                                        \
    } while (0);                                                                                   \
    (void)d

/* Whether the device has done work in about the last second (or is busy now): a real board then
 * sits in P0 at its boost clocks and only drops to P8 after a while idle. */
int sim_nvml_active(int slot);

/* CPU wall-clock time in µs (NVML's sample time stamps). */
unsigned long long sim_nvml_wall_us(void);

#endif
