/* lease.c - leases of GPU time: admission of launches, waiting, draining, the agent thread, the
 * daemon connection, fail static and fork.
 *
 * A launch may run while this allocation's slot holds the GPU's lease (gs_admit in gs.h: one
 * atomic load, one vDSO clock read). Otherwise gs_admit_slow waits for one: it bumps the slot's
 * `waiters`, tells the daemon (`want`) and sleeps on the slot's `grant_seq` futex. The first
 * thread of a process to launch under a lease "joins" it (slot.joined += 1); the agent thread
 * then wakes when the lease ends (or when the process went idle while others wait), records an
 * event on every stream the process used under the lease, waits for them, publishes the drain end
 * and sends `done`: queued work never spills into the next tenant's lease, and the tenant is
 * charged the whole interval.
 *
 * Handoffs go from process to process (wire.py: direct handoff): the draining agent grants the
 * next holder the daemon published, in shared memory. To keep that short: while the slot uses
 * more than its request of a shared GPU a stream queues at most `runahead_ns` of device time
 * ahead (runahead_bound: a preempted lease drains quickly), and timing marks on every stream
 * tell the agent when its drain should end, so it sleeps until just before and then polls the
 * device (wait_drained): the grant follows the device's end by microseconds, and the next
 * holder's first launch by one futex wake-up.
 *
 * The daemon connection (connect_and_hello): the lease memory arrives as descriptors with the
 * hello reply (SCM_RIGHTS, read with recvmsg; no path crosses the socket): the GPU's lease board
 * (read-write, shared with its other tenants), the policy (read-only: our state, cap, request,
 * limit, runahead bound) and our own memory account; attach() maps each.
 *
 * Fail static: when the daemon is unreachable each process grants itself leases at its request
 * share (quantum on, quantum*(1-r)/r off) and the agent keeps reconnecting. Nothing here ever
 * exits or aborts the process.
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

#define IDLE_HANDBACK_NS   1000000ull   /* hand back early after 1 ms without launches */
#define RECONNECT_NS       200000000ull /* try the daemon again every 200 ms */
#define WAIT_SLICE_NS      50000000ull  /* re-check state at least every 50 ms while waiting */
#define DEFAULT_QUANTUM_NS 20000000ull
#define DRAIN_SPIN_NS                                                                              \
    200000ull                      /* a drain polls from 0.2 ms before its estimated end
                                           to 0.2 ms after it */
#define MARK_NS        1000000ull  /* runahead marks about this much device time apart */
#define WANT_REPEAT_NS 10000000ull /* a waiter repeats `want` at most every 10 ms */
static int runahead_launches = 32; /* launches on a stream between two runahead checks */

static _Atomic int init_state; /* 0 none, 1 running, 2 done */
static _Atomic int agent_running;
static _Atomic int deny_printed;
static uint64_t last_connect_try;

static void agent_start(void);
static int connect_and_hello(void);

void gs_log(const char *fmt, ...) {
    if (!getenv("GPUSHARE_DEBUG")) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "gpushare[%d]: %s\n", (int)getpid(), buf);
}

void gs_deny_message(void) {
    if (atomic_exchange(&deny_printed, 1)) return;
    fprintf(stderr, "gpushare: GPU work refused (CUDA_ERROR_NOT_PERMITTED): %s\n",
            gs.deny_reason[0] ? gs.deny_reason : "this process has no GPU share");
}

static void deny(const char *reason) {
    snprintf(gs.deny_reason, sizeof gs.deny_reason, "%s", reason);
    atomic_store(&gs.denied, 1);
}

/* -- small helpers ------------------------------------------------------------------------- */

static void futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static void atomic_max64(_Atomic uint64_t *p, uint64_t v) {
    uint64_t cur = atomic_load(p);
    while (cur < v && !atomic_compare_exchange_weak(p, &cur, v)) {}
}

static void dec_floor(_Atomic uint32_t *p) {
    uint32_t cur = atomic_load(p);
    while (cur > 0 && !atomic_compare_exchange_weak(p, &cur, cur - 1)) {}
}

static void poke_agent(void) {
    if (gs.wake_pipe[1] >= 0) {
        char c = 1;
        ssize_t n = write(gs.wake_pipe[1], &c, 1);
        (void)n;
    }
}

static void send_line(const char *line) {
    pthread_mutex_lock(&gs.sock_lock);
    if (gs.sock >= 0) {
        size_t len = strlen(line);
        ssize_t n = send(gs.sock, line, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n != (ssize_t)len) gs_log("send failed (%zd): %s", n, strerror(errno));
    }
    pthread_mutex_unlock(&gs.sock_lock);
}

