/* sim_state.c - opening the shared state, device lists, process records, scheduling, utilisation.
 * See sim_state.h for the model. Compiled into both simulated libraries. */
#define _GNU_SOURCE
#include "sim_state.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct sim_state *sim_state;

/* GPUSHARE_SIM_DEVICES as parsed: state slots in list order. */
static int spec_slots[SIM_MAX_DEVICES];
static int spec_count;
/* After NVIDIA_VISIBLE_DEVICES (the machine) and then CUDA_VISIBLE_DEVICES (the CUDA view). */
static int machine_idx[SIM_MAX_DEVICES];
static int machine_count;
static int cuda_idx[SIM_MAX_DEVICES];
static int cuda_count;

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static int open_result = -1;
static char opened_env[8192]; /* the environment the state was opened with */

static uint64_t self_instance;
static _Atomic int self_index = -1;
static _Atomic pid_t self_pid;
/* Changes whenever this process claims a record: memory charged under an older generation was
 * given back by whoever reaped that record (see sim_mem_release). */
static a64 self_generation;

/* Liveness: a process holds an open-file-description lock on one byte per record it owns (past
 * the end of the state file), through state_fd (never mapped, close-on-exec, closed in forked
 * children). The kernel drops it when the process exits, whatever its PID namespace, so a
 * reaper that can take the lock knows the owner is gone. Kernels without OFD locks fall back to
 * kill(pid, 0). */
static int state_fd = -1;
static pid_t state_fd_owner;
static int ofd_locks = 1;
static char state_path[4096];

void sim_log(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof buf) n = sizeof buf - 1;
    char line[600];
    int m = snprintf(line, sizeof line, "gpushare simulator: %.*s\n", n, buf);
    if (m > 0) {
        ssize_t w =
            write(STDERR_FILENO, line, (size_t)m < sizeof line ? (size_t)m : sizeof line - 1);
        (void)w;
    }
}

/* -- time ------------------------------------------------------------------------------------- */

uint64_t sim_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sim_sleep_until(uint64_t t_ns) {
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull),
                          .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

/* -- processes -------------------------------------------------------------------------------- */

/* Start time (field 22 of /proc/pid/stat); 0 if unknown. Sets *zombie when the state is Z/X. */
static uint64_t read_stat(pid_t pid, int *zombie) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2; /* field 3: state */
    if (zombie) *zombie = (*p == 'Z' || *p == 'X');
    for (int field = 3; field < 22 && *p; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

uint64_t sim_proc_start_time(pid_t pid) {
    return read_stat(pid, NULL);
}

int sim_pid_alive(pid_t pid, uint64_t start_time) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno != EPERM) return 0;
    int zombie = 0;
    uint64_t st = read_stat(pid, &zombie);
    if (zombie) return 0;
    if (st && start_time && st != start_time) return 0; /* the pid was reused */
    return 1;
}

static void release_record(struct sim_proc *p) {
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        struct sim_proc_device *pd = &p->dev[d];
        uint64_t mem = atomic_exchange(&pd->mem, 0);
        if (mem) atomic_fetch_sub(&sim_state->dev[d].mem_used, mem);
        atomic_store(&pd->busy, 0);
        atomic_store(&pd->last_end, 0);
        atomic_store(&pd->contexts, 0);
        atomic_store(&pd->sample_t, 0);
        atomic_store(&pd->sample_busy, 0);
    }
    atomic_store(&p->start_time, 0);
    atomic_store(&p->instance, 0);
    atomic_store(&p->host_pid, 0);
}

/* Takes record p (holding pid) away from its owner and frees it. */
static void reap_record(struct sim_proc *p, int32_t pid) {
    int32_t expected = pid;
    if (!atomic_compare_exchange_strong(&p->pid, &expected, -pid))
        return; /* someone else reaps it, or it changed */
    release_record(p);
    atomic_store(&p->pid, 0);
}

static int slot_lock(int i, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)sizeof(struct sim_state) + i;
    fl.l_len = 1;
    return fcntl(state_fd, F_OFD_SETLK, &fl);
}

