/* connect.c - the daemon connection (gs_connect_and_hello): the lease memory arrives as
 * descriptors with the hello reply (SCM_RIGHTS, read with recvmsg; no path crosses the socket):
 * the GPU's lease board (read-write, shared with its other tenants), the policy (read-only: our
 * state, cap, request, limit, runahead bound) and our own memory account; attach() maps each.
 *
 * Fail static: when the daemon is unreachable each process grants itself leases at its request
 * share (quantum on, quantum*(1-r)/r off; admit.c) and the agent keeps reconnecting.
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

void gs_send_line(const char *line) {
    pthread_mutex_lock(&gs.sock_lock);
    if (gs.sock >= 0) {
        size_t len = strlen(line);
        ssize_t n = send(gs.sock, line, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n != (ssize_t)len) gs_log("send failed (%zd): %s", n, strerror(errno));
    }
    pthread_mutex_unlock(&gs.sock_lock);
}

void gs_send_lease_msg(const char *op, struct gs_gpu *g, uint64_t lease) {
    if (!atomic_load(&gs.connected)) return;
    char line[256];
    snprintf(line, sizeof line, "{\"op\":\"%s\",\"gpu\":\"%s\",\"lease\":%llu}\n", op, g->uuid,
             (unsigned long long)lease);
    gs_send_line(line);
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
    struct gpushare_wire_slot *pslots = gpushare_wire_slot_at(policy, 0);
    int bad =
        board == MAP_FAILED || policy == MAP_FAILED || account == MAP_FAILED || same ||
        h->magic != GPUSHARE_WIRE_MAGIC || h->version != GPUSHARE_WIRE_LAYOUT_VERSION ||
        ph->magic != GPUSHARE_WIRE_MAGIC || ph->version != GPUSHARE_WIRE_LAYOUT_VERSION ||
        atomic_load(&pslots[index].generation) != generation ||
        strncmp(pslots[index].allocation, gs.allocation, sizeof pslots[index].allocation - 1) != 0;
    if (bad) {
        if (board != MAP_FAILED) munmap(board, GPUSHARE_WIRE_FILE_SIZE);
        if (policy != MAP_FAILED) munmap(policy, GPUSHARE_WIRE_FILE_SIZE);
        if (account != MAP_FAILED) munmap(account, GPUSHARE_WIRE_ACCOUNT_SIZE);
        return same ? 0 : -1; /* same files, same slot (reconnect, or a forked child): as is */
    }
    struct gpushare_wire_slot *slot = gpushare_wire_slot_at(board, (size_t)index);
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

/* How long dialing the agent may take: GPUSHARE_CONNECT_TIMEOUT_MS (1 to 600000; default 2000).
 * A connect() on a unix stream socket whose listen backlog is full (an agent that is stuck, or
 * flooded with connections) blocks until the agent accepts, and with it a user's cuInit or first
 * launch would hang for good. A non-blocking connect + poll does not bound it on AF_UNIX: there the
 * connect fails at once with EAGAIN when the backlog is full (no EINPROGRESS to poll for). The
 * kernel's unix connect waits at most the socket's send timeout (SO_SNDTIMEO), so that bounds it;
 * the socket stays in blocking mode, as the callers expect, and the send timeout stays set: it
 * bounds the blocking send of the request too (gs_send_line sends with MSG_DONTWAIT anyway). */
#define GS_CONNECT_TIMEOUT_MS 2000u

static unsigned connect_timeout_ms(void) {
    const char *v = getenv("GPUSHARE_CONNECT_TIMEOUT_MS");
    char *end;
    unsigned long ms = v && *v ? strtoul(v, &end, 10) : 0;
    if (!v || !*v || *end || ms < 1 || ms > 600000) return GS_CONNECT_TIMEOUT_MS;
    return (unsigned)ms;
}

