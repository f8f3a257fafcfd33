/* agent.c - the agent thread of a gpushare process: ends leases (drain.c) when they expire, are
 * revoked or go idle while others wait, extends them when the daemon picked us again, watches
 * the daemon's heartbeat and reconnects (connect.c).
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

#define IDLE_HANDBACK_NS 1000000ull   /* hand back early after 1 ms without launches */
#define RECONNECT_NS     200000000ull /* try the daemon again every 200 ms */
#define LOOK_NS          1000000ull   /* look at a held lease's board at least this often */

void gs_poke_agent(void) {
    if (gs.wake_pipe[1] >= 0) {
        char c = 1;
        ssize_t n = write(gs.wake_pipe[1], &c, 1);
        (void)n;
    }
}
/* -- the agent thread ---------------------------------------------------------------------- */

static void *agent_main(void *arg) {
    (void)arg;
    char buf[4096];
    /* the agent's sleeps (lease ends, drains) end on time: no 50 us timer slack */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    /* named for top -H, nvitop and /proc/<pid>/task/<tid>/comm (tests measure its CPU time) */
    prctl(PR_SET_NAME, (unsigned long)"gpushare-agent", 0UL, 0UL, 0UL);
    for (;;) {
        gs_check_released(); /* a released share: free this process's GPU memory (release.c) */
        uint64_t now = gs_now();
        uint64_t deadline = now + 100000000ull; /* at least every 100 ms */
        if (!atomic_load(&gs.connected) && !atomic_load(&gs.denied) &&
            now - gs.last_connect_try >= RECONNECT_NS) {
            gs.last_connect_try = now;
            if (gs_connect_and_hello() == 0) gs_log("reconnected");
        }
        for (int i = 0; i < gs.ngpus; i++) {
            struct gs_gpu *g = &gs.gpu[i];
            uint64_t lease = atomic_load(&g->joined_lease);
            if (!lease) continue;
            struct gpushare_wire_slot *s = g->slot;
            uint64_t current = atomic_load(&s->lease_until_ns);
            if (now >= lease || current != lease) {
                if (current == lease && gs_try_extend(g, lease) == 0) {
                    deadline = now + 1000000ull; /* look at the new lease right away */
                } else {
                    uint64_t t0 = gs_now();
                    gs_finish_lease(g, lease);
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
                if (now >= idle_at && !gs_streams_busy(g, lease)) {
                    /* idle (no launch, nothing queued) while others wait: hand the lease back */
                    uint64_t expected = lease;
                    atomic_compare_exchange_strong(&s->lease_until_ns, &expected, 0);
                    gs_finish_lease(g, lease);
                    continue;
                }
                if (idle_at < wake) wake = idle_at > now ? idle_at : now + 1000000ull;
            }
            /* look at waiters and revocations every millisecond: a lease revoked early (a
             * preemption) also wakes this thread at once, by a `revoked` line on the socket
             * (wire.py), so the look is only the fallback (older agents send none) */
            if (g->header && wake > now + LOOK_NS) wake = now + LOOK_NS;
            if (wake < deadline) deadline = wake;
        }
        if (atomic_load(&gs.connected)) {
            for (int i = 0; i < gs.ngpus; i++) {
                struct gpushare_wire_header *h = gs.gpu[i].header;
                if (h && now > atomic_load(&h->heartbeat_ns) + GPUSHARE_WIRE_HEARTBEAT_STALE_NS) {
                    gs_disconnect(); /* the daemon hangs: fail static until it answers again */
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
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) gs_disconnect();
        }
        if (n > 0 && p[1].revents) {
            while (read(gs.wake_pipe[0], buf, sizeof buf) > 0) {}
        }
    }
    return NULL;
}

void gs_agent_start(void) {
    if (atomic_exchange(&gs.agent_running, 1)) return;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, agent_main, NULL) != 0) atomic_store(&gs.agent_running, 0);
    pthread_attr_destroy(&attr);
}