/* 1: record i's owner lives. 0: it is gone, and this process now holds the record's lock (give
 * it back with slot_lock(i, F_UNLCK) once done). -1: cannot tell by locks (use pids). */
static int owner_alive(int i) {
    if (i == atomic_load(&self_index)) return 1;
    if (!ofd_locks || state_fd < 0) return -1;
    if (slot_lock(i, F_WRLCK) == 0) return 0;
    if (errno == EINVAL) {
        ofd_locks = 0;
        return -1;
    }
    return 1; /* EAGAIN/EACCES: held */
}

/* A forked child shares its parent's open file description, and with it the parent's locks:
 * it needs one of its own before it can hold a record. */
static void own_state_fd(void) {
    if (state_fd >= 0 && state_fd_owner == getpid()) return;
    if (!state_path[0]) return;
    int fd = open(state_path, O_RDWR | O_CLOEXEC);
    if (state_fd >= 0) close(state_fd);
    state_fd = fd;
    state_fd_owner = getpid();
}

void sim_reap(void) {
    if (!sim_state) return;
    own_state_fd();
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc *p = &sim_state->proc[i];
        int32_t pid = atomic_load(&p->pid);
        if (pid <= 0) continue;
        int alive = owner_alive(i);
        if (alive == 0) {
            reap_record(p, pid);
            slot_lock(i, F_UNLCK);
        } else if (alive < 0) {
            uint64_t st = atomic_load(&p->start_time);
            if (st == 0 && atomic_load(&p->instance) == 0) continue; /* being claimed right now */
            if (!sim_pid_alive(pid, st)) reap_record(p, pid);
        }
    }
}

/* This process's pid as the host's pid namespace sees it, which is what a real driver reports
 * (it sees every process from there, also those in a container's namespace): the "self" link of
 * GPUSHARE_SIM_HOST_PROC, a procfs mounted in the host's pid namespace (a pod's own /proc shows
 * its own namespace only), by default /proc. 0 if unknown. */
static int32_t host_pid(void) {
    const char *proc = getenv("GPUSHARE_SIM_HOST_PROC");
    char path[4096], link[32];
    snprintf(path, sizeof path, "%s/self", proc && *proc ? proc : "/proc");
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) return 0;
    link[n] = 0;
    long v = strtol(link, NULL, 10);
    return v > 0 && v <= INT32_MAX ? (int32_t)v : 0;
}

static struct sim_proc *claim_self(void) {
    pid_t me = getpid();
    uint64_t st = sim_proc_start_time(me);
    own_state_fd();
    if (!ofd_locks || state_fd < 0) {
        /* Without locks: a record with our pid but another instance is the image we were
         * exec'd from. */
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            struct sim_proc *p = &sim_state->proc[i];
            if (atomic_load(&p->pid) == me && atomic_load(&p->instance) != self_instance)
                reap_record(p, me);
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            struct sim_proc *p = &sim_state->proc[i];
            if (atomic_load(&p->pid) != 0) continue;
            int locked = 0;
            if (ofd_locks && state_fd >= 0) {
                if (slot_lock(i, F_WRLCK) == 0)
                    locked = 1;
                else if (errno == EINVAL)
                    ofd_locks = 0;
                else
                    continue; /* a reaper holds it for a moment */
            }
            int32_t expected = 0;
            if (atomic_compare_exchange_strong(&p->pid, &expected, (int32_t)me)) {
                release_record(p); /* clean slate (a reaper zeroed it already; be sure) */
                atomic_store(&p->start_time, st ? st : 1);
                atomic_store(&p->instance, self_instance);
                atomic_store(&p->host_pid, host_pid());
                atomic_store(&self_pid, me);
                atomic_fetch_add(&self_generation, 1);
                atomic_store_explicit(&self_index, i, memory_order_release);
                return p;
            }
            if (locked) slot_lock(i, F_UNLCK);
        }
        sim_reap();
    }
    sim_log("the process table (%d entries) is full", SIM_MAX_PROCS);
    return NULL;
}

