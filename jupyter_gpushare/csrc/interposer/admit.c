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

#define WAIT_SLICE_NS   50000000ull   /* re-check state at least every 50 ms while waiting */
#define WANT_REPEAT_NS  10000000ull   /* a waiter repeats `want` at most every 10 ms */
#define WANT_QUIET_NS   500000ull     /* no first `want` in the first 0.5 ms of another's lease */
#define FS_LOOK_NS      1000000ull    /* fail static: look at another share's drain this often */
#define FS_STUCK_NS     500000000ull  /* ... and stop waiting for it this long after its lease */
#define FS_LEASE_MAX_NS 1000000000ull /* no lease is longer (drain.c's sanity bound) */

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

/* Fail static, between shares: the GPU is taken by moving the board's `holder` to our slot, and
 * only from a holder whose lease is over and whose processes drained it (`joined` back to 0;
 * one stuck there, a process that died holding it, is passed over FS_STUCK_NS after its lease
 * ended). Returns 0 when the GPU is ours, else how long to wait before looking again. Leases
 * the shares granted themselves overlapped on the device, which then ran whoever queued most:
 * a share of three processes left a 0.5 neighbour 0.30. Not connected yet: no board, no
 * neighbours to see. */
static uint64_t failstatic_take_gpu(struct gs_gpu *g, uint64_t now) {
    struct gpushare_wire_header *h = g->header;
    if (!h || g->slot_index < 0) return 0;
    uint32_t mine = (uint32_t)g->slot_index + 1, holder = atomic_load(&h->holder);
    if (holder != mine && holder != 0 && holder <= GPUSHARE_WIRE_SLOTS) {
        struct gpushare_wire_slot *o = gpushare_wire_slot_at(h, holder - 1);
        uint64_t until = atomic_load(&o->lease_until_ns);
        if (!until) until = atomic_load(&o->lease_start_ns); /* handed back early */
        if (until > now && until - now <= FS_LEASE_MAX_NS)   /* (a longer one is no lease) */
            return until - now < FS_LOOK_NS ? until - now : FS_LOOK_NS;
        if (until <= now && now - until < FS_STUCK_NS && atomic_load(&o->joined) > 0)
            return FS_LOOK_NS;
    }
    /* (lost the swap to another share: look again in a microsecond) */
    return holder == mine || atomic_compare_exchange_strong(&h->holder, &holder, mine) ? 0 : 1000;
}

/* Fail static: no agent answers, so the share grants itself leases of one quantum and charges
 * each the device time it took, as the agent would: from its start to the end of its drain
 * (`drain_end_ns`, stored by every process that drained it), once all its processes drained it
 * (`joined` back to 0), and at least a quantum plus the runahead bound. The next lease is due
 * that time / request after the last one was due. (That estimate alone let a share whose
 * processes each queued work on several streams run at 1.5 times its request, and a share of
 * 50 ms kernels at 1.7 times.)
 *
 * The pacing is the share's, not the process's: `fs_next_ns` in its account (one per
 * allocation and GPU, shared by all its processes and by nobody else) is when its last lease
 * was due; the process that takes the next turn moves it with a compare-and-swap, so whichever
 * process grants the next lease sees the others' (paced per process, a kernel and two
 * subprocesses of a 0.25 share took 0.62 of the GPU from a neighbour while the agent was down).
 * A turn taken late, because another share held the GPU, keeps the cadence (up to two periods
 * late; later, the share starts anew). The lease is the share's slot on the board: every
 * process of the share joins it, so the others wait on the slot's futex for the grant (or for
 * their turn) instead of sleeping.
 * `s`: the share's slot, `seq`: its grant_seq as the caller read it before it found no lease. */