static void send_lease_msg(const char *op, struct gs_gpu *g, uint64_t lease) {
    if (!atomic_load(&gs.connected)) return;
    char line[256];
    snprintf(line, sizeof line, "{\"op\":\"%s\",\"gpu\":\"%s\",\"lease\":%llu}\n", op, g->uuid,
             (unsigned long long)lease);
    send_line(line);
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
    gs.quantum_ns = DEFAULT_QUANTUM_NS;
    runahead_launches = (int)env_u64("GPUSHARE_RUNAHEAD_LAUNCHES", 32);
    if (runahead_launches <= 0) runahead_launches = 1 << 30;
    setup_gpus_from_env();
    if (!sock || !*sock) return; /* not a gpushare process: pass everything through */
    gs.enabled = 1;
    snprintf(gs.socket_path, sizeof gs.socket_path, "%s", sock);
    snprintf(gs.allocation, sizeof gs.allocation, "%s", alloc ? alloc : "");
    if (!alloc || !*alloc) {
        deny("GPUSHARE_ALLOCATION_ID is not set: this process has no GPU share");
        return;
    }
    if (pipe2(gs.wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) gs.wake_pipe[0] = gs.wake_pipe[1] = -1;
    if (connect_and_hello() != 0 && !atomic_load(&gs.denied)) {
        atomic_store(&gs.failstatic, 1);
        gs_log("daemon unreachable at start: running at request share %.3f", gs.request);
    }
    if (!atomic_load(&gs.denied)) agent_start();
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
    while (atomic_load_explicit(&init_state, memory_order_acquire) != 2) sleep_ns(100000);
}

/* A forked child shares the parent's slots (same mappings: one budget per allocation and GPU)
 * but has no agent thread, no joined lease and must not use the parent's socket. */
static void atfork_child(void) {
    if (atomic_load(&init_state) != 2 || !gs.enabled) return;
    pthread_mutex_init(&gs.sock_lock, NULL);
    if (gs.sock >= 0) close(gs.sock);
    gs.sock = -1;
    atomic_store(&gs.connected, 0);
    atomic_store(&agent_running, 0);
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
    last_connect_try = 0;
    if (!atomic_load(&gs.denied)) {
        if (connect_and_hello() != 0 && !atomic_load(&gs.denied)) atomic_store(&gs.failstatic, 1);
        if (!atomic_load(&gs.denied)) agent_start();
    }
}

/* -- the daemon connection ----------------------------------------------------------------- */

/* Finds "key": in json after *pos; returns a pointer to the value or NULL. */
static const char *json_find(const char *json, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    return strstr(json, pat) ? strstr(json, pat) + strlen(pat) : NULL;
}

static int json_string(const char *v, char *out, size_t n) {
    if (!v || *v != '"') return -1;
    v++;
    size_t i = 0;
    while (*v && *v != '"' && i + 1 < n) {
        if (*v == '\\' && v[1]) v++;
        out[i++] = *v++;
    }
    out[i] = 0;
    return 0;
}

static struct gs_gpu *gpu_by_uuid(const char *uuid, int add) {
    for (int i = 0; i < gs.ngpus; i++)
        if (strcmp(gs.gpu[i].uuid, uuid) == 0) return &gs.gpu[i];
    if (!add || gs.ngpus >= GS_MAX_GPUS) return NULL;
    struct gs_gpu *g = &gs.gpu[gs.ngpus++];
    snprintf(g->uuid, sizeof g->uuid, "%s", uuid);
    return g;
}

/* Maps the three files of a GPU (wire.py), received as descriptors with the hello reply (the
 * caller closes them): the lease board read-write, the policy read-only (the agent gave us a
 * read-only descriptor: a writable mapping would fail with EACCES), our account read-write.
 * Uses slot `index`; moves this process's reservations over. */
static void *map_checked(int fd, size_t size, int prot, uint64_t id[2]) {
    struct stat st;
    /* the system call, not glibc's fstat: that symbol is versioned 2.33 (glibc_baseline.h) */
    if (fd < 0 || syscall(SYS_fstat, fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_size < (off_t)size)
        return MAP_FAILED;
    id[0] = (uint64_t)st.st_dev;
    id[1] = (uint64_t)st.st_ino;
    return mmap(NULL, size, prot, MAP_SHARED, fd, 0);
}

static int attach(struct gs_gpu *g, const int fd[3], int index, uint64_t generation) {
    if (index < 0 || index >= GPUSHARE_WIRE_SLOTS) return -1;
    uint64_t id[3][2];
    void *board = map_checked(fd[0], GPUSHARE_WIRE_FILE_SIZE, PROT_READ | PROT_WRITE, id[0]);
    void *policy = map_checked(fd[1], GPUSHARE_WIRE_FILE_SIZE, PROT_READ, id[1]);
    void *account = map_checked(fd[2], GPUSHARE_WIRE_ACCOUNT_SIZE, PROT_READ | PROT_WRITE, id[2]);
    int same = g->header && g->slot_index == index && g->generation == generation &&
               memcmp(id, g->map_id, sizeof id) == 0;
    struct gpushare_wire_header *h = board, *ph = policy;
    struct gpushare_wire_slot *pslots =
        (struct gpushare_wire_slot *)((char *)policy + GPUSHARE_WIRE_HEADER_SIZE);
    int bad =
        board == MAP_FAILED || policy == MAP_FAILED || account == MAP_FAILED || same ||
        h->magic != GPUSHARE_WIRE_MAGIC || h->version != GPUSHARE_WIRE_VERSION ||
        ph->magic != GPUSHARE_WIRE_MAGIC || ph->version != GPUSHARE_WIRE_VERSION ||
        atomic_load(&pslots[index].generation) != generation ||
        strncmp(pslots[index].allocation, gs.allocation, sizeof pslots[index].allocation - 1) != 0;
    if (bad) {
        if (board != MAP_FAILED) munmap(board, GPUSHARE_WIRE_FILE_SIZE);
        if (policy != MAP_FAILED) munmap(policy, GPUSHARE_WIRE_FILE_SIZE);
        if (account != MAP_FAILED) munmap(account, GPUSHARE_WIRE_ACCOUNT_SIZE);
        return same ? 0 : -1; /* same files, same slot (reconnect, or a forked child): as is */
    }
    struct gpushare_wire_slot *slot =
        (struct gpushare_wire_slot *)((char *)board + GPUSHARE_WIRE_HEADER_SIZE +
                                      (size_t)index * GPUSHARE_WIRE_SLOT_SIZE);
    struct gpushare_wire_slot *acct = account;
    uint64_t mine = atomic_load(&g->proc_mem);
    int first = g->slot == &g->local;
    if (mine && (first || memcmp(id[2], g->map_id[2], sizeof id[2]) != 0))
        atomic_fetch_add(&acct->mem_used, mine); /* reserved before we had this account */
    /* old mappings are left in place: threads may still read them */
    memcpy(g->map_id, id, sizeof id);
    g->generation = generation;
    g->slot_index = index;
    g->header = h;
    g->policy_slots = pslots;
    atomic_store_explicit(&g->policy, &pslots[index], memory_order_release);
    atomic_store_explicit(&g->account, acct, memory_order_release);
    atomic_store_explicit(&g->slot, slot, memory_order_release);
    return 0;
}

#define GS_MAX_FDS (3 * GS_MAX_GPUS)

/* Reads one reply line, collecting the descriptors that come with it (SCM_RIGHTS, close-on-exec)
 * into fds[0..*nfds); descriptors beyond `maxfds` are closed. 0 on success; on failure every
 * descriptor received is closed. */
static int read_line_fds(int fd, char *buf, size_t n, int timeout_ms, int *fds, int *nfds,
                         int maxfds) {
    size_t len = 0;
    *nfds = 0;
    while (len + 1 < n) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, timeout_ms) <= 0) break;
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int) * GS_MAX_FDS)];
        } control;
        struct iovec iov = {buf + len, n - 1 - len};
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t k = 0; k < count; k++) {
                int got;
                memcpy(&got, CMSG_DATA(c) + k * sizeof(int), sizeof got);
                if (*nfds < maxfds)
                    fds[(*nfds)++] = got;
                else
                    close(got);
            }
        }
        if (r <= 0) break;
        len += (size_t)r;
        buf[len] = 0;
        if (memchr(buf, '\n', len)) return 0;
    }
    for (int k = 0; k < *nfds; k++) close(fds[k]);
    *nfds = 0;
    return -1;
}