struct sim_proc *sim_self(void) {
    /* Fast path: no system call (a forked child resets self_index in its atfork handler). The
     * record is still ours unless someone reaped it (we closed the descriptor holding its
     * lock): then we claim a new one. */
    int idx = atomic_load_explicit(&self_index, memory_order_acquire);
    if (idx >= 0 && atomic_load_explicit(&sim_state->proc[idx].pid, memory_order_relaxed) ==
                        atomic_load_explicit(&self_pid, memory_order_relaxed))
        return &sim_state->proc[idx];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    struct sim_proc *p;
    idx = atomic_load(&self_index);
    if (idx >= 0 && atomic_load(&self_pid) == getpid() &&
        atomic_load(&sim_state->proc[idx].pid) == getpid())
        p = &sim_state->proc[idx];
    else
        p = claim_self();
    pthread_mutex_unlock(&lock);
    return p;
}

static void atfork_child(void) {
    /* The child is a new process: it claims its own record on first use, and lets go of the
     * parent's descriptor, whose lock says the parent lives (it opens its own when needed). */
    atomic_store(&self_index, -1);
    if (state_fd >= 0) {
        close(state_fd);
        state_fd = -1;
    }
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r)
        r = sim_now_ns() ^ ((uint64_t)getpid() << 32);
    self_instance = r | 1;
}

__attribute__((destructor)) static void release_self_at_exit(void) {
    int idx = atomic_load(&self_index);
    if (!sim_state || idx < 0 || atomic_load(&self_pid) != getpid()) return;
    struct sim_proc *p = &sim_state->proc[idx];
    reap_record(p, getpid());
}

/* -- device lists ----------------------------------------------------------------------------- */

struct spec_entry {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];
    uint64_t bytes;
    uint32_t sms;
};

static void copy_field(char *dst, size_t cap, const char *src, size_t len) {
    while (len && isspace((unsigned char)*src)) {
        src++;
        len--;
    }
    while (len && isspace((unsigned char)src[len - 1])) len--;
    if (len >= cap) len = cap - 1;
    memcpy(dst, src, len);
    dst[len] = 0;
}

/* "name|uuid|bytes|sms;…" -> entries; malformed entries are skipped with a message. */
static int parse_spec(const char *text, struct spec_entry *out, int max) {
    int n = 0;
    const char *p = text;
    while (p && *p && n < max) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *f[4];
        size_t fl[4];
        int nf = 0;
        const char *q = p;
        while (nf < 4) {
            const char *bar = memchr(q, '|', (size_t)(p + len - q));
            f[nf] = q;
            fl[nf] = bar ? (size_t)(bar - q) : (size_t)(p + len - q);
            nf++;
            if (!bar) break;
            q = bar + 1;
        }
        if (len > 0) {
            struct spec_entry *e = &out[n];
            memset(e, 0, sizeof *e);
            char num[32];
            if (nf >= 3) {
                copy_field(e->name, sizeof e->name, f[0], fl[0]);
                copy_field(e->uuid, sizeof e->uuid, f[1], fl[1]);
                copy_field(num, sizeof num, f[2], fl[2]);
                e->bytes = strtoull(num, NULL, 10);
                e->sms = 108;
                if (nf == 4) {
                    copy_field(num, sizeof num, f[3], fl[3]);
                    e->sms = (uint32_t)strtoul(num, NULL, 10);
                }
            }
            if (e->name[0] && strncmp(e->uuid, "GPU-", 4) == 0 && e->bytes > 0 && e->sms > 0)
                n++;
            else
                sim_log("ignoring malformed GPUSHARE_SIM_DEVICES entry '%.*s'", (int)len, p);
        }
        p = end ? end + 1 : NULL;
    }
    return n;
}

/* Applies a CUDA/NVIDIA_VISIBLE_DEVICES value to `in` (indices into the spec). Like the real
 * driver, the list stops at the first entry that names no device. */