/* A new connection to the agent's socket, or -1 (unreachable, or it did not accept in time). */
static int dial_agent(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", gs.socket_path);
    unsigned timeout = connect_timeout_ms();
    uint64_t deadline = gs_now() + (uint64_t)timeout * 1000000ull;
    for (;;) {
        uint64_t now = gs_now(), left = deadline > now ? deadline - now : 0;
        struct timeval tv = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull / 1000)};
        if (left == 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) ||
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
            break;
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) return fd;
        if (errno != EINTR) break; /* EINTR: a signal handler ran; try again for the rest */
    }
    if (errno == EAGAIN || errno == EINPROGRESS || errno == EINTR)
        gs_log("the agent on %s did not accept within %u ms (GPUSHARE_CONNECT_TIMEOUT_MS)",
               gs.socket_path, timeout);
    close(fd);
    return -1;
}

/* Connects, says hello at control version `v` (v_min GPUSHARE_WIRE_OLDEST_VERSION) and attaches
 * the slots; 0 on success, -1 when the daemon is unreachable (fail static), -2 when it refused us
 * (denied), -3 when it refused the version (an agent older than this interposer). */
static int hello_at(unsigned v) {
    int fd = dial_agent();
    if (fd < 0) return -1;
    char msg[1024];
    int off = snprintf(msg, sizeof msg,
                       "{\"op\":\"hello\",\"v\":%u,\"v_min\":%u,\"allocation\":\"%s\",\"pid\":%d",
                       v, GPUSHARE_WIRE_OLDEST_VERSION, gs.allocation, (int)getpid());
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
        if (v != GPUSHARE_WIRE_OLDEST_VERSION && strstr(reply, "\"error\":\"bad_version\"") &&
            !json_find(reply, "current")) {
            close(fd); /* an agent that predates v_min: say hello again at our oldest */
            return -3;
        }
        char why[200] = "refused by the gpushare daemon";
        json_string(json_find(reply, "message"), why, sizeof why);
        char reason[256];
        snprintf(reason, sizeof reason, "%s", why);
        gs_deny(reason);
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
    gs_log("connected to the daemon (%d GPU%s, wire version %u)", attached,
           attached == 1 ? "" : "s", v);
    return 0;
}

/* Says hello at this interposer's control version, and at its oldest one when the agent is
 * older and refused the version (a rollout that has not reached this node yet; wire.py). */
int gs_connect_and_hello(void) {
    int rc = hello_at(GPUSHARE_WIRE_VERSION);
    return rc == -3 ? hello_at(GPUSHARE_WIRE_OLDEST_VERSION) : rc;
}

/* The agent's `pids` request (wire.py), on a connection of its own (the agent thread owns the
 * hello connection and reads what comes on it): the pids of the processes connected for our
 * allocation as the agent sees them - the host's in a kernel pod - into pids[0..max), and in
 * *self this process's pid as the agent sees it. Returns how many, or -1 when the agent did not
 * answer them (unreachable, or an older agent without the request). */
int gs_agent_pids(unsigned *pids, int max, unsigned *self) {
    char msg[160], reply[8192];
    int n = snprintf(msg, sizeof msg, "{\"op\":\"pids\",\"allocation\":\"%s\"}\n", gs.allocation);
    if (n <= 0 || (size_t)n >= sizeof msg) return -1;
    int fd = dial_agent();
    if (fd < 0) return -1;
    int none[1], nfds = 0, count = -1;
    if (send(fd, msg, (size_t)n, MSG_NOSIGNAL) == n &&
        read_line_fds(fd, reply, sizeof reply, 1000, none, &nfds, 0) == 0 &&
        strstr(reply, "\"ok\":true")) {
        const char *p = json_find(reply, "pids"), *me = json_find(reply, "pid");
        if (p && *p == '[' && me) {
            *self = (unsigned)strtoul(me, NULL, 10);
            count = 0;
            for (p++; *p && *p != ']';) {
                char *end;
                unsigned long v = strtoul(p, &end, 10);
                if (end == p) break;
                if (count < max && v > 0 && v <= 0x7fffffffUL) pids[count++] = (unsigned)v;
                p = *end == ',' ? end + 1 : end;
            }
        }
    }
    close(fd);
    return count;
}

void gs_disconnect(void) {
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