/* Connects, says hello and attaches the slots; 0 on success, -1 when the daemon is unreachable
 * (fail static), -2 when it refused us (denied). */
static int connect_and_hello(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", gs.socket_path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return -1;
    }
    char msg[1024];
    int off =
        snprintf(msg, sizeof msg, "{\"op\":\"hello\",\"v\":%u,\"allocation\":\"%s\",\"pid\":%d",
                 GPUSHARE_WIRE_VERSION, gs.allocation, (int)getpid());
    if (gs.ngpus > 0) {
        off += snprintf(msg + off, sizeof msg - (size_t)off, ",\"gpus\":[");
        for (int i = 0; i < gs.ngpus; i++)
            off += snprintf(msg + off, sizeof msg - (size_t)off, "%s\"%s\"", i ? "," : "",
                            gs.gpu[i].uuid);
        off += snprintf(msg + off, sizeof msg - (size_t)off, "]");
    }
    snprintf(msg + off, sizeof msg - (size_t)off, "}\n");
    static char reply[16384];
    int fds[GS_MAX_FDS], nfds = 0;
    if (send(fd, msg, strlen(msg), MSG_NOSIGNAL) != (ssize_t)strlen(msg) ||
        read_line_fds(fd, reply, sizeof reply, 3000, fds, &nfds, GS_MAX_FDS) != 0) {
        close(fd);
        return -1;
    }
    if (!strstr(reply, "\"ok\":true")) {
        for (int k = 0; k < nfds; k++) close(fds[k]);
        char why[200] = "refused by the gpushare daemon";
        json_string(json_find(reply, "message"), why, sizeof why);
        char reason[256];
        snprintf(reason, sizeof reason, "%s", why);
        deny(reason);
        close(fd);
        return -2;
    }
    const char *q = json_find(reply, "quantum_ns");
    if (q) gs.quantum_ns = strtoull(q, NULL, 10);
    const char *p = strstr(reply, "\"gpus\":");
    int attached = 0;
    while (p && (p = strstr(p, "\"uuid\":")) != NULL) {
        char uuid[64] = "";
        json_string(p + 7, uuid, sizeof uuid);
        const char *b = json_find(p, "board"), *pol = json_find(p, "policy"),
                   *acc = json_find(p, "account"), *i = json_find(p, "slot"),
                   *gen = json_find(p, "generation");
        if (!b || !pol || !acc || !i || !gen) break;
        int k[3] = {atoi(b), atoi(pol), atoi(acc)}, mine[3];
        int ok = 1;
        for (int j = 0; j < 3; j++) {
            ok = ok && k[j] >= 0 && k[j] < nfds;
            mine[j] = ok ? fds[k[j]] : -1;
        }
        struct gs_gpu *g = gpu_by_uuid(uuid, 1);
        if (g && ok && attach(g, mine, atoi(i), strtoull(gen, NULL, 10)) == 0) attached++;
        p = gen;
    }
    for (int k = 0; k < nfds; k++) close(fds[k]); /* mapped (or not wanted) */
    if (!attached) {
        close(fd);
        return -1;
    }
    pthread_mutex_lock(&gs.sock_lock);
    if (gs.sock >= 0) close(gs.sock);
    gs.sock = fd;
    pthread_mutex_unlock(&gs.sock_lock);
    atomic_store(&gs.connected, 1);
    atomic_store(&gs.failstatic, 0);
    gs_log("connected to the daemon (%d GPU%s)", attached, attached == 1 ? "" : "s");
    return 0;
}