static int apply_visible(const char *value, int empty_is_all, const int *in, int nin, int *out) {
    if (!value || strcmp(value, "all") == 0 || (value[0] == 0 && empty_is_all)) {
        memcpy(out, in, sizeof(int) * (size_t)nin);
        return nin;
    }
    if (strcmp(value, "none") == 0 || strcmp(value, "void") == 0 || value[0] == 0) return 0;
    int n = 0;
    const char *p = value;
    while (*p && n < nin) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char tok[SIM_UUID_LEN];
        copy_field(tok, sizeof tok, p, len);
        int found = -1;
        if (tok[0] && isdigit((unsigned char)tok[0])) {
            char *rest;
            long v = strtol(tok, &rest, 10);
            if (*rest == 0 && v >= 0 && v < nin) found = in[v];
        } else if (strncmp(tok, "GPU-", 4) == 0 && strlen(tok) > 4) {
            for (int i = 0; i < nin; i++) {
                const char *uuid = sim_state->dev[spec_slots[in[i]]].uuid;
                if (strncmp(uuid, tok, strlen(tok)) == 0) {
                    if (found >= 0) { /* ambiguous prefix */
                        found = -1;
                        break;
                    }
                    found = in[i];
                }
            }
        }
        if (found < 0) break;
        for (int i = 0; i < n; i++)
            if (out[i] == found) found = -1;
        if (found < 0) break;
        out[n++] = found;
        p = end ? end + 1 : p + len;
    }
    return n;
}

int sim_machine_count(void) {
    return machine_count;
}
int sim_machine_slot(int ordinal) {
    return spec_slots[machine_idx[ordinal]];
}
int sim_cuda_count(void) {
    return cuda_count;
}
int sim_cuda_slot(int ordinal) {
    return spec_slots[cuda_idx[ordinal]];
}
struct sim_device *sim_dev(int slot) {
    return &sim_state->dev[slot];
}

int sim_dev_sound(int slot) {
    if (!sim_state || slot < 0 || slot >= SIM_MAX_DEVICES) return 0;
    const struct sim_device *d = &sim_state->dev[slot];
    uint64_t bytes = d->total_bytes;
    uint32_t sms = d->sms;
    return d->name[0] != 0 && memchr(d->name, 0, SIM_NAME_LEN) != NULL &&
           strncmp(d->uuid, "GPU-", 4) == 0 && memchr(d->uuid, 0, SIM_UUID_LEN) != NULL &&
           bytes > 0 && bytes <= SIM_MAX_DEVICE_BYTES && sms > 0 && sms <= SIM_MAX_SMS;
}

/* -- opening the state file ------------------------------------------------------------------- */

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static void default_state_path(char *out, size_t cap, const char *spec) {
    struct stat st;
    const char *dir = (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)) ? "/dev/shm" : "/tmp";
    snprintf(out, cap, "%s/gpushare-sim-%u-%016llx", dir, (unsigned)getuid(),
             (unsigned long long)fnv1a(spec));
}

/* Registers the spec's devices in the (locked) state; fills spec_slots. The state file is
 * writable by every user (as /dev/nvidia* are): a device count out of range is refused (-1),
 * read once per device, so a value changed meanwhile is never used as an index, and so is a
 * device whose record is not sound (sim_dev_sound). */
static int register_devices(struct spec_entry *e, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t count = atomic_load(&sim_state->ndev);
        if (count > SIM_MAX_DEVICES) {
            sim_log("the state file is damaged: it says it holds %u devices (at most %d)", count,
                    SIM_MAX_DEVICES);
            return -1;
        }
        int ndev = (int)count;
        int slot = -1;
        for (int d = 0; d < ndev; d++)
            if (strncmp(sim_state->dev[d].uuid, e[i].uuid, SIM_UUID_LEN) == 0) slot = d;
        if (slot < 0) {
            if (ndev >= SIM_MAX_DEVICES) {
                sim_log("the state file holds %d devices already; ignoring %s", ndev, e[i].uuid);
                continue;
            }
            struct sim_device *d = &sim_state->dev[ndev];
            memcpy(d->name, e[i].name, sizeof d->name);
            memcpy(d->uuid, e[i].uuid, sizeof d->uuid);
            d->total_bytes = e[i].bytes;
            d->sms = e[i].sms;
            d->created_ns = sim_now_ns();
            atomic_store(&d->busy_until, d->created_ns);
            atomic_store_explicit(&sim_state->ndev, (uint32_t)ndev + 1, memory_order_release);
            slot = ndev;
        }
        if (!sim_dev_sound(slot)) {
            sim_log("the state file is damaged: device %d (%s) has a name, UUID, memory size or "
                    "SM count out of bounds",
                    slot, e[i].uuid);
            return -1;
        }
        spec_slots[spec_count++] = slot;
    }
    return 0;
}

