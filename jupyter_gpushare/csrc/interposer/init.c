/* init.c - a gpushare process's setup: environment, the first connection, fork, logging and the
 * small helpers the lease files share (futex waits, sleeps, floor-decrements).
 *
 * The lease machinery is split by what it does: admit.c (waiting for a lease), runahead.c (how
 * much device time is queued: marks, backlog, drain estimates), drain.c (the end of a lease:
 * drain, direct handoff, extension), agent.c (the agent thread), connect.c (the daemon
 * connection). Nothing here ever exits or aborts the process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "gs.h"

struct gs_global gs;
__thread struct gs_tls gs_tl;

static _Atomic int init_state; /* 0 none, 1 running, 2 done */
static _Atomic int deny_printed;

void gs_log(const char *fmt, ...) {
    if (!getenv("GPUSHARE_DEBUG")) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "gpushare[%d]: %s\n", (int)getpid(), buf);
}

/* GPU calls refused so far (every caller of gs_deny_message); the notebook side reads it after
 * each cell (gpushare_refused_calls) to explain a refusal in the output of the cell it met. */
static _Atomic unsigned long long refused_calls;

__attribute__((visibility("default"))) unsigned long long gpushare_refused_calls(void) {
    return atomic_load_explicit(&refused_calls, memory_order_relaxed);
}

void gs_deny_message(void) {
    atomic_fetch_add_explicit(&refused_calls, 1, memory_order_relaxed);
    if (atomic_exchange(&deny_printed, 1)) return;
    fprintf(stderr, "gpushare: GPU work refused (CUDA_ERROR_NOT_PERMITTED): %s\n",
            gs.deny_reason[0] ? gs.deny_reason : "this process has no GPU share");
}

void gs_deny(const char *reason) {
    snprintf(gs.deny_reason, sizeof gs.deny_reason, "%s", reason);
    atomic_store(&gs.denied, 1);
}

/* -- small helpers ------------------------------------------------------------------------- */

void gs_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

void gs_sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

void gs_atomic_max64(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = atomic_load(p);
    while (cur < v && !atomic_compare_exchange_weak(p, &cur, v)) {}
}

void gs_dec_floor(_Atomic uint32_t *p) {
    uint32_t cur = atomic_load(p);
    while (cur > 0 && !atomic_compare_exchange_weak(p, &cur, cur - 1)) {}
}

/* -- environment and init ------------------------------------------------------------------ */

static uint64_t env_u64(const char *name, uint64_t fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    return end != v ? (uint64_t)x : fallback;
}

static void setup_gpus_from_env(void) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    gs.ngpus = 0;
    if (vis) {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", vis);
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok && gs.ngpus < GS_MAX_GPUS;
             tok = strtok_r(NULL, ",", &save)) {
            while (*tok == ' ') tok++;
            if (strncmp(tok, "GPU-", 4) != 0) continue;
            snprintf(gs.gpu[gs.ngpus].uuid, sizeof gs.gpu[0].uuid, "%s", tok);
            gs.ngpus++;
        }
    }
    const char *req = getenv("GPUSHARE_GPU_REQUEST");
    gs.request = req ? atof(req) : 1.0;
    if (!(gs.request > 0.0) || gs.request > 1.0) gs.request = 1.0;
    uint64_t cap = env_u64("GPUSHARE_GPU_MEMORY", UINT64_MAX);
    for (int i = 0; i < GS_MAX_GPUS; i++) {
        struct gs_gpu *g = &gs.gpu[i];
        memset(&g->local, 0, sizeof g->local);
        atomic_store(&g->local.mem_cap, cap ? cap : UINT64_MAX);
        atomic_store(&g->local.request_ppm, (uint32_t)(gs.request * 1e6));
        atomic_store(&g->local.limit_ppm, 1000000u);
        atomic_store(&g->local.state, GPUSHARE_SLOT_ACTIVE);
        g->slot = &g->local;
        g->policy = &g->local;
        g->account = &g->local;
        g->policy_slots = NULL;
        g->slot_index = -1;
        g->header = NULL;
        pthread_mutex_init(&g->streams_lock, NULL);
    }
}

static void atfork_child(void);

