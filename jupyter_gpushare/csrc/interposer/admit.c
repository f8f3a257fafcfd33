/* admit.c - waiting for a lease. A launch may run while this allocation's slot holds the GPU's
 * lease (gs_admit in gs.h: one atomic load, one vDSO clock read). Otherwise gs_admit_slow waits for
 * one: it bumps the slot's `waiters`, tells the daemon (`want`) and sleeps on the slot's
 * `grant_seq` futex; the first thread of a process to launch under a lease joins it (join). While
 * the daemon is unreachable (fail static) the share's processes grant it leases at its request
 * share, paced together (failstatic_grant).
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

#define WAIT_SLICE_NS  50000000ull /* re-check state at least every 50 ms while waiting */
#define WANT_REPEAT_NS 10000000ull /* a waiter repeats `want` at most every 10 ms */
#define WANT_QUIET_NS  500000ull   /* no first `want` in the first 0.5 ms of another's lease */
#define FS_SLACK_NS    1000000ull  /* fail static: a turn further than a period + this is stale */

/* A lease another slot got less than WANT_QUIET_NS ago: its holder's thread is waking up to
 * launch (a handoff), and a `want` now would wake the daemon on the same CPUs at that moment.
 * It can wait: the daemon reads `waiters` from the board (counted before this) when it adopts
 * the handoff, and would not preempt so fresh a lease (PREEMPT_MIN_HOLD_NS, gpu_loop.py).
 * Returns when the first `want` may go (0: now). */
static uint64_t want_quiet_until(struct gs_gpu *g, uint64_t now) {
    struct gpushare_wire_header *h = g->header;
    if (!h) return 0;
    uint32_t holder = atomic_load(&h->holder);
    if (holder == 0 || holder > GPUSHARE_WIRE_SLOTS || holder == (uint32_t)g->slot_index + 1)
        return 0;
    struct gpushare_wire_slot *held = gpushare_wire_slot_at(h, holder - 1);
    uint64_t start = atomic_load(&held->lease_start_ns);
    return now >= start && now < start + WANT_QUIET_NS ? start + WANT_QUIET_NS : 0;
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
        if (atomic_compare_exchange_strong(&g->joined_lease, &mine, 0)) gs_dec_floor(&s->joined);
        gs_send_lease_msg("done", g, lease);
        return -1;
    }
    gs_poke_agent();
    return 0;
}

/* Fail static: no agent answers, so the share grants itself a lease of one quantum every
 * (quantum + runahead bound) / request. A lease of q leaves up to the runahead bound the agent
 * last published queued at its end (the policy stays mapped): the device runs up to q + bound
 * per lease (q / r ran a saturating tenant at twice its request). No bound (a lone tenant
 * without a limit): q / r, as nobody is to be kept out.
 *
 * The pacing is the share's, not the process's: when the share's next self-granted lease may
 * start is `fs_next_ns` in its account (one per allocation and GPU, shared by all its processes
 * and by nobody else), and a process takes a turn by moving it with a compare-and-swap, so
 * whichever process grants the next lease sees the others' (paced per process, a kernel and two
 * subprocesses of a 0.25 share took 0.62 of the GPU from a neighbour while the agent was down).
 * The lease is the share's slot on the board: every process of the share joins it, so the
 * others wait on the slot's futex for the grant (or for their turn) instead of sleeping.
 * `s`: the share's slot, `seq`: its grant_seq as the caller read it before it found no lease. */
static void failstatic_grant(struct gs_gpu *g, struct gpushare_wire_slot *s, uint32_t seq) {
    struct gpushare_wire_slot *account = atomic_load(&g->account);
    struct gpushare_wire_slot *policy = atomic_load(&g->policy);
    double r = atomic_load(&policy->request_ppm) / 1e6;
    if (!(r > 0.0)) r = gs.request;
    uint64_t q = gs.quantum_ns ? gs.quantum_ns : GS_DEFAULT_QUANTUM_NS;
    uint64_t bound = atomic_load(&policy->runahead_ns);
    uint64_t period = (uint64_t)((double)(q + bound) / r);
    uint64_t next = atomic_load(&account->fs_next_ns);
    uint64_t now = gs_now(); /* after the load: a turn taken before it is at most `period` on */
    /* (a turn further away was set under another request: take it now) */
    if (now < next && next - now <= period + FS_SLACK_NS) {
        uint64_t d = next - now;
        gs_futex_wait(&s->grant_seq, seq, d < WAIT_SLICE_NS ? d : WAIT_SLICE_NS);
        return;
    }
    uint64_t old = atomic_load(&s->lease_until_ns);
    if (old > now) return; /* the share holds a lease: the caller joins it */
    /* our turn; a process that loses the swap finds the lease granted (or waits for it) */
    if (!atomic_compare_exchange_strong(&account->fs_next_ns, &next, now + period)) return;
    if (atomic_compare_exchange_strong(&s->lease_until_ns, &old, now + q)) {
        atomic_store(&s->lease_start_ns, now);
        atomic_fetch_add(&s->grant_seq, 1); /* wake the share's other waiters to join it */
        syscall(SYS_futex, (uint32_t *)&s->grant_seq, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
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
            if (counted) gs_dec_floor(&counted->waiters);
            gs_deny_message();
            return CUDA_ERROR_NOT_PERMITTED;
        }
        struct gpushare_wire_slot *s = atomic_load_explicit(&g->slot, memory_order_acquire);
        struct gpushare_wire_slot *policy = atomic_load_explicit(&g->policy, memory_order_acquire);
        if (atomic_load(&policy->state) == GPUSHARE_SLOT_RELEASED) {
            gs_deny(GS_RELEASED_REASON);
            continue;
        }
        uint32_t seq = atomic_load(&s->grant_seq);
        uint64_t now = gs_now();
        uint64_t until = atomic_load_explicit(&s->lease_until_ns, memory_order_acquire);
        if (now < until && join(g, until) == 0) {
            if (counted) gs_dec_floor(&counted->waiters);
            counted = NULL;
            struct gs_stream *e = gs_note_stream(g, stream, until);
            uint64_t bound = g->header ? atomic_load(&policy->runahead_ns) : 0;
            int budget = gs.runahead_launches;
            if (real_cuEventElapsedTime_v2) {
                budget = gs_runahead_bound(g, e, prior, bound, until);
                prior = 0;
                if (budget < 0) { /* the lease ended while we waited for the backlog */
                    gs_tl.lease = 0;
                    continue;
                }
            } else if (gs_tl.lease == until && gs_tl.stream == stream && gs_tl.gpu == g) {
                gs_runahead_check(g, e);
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
            gs_sleep_ns(20000);
            continue;
        }
        if (atomic_load(&gs.failstatic) || !atomic_load(&gs.connected)) {
            failstatic_grant(g, s, seq);
            continue;
        }
        if (!poked && atomic_load(&g->joined_lease) != 0) {
            poked = 1; /* our lease was revoked: the agent drains and hands over now */
            gs_poke_agent();
        }
        if (counted != s) { /* stay counted while woken and until we join (or give up) */
            if (counted) gs_dec_floor(&counted->waiters);
            atomic_fetch_add(&s->waiters, 1);
            counted = s;
        }
        waits++;
        uint64_t quiet = want_quiet_until(g, now);
        if (!quiet && (!last_want || now - last_want > WANT_REPEAT_NS)) {
            gs_send_lease_msg("want", g, 0);
            last_want = now;
        }
        gs_futex_wait(&s->grant_seq, seq, quiet ? quiet - now : WAIT_SLICE_NS);
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