/* The state is mapped with a page of zeros after it (anonymous, read-only): a string another
 * user left without its terminating NUL (a device's name or UUID) ends there at the latest,
 * never past the mapping. */
#define SIM_GUARD    4096u
#define SIM_MAP_SIZE (sizeof(struct sim_state) + SIM_GUARD)

static void *map_state(int fd) {
    void *area = mmap(NULL, SIM_MAP_SIZE, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (area == MAP_FAILED) return MAP_FAILED;
    void *map =
        mmap(area, sizeof(struct sim_state), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (map == MAP_FAILED) {
        int saved = errno;
        munmap(area, SIM_MAP_SIZE);
        errno = saved;
    }
    return map;
}

static int state_header_ok(const struct sim_state *s) {
    return s->magic == SIM_MAGIC && s->version == SIM_VERSION && s->size == sizeof *s &&
           s->max_devices == SIM_MAX_DEVICES;
}

/* Opens (creating when needed) and locks the state file; returns the fd, locked, or -1. A file
 * named by GPUSHARE_SIM_STATE is shared by every user's processes (mode 0666, as /dev/nvidia*
 * are); the per-user default one is private. */
static int open_locked(const char *path, int shared) {
    for (int attempt = 0; attempt < 8; attempt++) {
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            if (shared) fchmod(fd, 0666);
        } else if (errno == EEXIST) {
            fd = open(path, O_RDWR | O_CLOEXEC);
            if (fd < 0 && errno == ENOENT)
                continue; /* removed in between (being replaced): try again */
        }
        if (fd < 0) {
            sim_log("cannot open the state file %s: %s", path, strerror(errno));
            return -1;
        }
        while (flock(fd, LOCK_EX) != 0) {
            if (errno != EINTR) {
                sim_log("cannot lock %s: %s", path, strerror(errno));
                close(fd);
                return -1;
            }
        }
        /* The file may have been replaced between open and lock (see the version check). */
        struct stat a, b;
        if (fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino &&
            a.st_dev == b.st_dev)
            return fd;
        close(fd);
    }
    sim_log("the state file %s keeps changing", path);
    return -1;
}

static void do_open(void) {
    const char *spec = getenv("GPUSHARE_SIM_DEVICES");
    if (!spec) spec = "";
    static struct spec_entry entries[SIM_MAX_DEVICES];
    int n = parse_spec(spec, entries, SIM_MAX_DEVICES);
    spec_count = 0;

    char path[4096];
    const char *env_path = getenv("GPUSHARE_SIM_STATE");
    if (env_path && *env_path)
        snprintf(path, sizeof path, "%s", env_path);
    else
        default_state_path(path, sizeof path, spec);

    uint64_t r = 0;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r)
        r = sim_now_ns() ^ ((uint64_t)getpid() << 32);
    self_instance = r | 1;

    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = open_locked(path, env_path && *env_path);
        if (fd < 0) return;
        struct stat st;
        if (fstat(fd, &st) != 0) {
            close(fd);
            return;
        }
        int fresh = st.st_size == 0;
        if (fresh && ftruncate(fd, (off_t)sizeof(struct sim_state)) != 0) {
            sim_log("cannot size %s: %s", path, strerror(errno));
            close(fd);
            return;
        }
        if (!fresh && st.st_size != (off_t)sizeof(struct sim_state)) {
            /* Another version of the simulator made it: start a new file under the same name;
             * processes still using the old one keep their mapping. */
            sim_log("replacing %s (made by another simulator version)", path);
            unlink(path);
            close(fd);
            continue;
        }
        void *map = map_state(fd);
        if (map == MAP_FAILED) {
            sim_log("cannot map %s: %s", path, strerror(errno));
            close(fd);
            return;
        }
        struct sim_state *s = map;
        if (fresh || s->magic == 0) {
            s->version = SIM_VERSION;
            s->max_devices = SIM_MAX_DEVICES;
            s->size = sizeof *s;
            __atomic_store_n(&s->magic, SIM_MAGIC, __ATOMIC_RELEASE);
        } else if (!state_header_ok(s)) {
            sim_log("replacing %s (made by another simulator version)", path);
            munmap(map, SIM_MAP_SIZE);
            unlink(path);
            close(fd);
            continue;
        }
        sim_state = s;
        if (register_devices(entries, n) != 0) { /* a damaged file: every call fails, no crash */
            sim_state = NULL;
            munmap(map, SIM_MAP_SIZE);
            flock(fd, LOCK_UN);
            close(fd);
            return;
        }
        flock(fd, LOCK_UN);
        close(fd);
        /* Record locks go through a descriptor of their own: the mapping keeps the descriptor
         * it was made from referenced (in forked children too), so locks taken through that one
         * would outlive their owner. */
        if (state_fd >= 0) close(state_fd);
        state_fd = open(path, O_RDWR | O_CLOEXEC);
        state_fd_owner = getpid();
        snprintf(state_path, sizeof state_path, "%s", path);

        int all[SIM_MAX_DEVICES];
        for (int i = 0; i < spec_count; i++) all[i] = i;
        machine_count =
            apply_visible(getenv("NVIDIA_VISIBLE_DEVICES"), 1, all, spec_count, machine_idx);
        cuda_count =
            apply_visible(getenv("CUDA_VISIBLE_DEVICES"), 0, machine_idx, machine_count, cuda_idx);
        static int atfork_done;
        if (!atfork_done++) pthread_atfork(NULL, NULL, atfork_child);
        open_result = 0;
        return;
    }
}

