/* sim_state.h - the simulated GPUs' shared state, used by the simulated libcuda and libnvidia-ml.
 *
 * Every process on the machine that loads the simulator maps one file (GPUSHARE_SIM_STATE) holding
 * one record per simulated device and one per process using them. The device model is a single
 * time line per device: `busy_until` is when the last kernel scheduled on it ends. A launch of a
 * kernel lasting D ns whose stream dependencies end at `dep` starts at max(now, busy_until, dep)
 * and ends D later; it is placed with one compare-and-swap, so the device runs one kernel at a
 * time across all processes (time-sliced) and launches take no lock.
 *
 * Because every launch starts at or after the current `busy_until`, the work scheduled after
 * "now" is one contiguous stretch [now, busy_until): idle gaps can only lie in the past. Hence the
 * busy time completed by time T is exactly `busy_total - max(0, busy_until - T)`, which is what
 * the utilisation samples record (with busy_until, so the busy time up to any later instant is
 * known until the next launch, and every launch records a sample when its period has none). (A stream waiting on an event of another device can open a gap
 * in the future; utilisation then counts that gap as busy until it has passed.)
 */
#ifndef GPUSHARE_SIM_STATE_H
#define GPUSHARE_SIM_STATE_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define SIM_MAGIC          0x314d534853504721ULL /* "!GPSHSM1" */
#define SIM_VERSION        1u
#define SIM_MAX_DEVICES    64
#define SIM_MAX_PROCS      256
#define SIM_NAME_LEN       96
#define SIM_UUID_LEN       96
#define SIM_SAMPLES        64            /* utilisation samples kept per device ... */
#define SIM_SAMPLE_NS      50000000ull   /* ... one per 50 ms: 3.2 s of history */
#define SIM_UTIL_WINDOW_NS 1000000000ull /* NVML utilisation: busy fraction over the last second */
/* The state file is writable by every user (as /dev/nvidia* are), so every value read from it is
 * checked. Bounds of what the simulator's own processes can write: a device's time line at most
 * two hours ahead (twice the longest kernel the driver accepts; further out it is damage, and the
 * time line starts over from now), a device of at most 1 PiB and 4096 SMs. */
#define SIM_MAX_BACKLOG_NS   (2ull * 3600ull * 1000000000ull)
#define SIM_MAX_DEVICE_BYTES (1ull << 50)
#define SIM_MAX_SMS          4096u

typedef _Atomic uint64_t a64;
typedef _Atomic uint32_t a32;
typedef _Atomic int32_t ai32;

/* One utilisation sample: busy time completed by time t. Written under its own seqlock (odd seq:
 * being written); a writer that finds it taken simply skips, readers retry. */
struct sim_sample {
    a64 seq;
    a64 t;
    a64 done;
    a64 until; /* busy_until at t */
};

struct sim_device {
    char uuid[SIM_UUID_LEN]; /* "GPU-…": the key; written once under the file lock */
    char name[SIM_NAME_LEN];
    uint64_t total_bytes;
    uint32_t sms;
    uint32_t reserved0;
    uint64_t created_ns;
    a64 busy_until; /* CLOCK_MONOTONIC ns when the last scheduled kernel ends */
    a64 busy_total; /* sum of the durations of all kernels ever scheduled */
    a64 mem_used;   /* bytes allocated by all processes */
    a64 launches;   /* kernels (and graphs) scheduled */
    struct sim_sample samples[SIM_SAMPLES];
};

/* What one process holds on one device. */
struct sim_proc_device {
    a64 mem;      /* bytes allocated */
    a64 busy;     /* sum of the durations of its kernels */
    a64 last_end; /* end of its last kernel */
    a32 contexts; /* live contexts (primary retains count once) */
    a32 reserved;
    a64 sample_t; /* per-process utilisation sample (NVML process utilisation) */
    a64 sample_busy;
};

/* One process's record. Its owner holds an OFD lock on byte sizeof(struct sim_state) + index of
 * the state file for as long as it lives (the kernel drops it at exit, in any PID namespace);
 * whoever can take that lock frees the record and gives its memory back. start_time and instance
 * serve the fallback (kill(pid, 0)) on kernels without OFD locks. */
struct sim_proc {
    ai32 pid;       /* 0: free; -pid: being reaped */
    ai32 host_pid;  /* the pid the driver reports: as the host's pid namespace sees it (0: pid) */
    a64 start_time; /* process start time (clock ticks since boot), guards against pid reuse */
    a64 instance;   /* random per library load: tells an exec'd image from its predecessor */
    struct sim_proc_device dev[SIM_MAX_DEVICES];
};

struct sim_state {
    uint64_t magic; /* written last, under the file lock, once the rest is initialised */
    uint32_t version;
    uint32_t max_devices;
    uint64_t size;
    a32 ndev; /* devices [0, ndev) are valid; grows under the file lock */
    a32 reserved;
    struct sim_device dev[SIM_MAX_DEVICES];
    struct sim_proc proc[SIM_MAX_PROCS];
};