static void disconnect(void) {
    pthread_mutex_lock(&gs.sock_lock);
    if (gs.sock >= 0) close(gs.sock);
    gs.sock = -1;
    pthread_mutex_unlock(&gs.sock_lock);
    if (atomic_exchange(&gs.connected, 0)) gs_log("lost the daemon: fail static");
    atomic_store(&gs.failstatic, 1);
    /* wake every waiter so it switches to self-granted leases */
    for (int i = 0; i < gs.ngpus; i++) {
        struct gpushare_wire_slot *s = gs.gpu[i].slot;
        atomic_fetch_add(&s->grant_seq, 1);
        syscall(SYS_futex, (uint32_t *)&s->grant_seq, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    }
}

/* -- streams used under a lease ------------------------------------------------------------ */

static CUstream norm_stream(CUstream s) {
    return (s == NULL || s == CU_STREAM_PER_THREAD) ? CU_STREAM_LEGACY : s;
}

/* Records the stream as used under `lease`; returns its entry. */
static struct gs_stream *note_stream(struct gs_gpu *g, CUstream stream, uint64_t lease) {
    CUcontext ctx = NULL;
    if (real_cuCtxGetCurrent) real_cuCtxGetCurrent(&ctx);
    CUstream s = norm_stream(stream);
    pthread_mutex_lock(&g->streams_lock);
    struct gs_stream *e = g->streams;
    while (e && !(e->stream == s && e->ctx == ctx)) e = e->next;
    if (!e) {
        e = calloc(1, sizeof *e);
        if (e) {
            e->ctx = ctx;
            e->stream = s;
            e->next = g->streams;
            g->streams = e;
        }
    }
    if (e) e->lease = lease;
    if (e && g->start_lease != lease && g->untimed_lease != lease && real_cuEventCreate &&
        real_cuEventRecord) {
        /* the first launch of this process under the lease: mark the device timeline */
        if (g->start_event && g->start_ctx != ctx) {
            if (real_cuEventDestroy_v2) real_cuEventDestroy_v2(g->start_event);
            g->start_event = NULL;
        }
        if (!g->start_event) real_cuEventCreate(&g->start_event, CU_EVENT_DEFAULT);
        g->start_ctx = ctx;
        /* the stream is idle at a lease's first launch: the event's device time is now (the
         * drain's device end is this plus the events' elapsed time) */
        g->join_ns = gs_now();
        g->start_host_ns = 0;
        if (g->start_event && real_cuEventRecord(g->start_event, e->stream) == CUDA_SUCCESS) {
            g->start_lease = lease;
            g->start_host_ns = g->join_ns;
        }
    }
    pthread_mutex_unlock(&g->streams_lock);
    return e;
}

void gs_stream_forget(CUstream stream) {
    for (int i = 0; i < gs.ngpus; i++) {
        struct gs_gpu *g = &gs.gpu[i];
        pthread_mutex_lock(&g->streams_lock);
        for (struct gs_stream **pp = &g->streams; *pp;) {
            struct gs_stream *e = *pp;
            if (e->stream == stream) {
                /* keep waiting for its queued work at the drain: record now, forget the stream */
                if (e->lease && real_cuEventRecord) {
                    if (!e->event && real_cuEventCreate)
                        real_cuEventCreate(&e->event, CU_EVENT_DEFAULT);
                    if (e->event) real_cuEventRecord(e->event, stream);
                }
                e->stream = NULL; /* NULL never matches a normalised stream */
                pp = &e->next;
            } else {
                pp = &e->next;
            }
        }
        pthread_mutex_unlock(&g->streams_lock);
    }
    if (gs_tl.stream == stream) gs_tl.stream = (CUstream)-1;
}

static uint64_t drain_eta(struct gs_gpu *g, struct gs_stream *e);

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Waits for `event` (recorded on e's stream). With an estimate of when the stream's work ends
 * (drain_eta) the agent publishes it (`drain_eta_ns`, for observers), sleeps until shortly
 * before, with a look at the device at least every millisecond, and then polls briefly: the end
 * of a drain is seen within microseconds instead of one more wake-up later, and the next tenant's
 * handoff waits on it. The next holder itself sleeps on its futex until the grant: a poller there
 * would share a CPU with this agent on a small host and delay it. Polls stay short (a thread
 * spinning long on a busy host is preempted); past them it blocks in the driver. */
static void wait_drained(struct gs_gpu *g, struct gs_stream *e, CUevent event) {
    uint64_t eta = drain_eta(g, e);
    if (eta && real_cuEventQuery) {
        atomic_max64(&g->slot->drain_eta_ns, eta);
        uint64_t give_up = eta + DRAIN_SPIN_NS;
        for (;;) {
            if (real_cuEventQuery(event) != CUDA_ERROR_NOT_READY) break;
            uint64_t now = gs_now();
            if (now > give_up) break; /* longer than estimated */
            if (now + DRAIN_SPIN_NS < eta) {
                uint64_t d = eta - DRAIN_SPIN_NS - now;
                sleep_ns(d < 1000000ull ? d : 1000000ull);
            } else {
                for (int i = 0; i < 64; i++) cpu_relax();
            }
        }
    }
    if (real_cuEventSynchronize) real_cuEventSynchronize(event);
}

/* Waits until every stream this process used under `lease` has finished its queued work;
 * returns when the device finished it (CLOCK_MONOTONIC): measured with events against the start
 * event where possible (so the agent's own wake-up latency is not charged), else the wall clock. */
static uint64_t drain(struct gs_gpu *g, uint64_t lease) {
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (real_cuThreadExchangeStreamCaptureMode) real_cuThreadExchangeStreamCaptureMode(&mode);
    pthread_mutex_lock(&g->streams_lock);
    for (struct gs_stream *e = g->streams; e; e = e->next) {
        if (e->lease != lease) continue;
        if (real_cuCtxSetCurrent) real_cuCtxSetCurrent(e->ctx);
        if (!e->event && real_cuEventCreate) real_cuEventCreate(&e->event, CU_EVENT_DEFAULT);
        if (e->stream && e->event && real_cuEventRecord &&
            real_cuEventRecord(e->event, e->stream) != CUDA_SUCCESS && real_cuCtxSynchronize)
            real_cuCtxSynchronize();
    }
    int timed = g->start_lease == lease && g->untimed_lease != lease && g->start_event &&
                real_cuEventElapsedTime_v2;
    float longest_ms = 0;
    for (struct gs_stream *e = g->streams; e; e = e->next) {
        if (e->lease != lease) continue;
        if (e->event && real_cuEventSynchronize) {
            if (real_cuCtxSetCurrent) real_cuCtxSetCurrent(e->ctx);
            wait_drained(g, e, e->event);
            float ms = 0;
            if (timed && e->ctx == g->start_ctx &&
                real_cuEventElapsedTime_v2(&ms, g->start_event, e->event) == CUDA_SUCCESS) {
                if (ms > longest_ms) longest_ms = ms;
            } else {
                timed = 0;
            }
        }
        e->lease = 0;
    }
    /* forget streams destroyed meanwhile */
    for (struct gs_stream **pp = &g->streams; *pp;) {
        struct gs_stream *e = *pp;
        if (!e->stream && !e->lease) {
            *pp = e->next;
            if (e->event && real_cuEventDestroy_v2) real_cuEventDestroy_v2(e->event);
            if (e->probe && real_cuEventDestroy_v2) real_cuEventDestroy_v2(e->probe);
            for (unsigned k = 0; k < GS_MARKS && real_cuEventDestroy_v2; k++)
                if (e->marks[k].event) real_cuEventDestroy_v2(e->marks[k].event);
            if (e->ref_event && real_cuEventDestroy_v2) real_cuEventDestroy_v2(e->ref_event);
            free(e);
        } else {
            pp = &e->next;
        }
    }
    pthread_mutex_unlock(&g->streams_lock);
    if (real_cuThreadExchangeStreamCaptureMode) real_cuThreadExchangeStreamCaptureMode(&mode);
    uint64_t now = gs_now();
    if (timed && g->join_ns) {
        uint64_t end = g->join_ns + (uint64_t)((double)longest_ms * 1e6);
        if (end < now) return end;
    }
    return now;
}

/* Direct handoff (see wire.py): the last process to drain grants the GPU to the holder the
 * daemon picked in advance, without a round trip through the daemon. Returns the slot it handed
 * the GPU to, or -1 (then the daemon decides, as usual). */
static int try_handoff(struct gs_gpu *g) {
    struct gpushare_wire_header *h = g->header;
    struct gpushare_wire_slot *s = g->slot;
    if (!h || g->slot_index < 0 || !atomic_load(&gs.connected)) return -1;
    if (atomic_load(&s->joined) != 1) return -1;
    uint32_t next = atomic_load(&h->next_slot);
    if (next == 0 || next > GPUSHARE_WIRE_SLOTS) return -1;
    /* to ourselves only by extension (try_extend): a new lease in the same slot would overwrite
     * the fields the daemon charges the old one from. We are here instead of extending because
     * we went idle: the best of the others gets it */
    if (next == (uint32_t)g->slot_index + 1) next = atomic_load(&h->next_other);
    if (next == 0 || next > GPUSHARE_WIRE_SLOTS || next == (uint32_t)g->slot_index + 1) return -1;
    struct gpushare_wire_slot *n =
        (struct gpushare_wire_slot *)((char *)h + GPUSHARE_WIRE_HEADER_SIZE +
                                      (size_t)(next - 1) * GPUSHARE_WIRE_SLOT_SIZE);
    if (!g->policy_slots || atomic_load(&g->policy_slots[next - 1].state) != GPUSHARE_SLOT_ACTIVE)
        return -1;
    if (atomic_load(&n->waiters) == 0) return -1;
    uint64_t now = gs_now(), lease_ns = atomic_load(&h->next_lease_ns);
    if (lease_ns == 0 || lease_ns > 1000000000ull) return -1;
    atomic_store(&n->lease_start_ns, now);
    atomic_store(&n->drain_end_ns, now);
    atomic_store(&n->drain_eta_ns, 0);
    atomic_store(&n->first_launch_ns, 0);
    uint32_t mine = (uint32_t)g->slot_index + 1;
    if (!atomic_compare_exchange_strong(&h->holder, &mine, next)) return -1;
    atomic_store(&h->next_slot, 0);
    atomic_store(&h->next_other, 0);
    atomic_store_explicit(&n->lease_until_ns, now + lease_ns, memory_order_release);
    atomic_fetch_add(&n->grant_seq, 1);
    syscall(SYS_futex, (uint32_t *)&n->grant_seq, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    atomic_fetch_add(&h->direct_handoffs, 1);
    return (int)next - 1;
}

/* Whether work this process queued under `lease` is still running: a process that is not
 * launching but still has queued work is not idle. */
static int streams_busy(struct gs_gpu *g, uint64_t lease) {
    int busy = 0;
    pthread_mutex_lock(&g->streams_lock);
    for (struct gs_stream *e = g->streams; e && !busy; e = e->next) {
        if (e->lease != lease || !e->stream || !real_cuEventRecord || !real_cuEventQuery) continue;
        if (real_cuCtxSetCurrent) real_cuCtxSetCurrent(e->ctx);
        if (!e->probe && real_cuEventCreate) real_cuEventCreate(&e->probe, CU_EVENT_DISABLE_TIMING);
        if (e->probe && real_cuEventRecord(e->probe, e->stream) == CUDA_SUCCESS &&
            real_cuEventQuery(e->probe) == CUDA_ERROR_NOT_READY)
            busy = 1;
    }
    pthread_mutex_unlock(&g->streams_lock);
    return busy;
}

/* The agent's end of a lease: drain, publish, hand over (or tell the daemon). */
static void finish_lease(struct gs_gpu *g, uint64_t lease) {
    uint64_t end = drain(g, lease);
    struct gpushare_wire_slot *s = g->slot;
    atomic_max64(&s->drain_end_ns, end);
    int handed = atomic_load(&g->joined_lease) == lease ? try_handoff(g) : -1;
    uint64_t expected = lease;
    if (atomic_compare_exchange_strong(&g->joined_lease, &expected, 0)) dec_floor(&s->joined);
    if (handed >= 0 && atomic_load(&gs.connected)) {
        char line[256];
        snprintf(line, sizeof line,
                 "{\"op\":\"done\",\"gpu\":\"%s\",\"lease\":%llu,\"handoff\":%d}\n", g->uuid,
                 (unsigned long long)lease, handed);
        send_line(line);
    } else {
        send_lease_msg("done", g, lease);
    }
}

/* The daemon picked us again (nobody else may run now): keep the GPU without draining (nothing
 * can spill into another tenant's slice). The old lease is charged up to now, the new one starts
 * now; this process stays joined. Returns 0 when it extended. */
static int try_extend(struct gs_gpu *g, uint64_t lease) {
    struct gpushare_wire_header *h = g->header;
    struct gpushare_wire_slot *s = g->slot;
    if (!h || g->slot_index < 0 || !atomic_load(&gs.connected)) return -1;
    uint32_t mine = (uint32_t)g->slot_index + 1;
    if (atomic_load(&s->lease_until_ns) != lease || atomic_load(&s->joined) != 1 ||
        atomic_load(&h->next_slot) != mine || atomic_load(&h->holder) != mine ||
        atomic_load(&g->policy->state) != GPUSHARE_SLOT_ACTIVE)
        return -1;
    uint64_t now = gs_now(), lease_ns = atomic_load(&h->next_lease_ns);
    if (atomic_load(&g->last_launch_ns) < atomic_load(&s->lease_start_ns) &&
        atomic_load(&s->waiters) == 0)
        return -1; /* no launch during this lease: let it end (the process went idle) */
    if (lease_ns == 0 || lease_ns > 1000000000ull) return -1;
    uint64_t until = now + lease_ns;
    pthread_mutex_lock(&g->streams_lock);
    /* work queued under the old lease runs in the new one, which starts now on the wall clock:
     * a device-side start event would only complete after that work, so charge by the clock */
    g->untimed_lease = until;
    g->join_ns = now;
    for (struct gs_stream *e = g->streams; e; e = e->next)
        if (e->lease == lease) e->lease = until; /* drained at the end of the new lease */
    pthread_mutex_unlock(&g->streams_lock);
    atomic_store(&s->drain_end_ns, now);
    atomic_store(&s->drain_eta_ns, 0);
    atomic_store(&s->first_launch_ns, 0);
    atomic_store(&s->lease_start_ns, now);
    uint64_t expected = lease;
    if (!atomic_compare_exchange_strong(&s->lease_until_ns, &expected, until)) return -1;
    atomic_store(&h->next_slot, 0);
    atomic_store(&h->next_other, 0);
    expected = lease;
    atomic_compare_exchange_strong(&g->joined_lease, &expected, until);
    atomic_fetch_add(&s->grant_seq, 1);
    syscall(SYS_futex, (uint32_t *)&s->grant_seq, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    atomic_fetch_add(&h->direct_handoffs, 1);
    char line[256];
    snprintf(line, sizeof line,
             "{\"op\":\"done\",\"gpu\":\"%s\",\"lease\":%llu,\"handoff\":%d,\"extended\":true}\n",
             g->uuid, (unsigned long long)lease, g->slot_index);
    send_line(line);
    return 0;
}

/* -- admission (slow path) ------------------------------------------------------------------ */

/* Runahead limit: at most ~2 x runahead_launches launches queued on a stream beyond the last
 * completed mark, so that the drain at a lease's end stays short. */
static void runahead_check(struct gs_gpu *g, struct gs_stream *e) {
    if (!e || !real_cuEventRecord || !real_cuEventQuery) return;
    pthread_mutex_lock(&g->streams_lock);
    if (!e->event && real_cuEventCreate) real_cuEventCreate(&e->event, CU_EVENT_DEFAULT);
    if (e->event && e->stream) {
        if (real_cuEventQuery(e->event) == CUDA_ERROR_NOT_READY && real_cuEventSynchronize)
            real_cuEventSynchronize(e->event);
        real_cuEventRecord(e->event, e->stream);
    }
    pthread_mutex_unlock(&g->streams_lock);
}

/* Retires the marks the device passed (streams_lock held) and learns the device time per
 * launch from them. */
static void retire_marks(struct gs_stream *e) {
    while (e->mlen > 0) {
        struct gs_mark *m = &e->marks[e->mhead];
        CUresult q = real_cuEventQuery(m->event);
        if (q == CUDA_ERROR_NOT_READY) break;
        float ms = 0;
        if (q == CUDA_SUCCESS && m->busy && e->ref_valid && m->count > e->ref_count &&
            real_cuEventElapsedTime_v2 &&
            real_cuEventElapsedTime_v2(&ms, e->ref_event, m->event) == CUDA_SUCCESS && ms >= 0) {
            uint64_t per = (uint64_t)((double)ms * 1e6 / (double)(m->count - e->ref_count));
            if (per == 0) per = 1; /* measured: launches that take no device time to speak of */
            e->launch_ns = e->launch_ns ? (3 * e->launch_ns + per) / 4 : per;
        }
        CUevent t = e->ref_event;
        e->ref_event = m->event;
        m->event = t;
        e->ref_count = m->count;
        e->ref_valid = q == CUDA_SUCCESS;
        e->mhead = (e->mhead + 1) % GS_MARKS;
        e->mlen--;
    }
}

/* Device time still queued on a stream by the runahead estimate (streams_lock held); 0 when
 * there is no estimate. */
static uint64_t backlog_ns(struct gs_stream *e) {
    if (!real_cuEventQuery) return 0;
    retire_marks(e);
    if (!e->launch_ns || (!e->ref_valid && e->mlen == 0)) return 0;
    uint64_t base = e->ref_valid ? e->ref_count : e->marks[e->mhead].count;
    /* the first of them is running already: count it half */
    return e->count > base ? (e->count - base) * e->launch_ns - e->launch_ns / 2 : 0;
}

/* When the stream's queued work should be done (CLOCK_MONOTONIC; streams_lock held), 0 when
 * unknown: the newest completed mark's device time (timed against the start event, whose device
 * time is known) plus the launches after it times the device time per launch. */
static uint64_t drain_eta(struct gs_gpu *g, struct gs_stream *e) {
    uint64_t est = backlog_ns(e), now = gs_now(); /* also retires the marks */
    if (!est) return 0;
    float ms = 0;
    if (e->ref_valid && g->start_event && g->start_host_ns && g->start_ctx == e->ctx &&
        real_cuEventElapsedTime_v2 &&
        real_cuEventElapsedTime_v2(&ms, g->start_event, e->ref_event) == CUDA_SUCCESS) {
        int64_t ref_done = (int64_t)g->start_host_ns + (int64_t)((double)ms * 1e6);
        int64_t eta = ref_done + (int64_t)((e->count - e->ref_count) * e->launch_ns);
        if (eta > (int64_t)now) return (uint64_t)eta;
        return now; /* should be done about now */
    }
    return now + est;
}

/* Runahead bound in device time, while this slot runs on time others may claim back (the daemon
 * publishes the slot's `runahead_ns` then): before a launch, wait until the stream's queued work is estimated at most
 * `bound` ns of device time, so that a revoked or expiring lease drains in about that long and
 * a waiting tenant is not held up by a backlog queued long before its turn. Marks (timing events)
 * are recorded before launches; completed marks give the device time per launch (from pairs
 * recorded while the stream was busy: pure device time); the backlog is the launches not known
 * complete times that. Returns the number of launches the caller may make before the next check
 * (about a quarter of the bound), or -1 when the lease ended while it waited (no launch now). */
static int runahead_bound(struct gs_gpu *g, struct gs_stream *e, uint64_t prior, uint64_t bound,
                          uint64_t lease) {
    if (!e || !e->stream || !real_cuEventRecord || !real_cuEventQuery || !real_cuEventCreate ||
        !real_cuEventSynchronize)
        return 1;
    pthread_mutex_lock(&g->streams_lock);
    e->count += prior;
    int waited = 0;
    for (;;) {
        retire_marks(e);
        /* the oldest mark that leaves at most `bound` queued once the device passed it (no
         * bound: at most 2 x runahead_launches launches, as without marks) */
        CUevent wait = NULL;
        uint64_t most = 2 * (uint64_t)runahead_launches;
        if (e->mlen == GS_MARKS) {
            wait = e->marks[e->mhead].event;
        } else if (!bound) {
            for (unsigned k = 0; k < e->mlen && e->count - e->marks[e->mhead].count > most; k++) {
                struct gs_mark *m = &e->marks[(e->mhead + k) % GS_MARKS];
                wait = m->event;
                if (e->count - m->count <= most) break;
            }
        } else if (e->launch_ns && e->mlen > 0 &&
                   (e->count - (e->ref_valid ? e->ref_count : e->marks[e->mhead].count)) *
                           e->launch_ns >
                       bound) {
            for (unsigned k = 0; k < e->mlen; k++) {
                struct gs_mark *m = &e->marks[(e->mhead + k) % GS_MARKS];
                wait = m->event;
                if ((e->count - m->count) * e->launch_ns <= bound) break;
            }
        }
        if (!wait) break;
        pthread_mutex_unlock(&g->streams_lock);
        real_cuEventSynchronize(wait); /* outside the lock: the agent's drain needs it */
        waited = 1;
        pthread_mutex_lock(&g->streams_lock);
    }
    if (waited && atomic_load(&g->slot->lease_until_ns) != lease) {
        pthread_mutex_unlock(&g->streams_lock); /* the lease ended meanwhile: no launch now */
        return -1;
    }
    struct gs_mark *m = &e->marks[(e->mhead + e->mlen) % GS_MARKS];
    if (!m->event) real_cuEventCreate(&m->event, CU_EVENT_DEFAULT);
    if (m->event && real_cuEventRecord(m->event, e->stream) == CUDA_SUCCESS) {
        m->count = e->count;
        m->busy = e->mlen > 0;
        e->mlen++;
    }
    e->count += 1; /* the launch being admitted */
    uint64_t per = e->launch_ns;
    pthread_mutex_unlock(&g->streams_lock);
    /* not measured yet (the stream has not been busy): bounded, look at every launch */
    if (!per) return bound ? 1 : runahead_launches;
    /* marks about a quarter of the bound apart, or MARK_NS (the drain estimate's grain) */
    uint64_t n = (bound ? bound / 4 : MARK_NS) / per;
    return n<1 ? 1 : n>(uint64_t) runahead_launches ? runahead_launches : (int)n;
}

static int join(struct gs_gpu *g, uint64_t lease) {
    uint64_t joined = atomic_load(&g->joined_lease);
    if (joined == lease) return 0;
    if (joined != 0) return -1; /* the previous lease is still draining */
    if (!atomic_compare_exchange_strong(&g->joined_lease, &joined, lease))
        return atomic_load(&g->joined_lease) == lease ? 0 : -1;
    struct gpushare_wire_slot *s = g->slot;
    atomic_fetch_add(&s->joined, 1);
    uint64_t zero = 0;
    g->join_ns = gs_now();
    /* a launch is under way: the agent woken below must not take the process for idle */
    atomic_store_explicit(&g->last_launch_ns, g->join_ns, memory_order_relaxed);
    atomic_compare_exchange_strong(&s->first_launch_ns, &zero, g->join_ns);
    if (atomic_load(&s->lease_until_ns) != lease) { /* revoked meanwhile: undo */
        uint64_t mine = lease;
        if (atomic_compare_exchange_strong(&g->joined_lease, &mine, 0)) dec_floor(&s->joined);
        send_lease_msg("done", g, lease);
        return -1;
    }
    poke_agent();
    return 0;
}

static void failstatic_grant(struct gs_gpu *g, uint64_t now) {
    struct gpushare_wire_slot *s = g->slot;
    double r = atomic_load(&g->policy->request_ppm) / 1e6;
    if (!(r > 0.0)) r = gs.request;
    uint64_t next = atomic_load(&g->fs_next_on);
    if (now < next) {
        uint64_t d = next - now;
        sleep_ns(d < WAIT_SLICE_NS ? d : WAIT_SLICE_NS);
        return;
    }
    uint64_t q = gs.quantum_ns ? gs.quantum_ns : DEFAULT_QUANTUM_NS;
    uint64_t until = now + q;
    uint64_t old = atomic_load(&s->lease_until_ns);
    if (old <= now && atomic_compare_exchange_strong(&s->lease_until_ns, &old, until)) {
        atomic_store(&g->fs_next_on, until + (uint64_t)((double)q * (1.0 - r) / r));
        atomic_store(&s->lease_start_ns, now);
    }
}

CUresult gs_admit_slow(struct gs_gpu *g, CUstream stream) {
    if (!gs.enabled) return CUDA_SUCCESS;
    uint64_t waited_from = 0;
    int spins = 0, waits = 0;
    uint64_t last_want = 0;
    int poked = 0;
    struct gpushare_wire_slot *counted = NULL; /* we are in its `waiters` until we join */
    /* launches this thread made on the fast path since its last slow admission on `stream` */
    uint64_t prior = 0;
    if (gs_tl.gpu == g && gs_tl.stream == stream && gs_tl.given > 1) {
        int left = gs_tl.budget > 0 ? gs_tl.budget : 0;
        prior = gs_tl.given - 1 > left ? (uint64_t)(gs_tl.given - 1 - left) : 0;
    }
    gs_tl.given = 0;
    for (;;) {
        if (atomic_load(&gs.denied)) {
            if (counted) dec_floor(&counted->waiters);
            gs_deny_message();
            return CUDA_ERROR_NOT_PERMITTED;
        }
        struct gpushare_wire_slot *s = atomic_load_explicit(&g->slot, memory_order_acquire);
        struct gpushare_wire_slot *policy = atomic_load_explicit(&g->policy, memory_order_acquire);
        if (atomic_load(&policy->state) == GPUSHARE_SLOT_RELEASED) {
            deny(GS_RELEASED_REASON);
            continue;
        }
        uint32_t seq = atomic_load(&s->grant_seq);
        uint64_t now = gs_now();
        uint64_t until = atomic_load_explicit(&s->lease_until_ns, memory_order_acquire);
        if (now < until && join(g, until) == 0) {
            if (counted) dec_floor(&counted->waiters);
            counted = NULL;
            struct gs_stream *e = note_stream(g, stream, until);
            uint64_t bound = g->header ? atomic_load(&policy->runahead_ns) : 0;
            int budget = runahead_launches;
            if (real_cuEventElapsedTime_v2) {
                budget = runahead_bound(g, e, prior, bound, until);
                prior = 0;
                if (budget < 0) { /* the lease ended while we waited for the backlog */
                    gs_tl.lease = 0;
                    continue;
                }
            } else if (gs_tl.lease == until && gs_tl.stream == stream && gs_tl.gpu == g) {
                runahead_check(g, e);
            }
            gs_tl.lease = until;
            gs_tl.stream = stream;
            gs_tl.gpu = g;
            gs_tl.budget = budget;
            gs_tl.given = budget;
            atomic_store_explicit(&g->last_launch_ns, gs_now(), memory_order_relaxed);
            if (waited_from) {
                struct gpushare_wire_slot *account = atomic_load(&g->account);
                atomic_fetch_add(&account->lease_waits, 1);
                atomic_fetch_add(&account->wait_ns, now - waited_from);
                uint64_t late = now - atomic_load(&s->lease_start_ns);
                if (late > 5000000ull)
                    gs_log("joined %.1f ms after the grant (waited %.1f ms, %d drain spins, "
                           "%d futex waits)",
                           late / 1e6, (now - waited_from) / 1e6, spins, waits);
            }
            return CUDA_SUCCESS;
        }
        if (!waited_from) waited_from = now;
        if (now < until) { /* our previous lease is still being drained by the agent */
            spins++;
            sleep_ns(20000);
            continue;
        }
        if (atomic_load(&gs.failstatic) || !atomic_load(&gs.connected)) {
            failstatic_grant(g, now);
            continue;
        }
        if (!poked && atomic_load(&g->joined_lease) != 0) {
            poked = 1; /* our lease was revoked: the agent drains and hands over now */
            poke_agent();
        }
        if (counted != s) { /* stay counted while woken and until we join (or give up) */
            if (counted) dec_floor(&counted->waiters);
            atomic_fetch_add(&s->waiters, 1);
            counted = s;
        }
        waits++;
        if (!last_want || now - last_want > WANT_REPEAT_NS) {
            send_lease_msg("want", g, 0);
            last_want = now;
        }
        futex_wait(&s->grant_seq, seq, WAIT_SLICE_NS);
        if (gs_now() - now > WAIT_SLICE_NS - 1000000ull)
            gs_log("waited a whole slice (until %llu): seq %u->%u lease %llu joined %llu holder %u "
                   "next %u",
                   (unsigned long long)gs_now(), seq, atomic_load(&s->grant_seq),
                   (unsigned long long)atomic_load(&s->lease_until_ns),
                   (unsigned long long)atomic_load(&g->joined_lease),
                   g->header ? atomic_load(&g->header->holder) : 0,
                   g->header ? atomic_load(&g->header->next_slot) : 0);
    }
}

/* -- the agent thread ---------------------------------------------------------------------- */

static void *agent_main(void *arg) {
    (void)arg;
    char buf[4096];
    /* the agent's sleeps (lease ends, drains) end on time: no 50 us timer slack */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    for (;;) {
        gs_check_released(); /* a released share: free this process's GPU memory (release.c) */
        uint64_t now = gs_now();
        uint64_t deadline = now + 100000000ull; /* at least every 100 ms */
        if (!atomic_load(&gs.connected) && !atomic_load(&gs.denied) &&
            now - last_connect_try >= RECONNECT_NS) {
            last_connect_try = now;
            if (connect_and_hello() == 0) gs_log("reconnected");
        }
        for (int i = 0; i < gs.ngpus; i++) {
            struct gs_gpu *g = &gs.gpu[i];
            uint64_t lease = atomic_load(&g->joined_lease);
            if (!lease) continue;
            struct gpushare_wire_slot *s = g->slot;
            uint64_t current = atomic_load(&s->lease_until_ns);
            if (now >= lease || current != lease) {
                if (current == lease && try_extend(g, lease) == 0) {
                    deadline = now + 1000000ull; /* look at the new lease right away */
                } else {
                    uint64_t t0 = gs_now();
                    finish_lease(g, lease);
                    if (t0 - lease > 5000000ull && t0 > lease)
                        gs_log("lease ended %.1f ms late (%s), drained in %.2f ms",
                               (t0 - lease) / 1e6, current != lease ? "revoked" : "not extended",
                               (gs_now() - t0) / 1e6);
                }
                continue;
            }
            uint64_t wake = lease;
            if (g->header && atomic_load(&g->header->waiting_slots) > 0) {
                uint64_t idle_at = atomic_load(&g->last_launch_ns) + IDLE_HANDBACK_NS;
                if (now >= idle_at && !streams_busy(g, lease)) {
                    /* idle (no launch, nothing queued) while others wait: hand the lease back */
                    uint64_t expected = lease;
                    atomic_compare_exchange_strong(&s->lease_until_ns, &expected, 0);
                    finish_lease(g, lease);
                    continue;
                }
                if (idle_at < wake) wake = idle_at > now ? idle_at : now + 1000000ull;
            }
            /* watch waiters and revocations; closely while preemptible (a bounded queue is
             * drained in a few ms, so a late look would leave the GPU idle) */
            uint64_t watch = atomic_load(&g->policy->runahead_ns) && g->header &&
                                     atomic_load(&g->header->waiting_slots) > 0
                                 ? 250000ull
                                 : 1000000ull;
            if (g->header && wake > now + watch) wake = now + watch;
            if (wake < deadline) deadline = wake;
        }
        if (atomic_load(&gs.connected)) {
            for (int i = 0; i < gs.ngpus; i++) {
                struct gpushare_wire_header *h = gs.gpu[i].header;
                if (h && now > atomic_load(&h->heartbeat_ns) + GPUSHARE_WIRE_HEARTBEAT_STALE_NS) {
                    disconnect(); /* the daemon hangs: fail static until it answers again */
                    break;
                }
            }
        }
        struct pollfd p[2] = {{gs.sock, POLLIN, 0}, {gs.wake_pipe[0], POLLIN, 0}};
        now = gs_now();
        uint64_t wait = deadline > now ? deadline - now : 0;
        struct timespec ts = {(time_t)(wait / 1000000000ull), (long)(wait % 1000000000ull)};
        int n = ppoll(p, 2, &ts, NULL);
        if (n > 0 && p[0].revents) {
            ssize_t r = recv(gs.sock, buf, sizeof buf, MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) disconnect();
        }
        if (n > 0 && p[1].revents) {
            while (read(gs.wake_pipe[0], buf, sizeof buf) > 0) {}
        }
    }
    return NULL;
}

static void agent_start(void) {
    if (atomic_exchange(&agent_running, 1)) return;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, agent_main, NULL) != 0) atomic_store(&agent_running, 0);
    pthread_attr_destroy(&attr);
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