static void environment_key(char *out, size_t cap) {
    const char *names[] = {"GPUSHARE_SIM_DEVICES", "GPUSHARE_SIM_STATE", "NVIDIA_VISIBLE_DEVICES",
                           "CUDA_VISIBLE_DEVICES"};
    size_t used = 0;
    out[0] = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *v = getenv(names[i]);
        int n = snprintf(out + used, cap - used, "%s=%s\x1f", names[i], v ? v : "\x1e");
        if (n < 0 || (size_t)n >= cap - used) return;
        used += (size_t)n;
    }
}

int sim_open(int reopen_if_changed) {
    char key[sizeof opened_env];
    environment_key(key, sizeof key);
    pthread_mutex_lock(&open_lock);
    if (open_result != 0 || (reopen_if_changed && strcmp(key, opened_env) != 0)) {
        if (sim_state && atomic_load(&self_index) < 0) {
            munmap(sim_state, SIM_MAP_SIZE);
            sim_state = NULL;
        }
        if (!sim_state) {
            open_result = -1;
            do_open();
            memcpy(opened_env, key, sizeof opened_env);
        }
    }
    int r = open_result;
    pthread_mutex_unlock(&open_lock);
    return r;
}

/* -- scheduling ------------------------------------------------------------------------------- */

uint64_t sim_schedule(int slot, uint64_t dep_ns, uint64_t dur_ns) {
    struct sim_device *d = &sim_state->dev[slot];
    uint64_t now = sim_now_ns();
    /* Counted before the placement: a reader in between sees the kernel as already done for a
     * moment (never as a gap). */
    atomic_fetch_add(&d->busy_total, dur_ns);
    uint64_t until = atomic_load(&d->busy_until);
    uint64_t start, end, latest = now + SIM_MAX_BACKLOG_NS;
    if (dep_ns > latest) dep_ns = now; /* from a damaged time line (see below) */
    do {
        /* A time line further ahead than any work could take it was written by someone else
         * (the state is shared by every user): it starts over from now, so no launch or
         * synchronise waits for it. */
        uint64_t line = until <= latest ? until : now;
        start = now > line ? now : line;
        if (dep_ns > start) start = dep_ns;
        end = start + dur_ns;
    } while (!atomic_compare_exchange_weak(&d->busy_until, &until, end));
    if (until > latest) {
        static atomic_int told;
        if (!atomic_exchange(&told, 1))
            sim_log("device %d's time line was %llu s ahead (a damaged state): it starts over now",
                    slot, (unsigned long long)((until - now) / 1000000000ull));
    }
    atomic_fetch_add_explicit(&d->launches, 1, memory_order_relaxed);
    struct sim_proc *p = sim_self();
    if (p) {
        struct sim_proc_device *pd = &p->dev[slot];
        if (!atomic_load_explicit(&pd->sample_t, memory_order_relaxed)) {
            /* the process's first work here: NVML's per-process utilisation counts from now
             * until a monitor has taken a sample of its own */
            uint64_t busy = atomic_load(&pd->busy), last = atomic_load(&pd->last_end);
            uint64_t pending = last > now ? last - now : 0;
            atomic_store(&pd->sample_busy, busy > pending ? busy - pending : 0);
            atomic_store(&pd->sample_t, now);
        }
        atomic_fetch_add_explicit(&pd->busy, dur_ns, memory_order_relaxed);
        uint64_t last = atomic_load_explicit(&pd->last_end, memory_order_relaxed);
        while (last < end && !atomic_compare_exchange_weak_explicit(&pd->last_end, &last, end,
                                                                    memory_order_relaxed,
                                                                    memory_order_relaxed)) {}
    }
    sim_sample(slot, now);
    return end;
}