static void do_init(void) {
    const char *sock = getenv("GPUSHARE_SOCKET");
    const char *alloc = getenv("GPUSHARE_ALLOCATION_ID");
    gs.sock = -1;
    gs.wake_pipe[0] = gs.wake_pipe[1] = -1;
    pthread_mutex_init(&gs.sock_lock, NULL);
    gs.quantum_ns = GS_DEFAULT_QUANTUM_NS;
    gs.runahead_launches = (int)env_u64("GPUSHARE_RUNAHEAD_LAUNCHES", 32);
    if (gs.runahead_launches <= 0) gs.runahead_launches = 1 << 30;
    setup_gpus_from_env();
    if (!sock || !*sock) return; /* not a gpushare process: pass everything through */
    gs.enabled = 1;
    snprintf(gs.socket_path, sizeof gs.socket_path, "%s", sock);
    snprintf(gs.allocation, sizeof gs.allocation, "%s", alloc ? alloc : "");
    if (!alloc || !*alloc) {
        gs_deny("GPUSHARE_ALLOCATION_ID is not set: this process has no GPU share");
        return;
    }
    if (pipe2(gs.wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) gs.wake_pipe[0] = gs.wake_pipe[1] = -1;
    if (gs_connect_and_hello() != 0 && !atomic_load(&gs.denied)) {
        atomic_store(&gs.failstatic, 1);
        gs_log("daemon unreachable at start: running at request share %.3f", gs.request);
    }
    if (!atomic_load(&gs.denied)) gs_agent_start();
}

void gs_init(void) {
    if (atomic_load_explicit(&init_state, memory_order_acquire) == 2) return;
    int expected = 0;
    if (atomic_compare_exchange_strong(&init_state, &expected, 1)) {
        static int atfork_done;
        if (!atfork_done) {
            atfork_done = 1;
            pthread_atfork(NULL, NULL, atfork_child);
        }
        gs_resolve();
        do_init();
        atomic_store_explicit(&init_state, 2, memory_order_release);
        return;
    }
    while (atomic_load_explicit(&init_state, memory_order_acquire) != 2) gs_sleep_ns(100000);
}

/* A forked child shares the parent's slots (same mappings: one budget per allocation and GPU)
 * but has no agent thread, no joined lease and must not use the parent's socket. */
static void atfork_child(void) {
    if (atomic_load(&init_state) != 2 || !gs.enabled) return;
    pthread_mutex_init(&gs.sock_lock, NULL);
    if (gs.sock >= 0) close(gs.sock);
    gs.sock = -1;
    atomic_store(&gs.connected, 0);
    atomic_store(&gs.agent_running, 0);
    if (gs.wake_pipe[0] >= 0) close(gs.wake_pipe[0]);
    if (gs.wake_pipe[1] >= 0) close(gs.wake_pipe[1]);
    if (pipe2(gs.wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) gs.wake_pipe[0] = gs.wake_pipe[1] = -1;
    for (int i = 0; i < gs.ngpus; i++) {
        struct gs_gpu *g = &gs.gpu[i];
        pthread_mutex_init(&g->streams_lock, NULL);
        g->streams = NULL; /* the parent's streams are not the child's */
        atomic_store(&g->joined_lease, 0);
        atomic_store(&g->proc_mem, 0);
    }
    memset(&gs_tl, 0, sizeof gs_tl);
    gs_mem_reset_after_fork();
    gs.last_connect_try = 0;
    if (!atomic_load(&gs.denied)) {
        if (gs_connect_and_hello() != 0 && !atomic_load(&gs.denied))
            atomic_store(&gs.failstatic, 1);
        if (!atomic_load(&gs.denied)) gs_agent_start();
    }
}

/* -- which GPU ----------------------------------------------------------------------------- */

struct gs_gpu *gs_gpu_of_ordinal(int ordinal) {
    gs_init();
    if (!gs.enabled || ordinal < 0 || ordinal >= gs.ngpus) return NULL;
    return &gs.gpu[ordinal];
}

struct gs_gpu *gs_current_gpu(void) {
    gs_init();
    if (!gs.enabled) return NULL;
    if (gs.ngpus == 1) return &gs.gpu[0];
    CUdevice dev = 0;
    if (!real_cuCtxGetDevice || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return NULL;
    return gs_gpu_of_ordinal(dev);
}