static void failstatic_grant(struct gs_gpu *g, struct gpushare_wire_slot *s, uint32_t seq) {
    struct gpushare_wire_slot *account = atomic_load(&g->account);
    struct gpushare_wire_slot *policy = atomic_load(&g->policy);
    double r = atomic_load(&policy->request_ppm) / 1e6;
    if (!(r > 0.0)) r = gs.request;
    uint64_t q = gs.quantum_ns ? gs.quantum_ns : GS_DEFAULT_QUANTUM_NS;
    uint64_t last = atomic_load(&account->fs_next_ns); /* when our last lease was due (0: none) */
    uint64_t now = gs_now();
    uint64_t until = atomic_load(&s->lease_until_ns), start = atomic_load(&s->lease_start_ns);
    if (until > now) return; /* the share holds a lease: the caller joins it */
    uint64_t ended = until > start ? until : start; /* (0: handed back early) */
    if (last && atomic_load(&s->joined) > 0 && now < ended + FS_STUCK_NS) {
        gs_futex_wait(&s->grant_seq, seq, FS_LOOK_NS); /* its processes still drain it */
        return;
    }
    /* (a drain is over FS_STUCK_NS after the lease at the latest, see above) */
    uint64_t end = atomic_load(&s->drain_end_ns), used = end > start ? end - start : 0;
    if (used > ended - start + FS_STUCK_NS) used = ended - start + FS_STUCK_NS;
    /* A lease that ended with work queued (its drain ran more than a quarter quantum past its
     * end) is charged at least what such a lease may run, a quantum and the runahead bound: the
     * drain end alone missed a kernel launched as the lease ended (a lone 0.7 share of 10 ms
     * kernels in a deep queue ran at 0.96). One that ended with nothing queued (a sync after
     * every launch; charged the floor: 0.14 at request 0.3) or was handed back early
     * (`lease_until_ns` 0: the agent thread saw the process idle while the dead agent's board
     * said others wait; charged a whole lease: 0.01) is charged what it ran. */
    uint64_t least = q + atomic_load(&policy->runahead_ns);
    if (last && until && end > until + q / 4 && used < least) used = least;
    uint64_t pace = (uint64_t)((double)used / r), pause = (uint64_t)((double)q / r);
    if (pause < pace) pause = pace;
    pause *= 2; /* a turn this late keeps the cadence (other shares' leases came first) */
    uint64_t due = last ? last + (pace ? pace : 1) : now;
    if (due > now && due - now <= pace) { /* (a turn further away is no turn of ours) */
        uint64_t d = due - now;
        gs_futex_wait(&s->grant_seq, seq, d < WAIT_SLICE_NS ? d : WAIT_SLICE_NS);
        return;
    }
    if (due > now || now - due > pause) due = now;
    uint64_t busy = failstatic_take_gpu(g, now);
    if (busy) { /* another share's lease runs or drains */
        gs_futex_wait(&s->grant_seq, seq, busy);
        return;
    }
    /* our turn; a process that loses the swap finds the lease granted (or waits for it) */
    if (!atomic_compare_exchange_strong(&account->fs_next_ns, &last, due)) return;
    if (atomic_compare_exchange_strong(&s->lease_until_ns, &until, now + q)) {
        /* nobody drains it before it ends (then these are read) */
        atomic_store(&s->lease_start_ns, now);
        atomic_store(&s->drain_end_ns, now);
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
            gs_holder_queue(g, e, budget, bound, until); /* when our queue is done (backfill.c) */
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
        uint64_t look = 0; /* another share holds the GPU: fill its host gap? (backfill.c) */
        if (gs_backfill(g, stream, &look)) {
            if (counted) gs_dec_floor(&counted->waiters);
            gs_tl.lease = 0; /* the next launch comes back here (budget 0) */
            gs_tl.stream = stream;
            gs_tl.gpu = g;
            gs_tl.budget = 0;
            gs_tl.given = 0;
            return CUDA_SUCCESS;
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
        uint64_t nap = quiet ? quiet - now : WAIT_SLICE_NS;
        gs_futex_wait(&s->grant_seq, seq, look && look < nap ? look : nap);
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