/* -- memory ----------------------------------------------------------------------------------- */

static void sub_clamped(a64 *a, uint64_t v) {
    uint64_t cur = atomic_load(a), next;
    do {
        next = cur > v ? cur - v : 0;
    } while (!atomic_compare_exchange_weak(a, &cur, next));
}

uint64_t sim_mem_reserve(int slot, uint64_t bytes) {
    struct sim_device *d = &sim_state->dev[slot];
    struct sim_proc *p = sim_self();
    if (!p) return 0;
    uint64_t total = d->total_bytes;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t used = atomic_load(&d->mem_used);
        /* bounded: another user rewriting mem_used all the time gets an out-of-memory, not a
         * spinning caller */
        for (int tries = 0; tries < 100000 && used + bytes <= total && used + bytes >= used;
             tries++) {
            if (atomic_compare_exchange_weak(&d->mem_used, &used, used + bytes)) {
                atomic_fetch_add(&p->dev[slot].mem, bytes);
                return atomic_load(&self_generation);
            }
        }
        sim_reap(); /* memory of processes that died may come back */
    }
    return 0;
}

void sim_mem_release(int slot, uint64_t bytes, uint64_t generation) {
    struct sim_proc *p = sim_self();
    if (!p || generation != atomic_load(&self_generation))
        return; /* charged to a record that was reaped: already given back */
    sub_clamped(&p->dev[slot].mem, bytes);
    sub_clamped(&sim_state->dev[slot].mem_used, bytes);
}

void sim_context_count(int slot, int delta) {
    struct sim_proc *p = sim_self();
    if (!p) return;
    if (delta >= 0) {
        atomic_fetch_add(&p->dev[slot].contexts, (uint32_t)delta);
        return;
    }
    uint32_t cur = atomic_load(&p->dev[slot].contexts), next;
    do {
        next = cur > (uint32_t)-delta ? cur - (uint32_t)-delta : 0;
    } while (!atomic_compare_exchange_weak(&p->dev[slot].contexts, &cur, next));
}

/* -- utilisation ------------------------------------------------------------------------------ */

uint64_t sim_busy_done(int slot, uint64_t now) {
    struct sim_device *d = &sim_state->dev[slot];
    uint64_t u1, total;
    for (int tries = 0; tries < 1000; tries++) { /* bounded: the state is anybody's to write */
        u1 = atomic_load(&d->busy_until);
        total = atomic_load(&d->busy_total);
        if (atomic_load(&d->busy_until) == u1) break;
    }
    uint64_t future = u1 > now ? u1 - now : 0;
    return total > future ? total - future : 0;
}