/* A device as this process sees it: one entry of GPUSHARE_SIM_DEVICES mapped into the state. */
struct sim_visible {
    int slot; /* index into state->dev */
};

/* -- state (sim_state.c) ---------------------------------------------------------------------- */

/* Maps the state file and registers the devices of GPUSHARE_SIM_DEVICES; 0 on success. Safe to
 * call from several threads. The driver opens once per process (reopen_if_changed = 0); NVML
 * opens again when the environment (GPUSHARE_SIM_*, *_VISIBLE_DEVICES) changed since, so that a
 * process can look at several simulated machines one after another. */
int sim_open(int reopen_if_changed);
extern struct sim_state *sim_state;

/* Devices of GPUSHARE_SIM_DEVICES after NVIDIA_VISIBLE_DEVICES (the "machine"); the CUDA view also
 * applies CUDA_VISIBLE_DEVICES. Both map an ordinal to a state slot. */
int sim_machine_count(void);
int sim_machine_slot(int ordinal);
int sim_cuda_count(void);
int sim_cuda_slot(int ordinal);
struct sim_device *sim_dev(int slot);
/* Whether a device's record reads as one the simulator made: its name and UUID ("GPU-…") end
 * within their fields, its memory and SM count are within bounds. A device that fails it is
 * refused (the open fails; later, CUDA_ERROR_OPERATING_SYSTEM / NVML_ERROR_GPU_IS_LOST). */
int sim_dev_sound(int slot);

/* This process's record, claimed on first use (NULL if the table is full). */
struct sim_proc *sim_self(void);
/* Frees the records of processes that have exited (their memory goes back to the devices). */
void sim_reap(void);

/* -- time and scheduling ---------------------------------------------------------------------- */
uint64_t sim_now_ns(void);
void sim_sleep_until(uint64_t t_ns);
/* Places a kernel of dur_ns on device slot after dep_ns; returns its end time. */
uint64_t sim_schedule(int slot, uint64_t dep_ns, uint64_t dur_ns);

/* -- memory ----------------------------------------------------------------------------------- */
/* Reserves bytes on a device for this process: returns the charge's generation (non-zero), or 0
 * when the device is full. Give the same generation back to sim_mem_release. */
uint64_t sim_mem_reserve(int slot, uint64_t bytes);
void sim_mem_release(int slot, uint64_t bytes, uint64_t generation);
void sim_context_count(int slot, int delta);

/* -- utilisation ------------------------------------------------------------------------------ */
/* Busy time completed on a device by now. */
uint64_t sim_busy_done(int slot, uint64_t now);
/* Records a sample if the current 50 ms period has none yet (cheap when it has). */
void sim_sample(int slot, uint64_t now);
/* Busy fraction (0..1) over about the last second. */
double sim_utilisation(int slot);

/* -- helpers ---------------------------------------------------------------------------------- */
void sim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
uint64_t sim_proc_start_time(pid_t pid);
int sim_pid_alive(pid_t pid, uint64_t start_time);

/* -- products (product.c) -------------------------------------------------------------------- */
/* NVML's enums for the fields below (nvmlDeviceArchitecture_t, nvmlBrandType_t). */
enum { SIM_ARCH_VOLTA = 5, SIM_ARCH_TURING = 6, SIM_ARCH_AMPERE = 7, SIM_ARCH_ADA = 8 };
enum { SIM_ARCH_HOPPER = 9, SIM_BRAND_TESLA = 2, SIM_BRAND_NVIDIA = 14 };

/* What a product is, as its real counterpart reports it. Clocks are in MHz, indexed by NVML's
 * clock type (graphics, SM, memory, video); `idle_clock` is where an idle board (P8) sits. */
struct sim_product {
    const char *key; /* substring of the NVML name */
    int cc_major, cc_minor;
    int arch, brand;
    unsigned tdp_w, idle_w, min_limit_w;
    unsigned max_clock[4], idle_clock[4];
    unsigned pcie_gen, pcie_width;
    unsigned nvlinks, nvlink_version, nvlink_mbps; /* NVLink: links, version, MB/s per link */
    unsigned bus_width, cores_per_sm, bar1_mib;
    unsigned slowdown_c, shutdown_c, gpu_max_c, mem_max_c; /* thresholds; mem_max_c 0: none */
    unsigned mig_slices;                                   /* max MIG devices; 0: no MIG */
    int hbm;                                               /* memory temperature sensor */
    int row_remapping; /* Ampere+ data-centre: remapped rows, no page retirement */
    unsigned pci_device_id;
};

const struct sim_product *sim_product_of(const char *name);
/* Compute capability and TDP (the driver's view). */
void sim_product(const char *name, int *cc_major, int *cc_minor, unsigned *tdp_watts);

#endif