void sim_sample(int slot, uint64_t now) {
    struct sim_device *d = &sim_state->dev[slot];
    uint64_t period = now / SIM_SAMPLE_NS;
    struct sim_sample *s = &d->samples[period % SIM_SAMPLES];
    if (atomic_load_explicit(&s->t, memory_order_relaxed) / SIM_SAMPLE_NS == period) {
        /* This period has its sample: keep its view of the schedule up to date (later launches
         * in the period only extend the busy stretch, or open a gap shorter than the period). */
        uint64_t until = atomic_load(&d->busy_until);
        uint64_t cur = atomic_load_explicit(&s->until, memory_order_relaxed);
        while (cur < until && !atomic_compare_exchange_weak(&s->until, &cur, until)) {}
        return;
    }
    uint64_t seq = atomic_load(&s->seq);
    if ((seq & 1) || !atomic_compare_exchange_strong(&s->seq, &seq, seq + 1)) return;
    atomic_store(&s->t, now);
    atomic_store(&s->done, sim_busy_done(slot, now));
    atomic_store(&s->until, atomic_load(&d->busy_until));
    atomic_store(&s->seq, seq + 2);
}

static int read_sample(struct sim_sample *s, uint64_t *t, uint64_t *done, uint64_t *until) {
    for (int tries = 0; tries < 100; tries++) {
        uint64_t a = atomic_load(&s->seq);
        if (a & 1) continue;
        *t = atomic_load(&s->t);
        *done = atomic_load(&s->done);
        *until = atomic_load(&s->until);
        if (atomic_load(&s->seq) == a) return *t != 0 && *t <= sim_now_ns();
    }
    return 0; /* being written all along (or a seq left odd by someone else): no sample */
}

double sim_utilisation(int slot) {
    struct sim_device *d = &sim_state->dev[slot];
    uint64_t now = sim_now_ns();
    sim_sample(slot, now);
    uint64_t done_now = sim_busy_done(slot, now);
    /* The busy time done by `from` (now - window) comes from the newest sample s taken at or
     * before it: launches record a sample whenever their 50 ms period has none and keep the
     * period's sample's `until` current, so after s the device was busy from s.t until
     * min(from, s.until), give or take gaps shorter than a period. Samples taken in the last
     * SIM_SAMPLES periods are never overwritten, so s is lost only when nothing happened for
     * that long; then the window starts at the oldest sample left. */
    uint64_t from = now > SIM_UTIL_WINDOW_NS ? now - SIM_UTIL_WINDOW_NS : 0;
    uint64_t le_t = 0, le_done = 0, le_until = 0; /* newest sample <= from */
    uint64_t gt_t = UINT64_MAX, gt_done = 0;      /* oldest sample > from */
    for (int i = 0; i < SIM_SAMPLES; i++) {
        uint64_t t, done, until;
        if (!read_sample(&d->samples[i], &t, &done, &until)) continue;
        if (t <= from && t > le_t) {
            le_t = t;
            le_done = done;
            le_until = until;
        } else if (t > from && t < gt_t) {
            gt_t = t;
            gt_done = done;
        }
    }
    uint64_t start, done_start;
    if (le_t) {
        uint64_t busy_end = le_until < from ? le_until : from;
        start = from;
        done_start = le_done + (busy_end > le_t ? busy_end - le_t : 0);
    } else if (gt_t != UINT64_MAX && gt_done != 0) {
        start = gt_t;
        done_start = gt_done;
    } else { /* nothing was ever done before the oldest sample (nor before the device existed) */
        start = from;
        done_start = 0;
    }
    if (now < start + SIM_SAMPLE_NS / 5) return atomic_load(&d->busy_until) > now ? 1.0 : 0.0;
    if (done_start > done_now) done_start = done_now;
    double u = (double)(done_now - done_start) / (double)(now - start);
    return u < 0 ? 0 : (u > 1 ? 1 : u);
}
