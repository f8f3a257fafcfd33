/* backfill.c - filling the holder's host gaps (wire.py, "Backfill").
 *
 * Leases are exclusive: only the holder's launches go. A holder that waits for its work after
 * every step (a loss.item() per step, a sync after every launch) leaves the device idle while its
 * host works, and without gpushare another process's kernels would have filled those gaps. So:
 *
 * - the holder says, on the board, when its queued work should be done (`queued_until_ns`, an
 *   atomic max over its processes, written at each slow admission while other shares wait): the
 *   end of its stream's known backlog, or now, plus the launches it may make before it looks
 *   again times the device time per launch; unknown per-launch time says "a runahead bound";
 * - a share that waits for a lease, may backfill (the agent's `backfill_cap_ns` in its policy
 *   is above its account's `backfill_ns`: it is below its limit and due) and knows the device
 *   time of its next launch (at most its runahead bound) launches ONE kernel once the holder's
 *   queue should be done and no other share backfills (the board's `backfill_until_ns`, taken
 *   with a compare-and-swap for that kernel's time). The holder's next launch waits behind it,
 *   at most that bound (the holder reads `backfill_until_ns` into its own estimate, so a second
 *   backfill does not start behind the holder's kernel);
 * - the backfill is timed on the device: an event before the launch on the idle stream and one
 *   after it (gs_after_launch); its device time goes to the account's `backfill_ns`, which the
 *   agent charges to the share and takes off the holder's lease. A process's next backfill waits
 *   until the previous one is done and charged.
 *
 * The same timing, on the holder's idle stream, learns the device time of a launch where the
 * runahead marks cannot (they time launches queued behind others: a stream that is synced after
 * every launch never has any).
 */
#include <stdlib.h>

#include "gs.h"

#define LOOK_MIN_NS 20000ull      /* a waiting share looks for a gap at most this often */
#define LOOK_MAX_NS 1000000ull    /* ... and at least this often while it may backfill */
#define SANE_NS     1000000000ull /* a board time further ahead than this is no estimate */

static uint64_t clamp_look(uint64_t ns) {
    return ns < LOOK_MIN_NS ? LOOK_MIN_NS : ns > LOOK_MAX_NS ? LOOK_MAX_NS : ns;
}

/* Reads a timed launch (streams_lock held): learns solo_ns, charges a backfill to the account.
 * Returns 1 while the timed launch is still running. */
static int settle(struct gs_gpu *g, struct gs_stream *e) {
    if (e->tstate == 1) { /* no launch followed the admission (captured, or it failed) */
        e->tstate = 0;
        e->idle_from = 0;
        e->tbackfill = 0;
        return 0;
    }
    if (e->tstate != 2) return 0;
    CUresult q = real_cuEventQuery(e->t1);
    if (q == CUDA_ERROR_NOT_READY) return 1;
    float ms = 0;
    uint64_t ns = 0;
    if (q == CUDA_SUCCESS && real_cuEventElapsedTime_v2 &&
        real_cuEventElapsedTime_v2(&ms, e->t0, e->t1) == CUDA_SUCCESS && ms >= 0)
        ns = (uint64_t)((double)ms * 1e6);
    /* t0 was recorded on our idle stream (its device time is when it was recorded) and the
     * launch queued behind the other share's work, which should be done at t_floor: the launch
     * took from then to t1 (a queue wait in the sample would make the next estimates wait) */
    uint64_t end = e->t0_host + ns, took = 0;
    if (ns && end > e->t_floor) took = end - e->t_floor < ns ? end - e->t_floor : ns;
    if (took) e->solo_ns = e->solo_ns ? (3 * e->solo_ns + took) / 4 : took;
    if (!e->tbackfill && e->prev_lease && ns) e->prev_end = end; /* (the idle clock, below) */
    if (e->tbackfill) { /* (untimed: charged what such a launch takes) */
        struct gpushare_wire_slot *account = atomic_load(&g->account);
        atomic_fetch_add(&account->backfill_ns, took ? took : e->solo_ns);
    }
    e->tstate = 0;
    e->tbackfill = 0;
    return 0;
}

/* Records t0 on e's stream when nothing of ours is queued there (streams_lock held, e's context
 * current): 1 when the next launch is timed. */
static int start_timing(struct gs_stream *e) {
    if (!e->stream) return 0;
    if (!e->t0) real_cuEventCreate(&e->t0, CU_EVENT_DEFAULT);
    if (!e->t1) real_cuEventCreate(&e->t1, CU_EVENT_DEFAULT);
    if (!e->t0 || !e->t1 || real_cuEventRecord(e->t0, e->stream) != CUDA_SUCCESS) return 0;
    if (real_cuEventQuery(e->t0) != CUDA_SUCCESS) return 0; /* work queued: t0 is not its start */
    e->tstate = 1;
    return 1;
}

static int can_time(void) {
    return real_cuEventRecord && real_cuEventQuery && real_cuEventCreate &&
           real_cuEventElapsedTime_v2;
}

/* Whether this process is the only one of its share under `lease` and uses one stream in it:
 * then the device time between its launches is idle unless another share backfilled it. */
static int alone_on_one_stream(struct gs_gpu *g, uint64_t lease) {
    if (atomic_load(&g->slot->joined) != 1) return 0;
    int streams = 0;
    for (struct gs_stream *o = g->streams; o; o = o->next) streams += o->lease == lease;
    return streams == 1;
}

void gs_holder_queue(struct gs_gpu *g, struct gs_stream *e, int budget, uint64_t bound,
                     uint64_t lease) {
    struct gpushare_wire_header *h = g->header;
    struct gpushare_wire_slot *policy = atomic_load(&g->policy);
    if (!e || !h || !can_time()) return;
    pthread_mutex_lock(&g->streams_lock);
    settle(g, e); /* (a backfill of ours that ran before this lease is charged now) */
    /* nobody to fill our gaps (nobody waits, and nobody ever backfilled on this GPU: a share
     * between two backfills is not counted as waiting) and no limit to charge idle time to */
    if (atomic_load(&h->waiting_slots) == 0 && atomic_load(&h->backfills) == 0 &&
        atomic_load(&policy->limit_ppm) >= 1000000u) {
        e->prev_lease = 0;
        pthread_mutex_unlock(&g->streams_lock);
        return;
    }
    uint64_t now = gs_now(), until;
    uint64_t taken = atomic_load(&h->backfill_until_ns); /* our launch waits behind it */
    if (taken < now || taken - now > SANE_NS) taken = now;
    uint64_t per = e->solo_ns ? e->solo_ns : e->launch_ns;
    /* A holder whose launches are longer than its runahead bound (100 ms kernels) has no gap
     * another share could fill with a bounded launch worth the timing, and its few host gaps are
     * a small part of its leases: its leases are charged whole, as before backfill (its idle
     * clock stays off; what others backfill is still taken off). */
    int short_launches = per && bound && per <= bound;
    if (e->tstate == 0 && start_timing(e)) {
        /* Idle clock: the previous launch on this stream was timed and every launch since is
         * this one (budget 1: a sync after every launch, or the bound's one at a time); from its
         * end to now the device ran nothing of this share's, and what another share backfilled
         * then (up to `backfill_until_ns`) is charged to that share: the rest was idle, and a
         * lease is charged its device time, not its length (the agent takes `idle_ns` off). */
        e->idle_from = 0; /* (counted right before the launch: gs_before_launch) */
        if (short_launches && e->prev_end && e->prev_lease == lease && now > e->prev_end &&
            alone_on_one_stream(g, lease)) {
            /* (a backfill queued now, or ended after our last launch: the device ran it up to
             * its end, and the time before it is not counted: at most idle is) */
            uint64_t other = atomic_load(&h->backfill_until_ns);
            if (other - now < SANE_NS && other > now) other = now;
            e->idle_from = other > e->prev_end ? other : e->prev_end;
        }
        e->prev_lease = budget == 1 ? lease : 0;
        e->t0_host = now;
        e->t_floor = taken;
        gs_tl.tail = e;
        gs_tl.tail_gpu = g;
    } else {
        e->prev_lease = 0;
    }
    e->prev_end = 0;
    if (per) {
        uint64_t eta = e->launch_ns ? gs_drain_eta(g, e) : 0; /* 0: nothing known queued */
        uint64_t base = eta > taken ? eta : taken;
        until = base + (uint64_t)(budget > 0 ? budget : 1) * per;
    } else {
        until = now + (bound ? bound : gs.quantum_ns ? gs.quantum_ns : GS_DEFAULT_QUANTUM_NS);
    }
    pthread_mutex_unlock(&g->streams_lock);
    gs_atomic_max64(&g->slot->queued_until_ns, until);
}

/* The entry of `stream` in the current context (no lease noted: a backfill is under none). */
static struct gs_stream *find_stream(struct gs_gpu *g, CUstream stream) {
    CUcontext ctx = NULL;
    if (real_cuCtxGetCurrent) real_cuCtxGetCurrent(&ctx);
    CUstream s = (stream == NULL || stream == CU_STREAM_PER_THREAD) ? CU_STREAM_LEGACY : stream;
    struct gs_stream *e = g->streams;
    while (e && !(e->stream == s && e->ctx == ctx)) e = e->next;
    if (!e && (e = calloc(1, sizeof *e)) != NULL) {
        e->ctx = ctx;
        e->stream = s;
        e->next = g->streams;
        g->streams = e;
    }
    return e;
}

int gs_backfill(struct gs_gpu *g, CUstream stream, uint64_t *look_ns) {
    *look_ns = 0;
    struct gpushare_wire_header *h = g->header;
    if (!h || g->slot_index < 0 || !atomic_load(&gs.connected) || atomic_load(&gs.failstatic) ||
        !can_time())
        return 0;
    struct gpushare_wire_slot *policy = atomic_load(&g->policy);
    struct gpushare_wire_slot *account = atomic_load(&g->account);
    uint64_t cap = atomic_load(&policy->backfill_cap_ns);
    uint64_t used = atomic_load(&account->backfill_ns);
    uint64_t bound = atomic_load(&policy->runahead_ns);
    if (cap <= used || !bound) return 0; /* the agent allows none now (or an older agent) */
    uint32_t holder = atomic_load(&h->holder), mine = (uint32_t)g->slot_index + 1;
    if (holder == 0 || holder > GPUSHARE_WIRE_SLOTS || holder == mine) return 0;
    struct gpushare_wire_slot *held = gpushare_wire_slot_at(h, holder - 1);
    uint64_t now = gs_now();
    uint64_t lease = atomic_load(&held->lease_until_ns);
    if (lease <= now || lease - now > SANE_NS) return 0; /* between leases: the agent grants */
    uint64_t queued = atomic_load(&held->queued_until_ns);
    if (queued == 0 || (queued > now && queued - now > SANE_NS))
        return 0; /* a holder that does not say (an older interposer), or nonsense */
    /* the device's queue as the board says: the holder's work, then another share's backfill */
    uint64_t taken = atomic_load(&h->backfill_until_ns);
    if (taken > queued && taken - now < SANE_NS) queued = taken;
    pthread_mutex_lock(&g->streams_lock);
    struct gs_stream *e = find_stream(g, stream);
    if (!e || settle(g, e)) { /* our last backfill still runs: one at a time */
        uint64_t per = e ? (e->solo_ns ? e->solo_ns : e->launch_ns) : 0;
        pthread_mutex_unlock(&g->streams_lock);
        *look_ns = clamp_look(per);
        return 0;
    }
    uint64_t per = e->solo_ns ? e->solo_ns : e->launch_ns;
    used = atomic_load(&account->backfill_ns);
    /* unknown or too long (the holder would wait more than the bound), or over the allowance */
    if (!per || per > bound || used + per > cap) {
        pthread_mutex_unlock(&g->streams_lock);
        return 0;
    }
    /* Our launch queues behind what is queued (the device runs work in the order it came): it
     * may go once that is at most one of our launches long, and then fills the gap that follows
     * at once - however late this thread woke up, as long as it was before the queue ran out.
     * Not earlier: the holder's next launch would wait for more than one backfill. */
    uint64_t ahead = queued > now ? queued - now : 0;
    if (ahead > per) {
        pthread_mutex_unlock(&g->streams_lock);
        *look_ns = clamp_look(ahead - per);
        return 0;
    }
    if (!start_timing(e)) { /* our own work is still queued there */
        pthread_mutex_unlock(&g->streams_lock);
        *look_ns = clamp_look(per);
        return 0;
    }
    e->t0_host = now;
    e->t_floor = now + ahead;
    e->idle_from = 0;
    if (!atomic_compare_exchange_strong(&h->backfill_until_ns, &taken, e->t_floor + per)) {
        e->tstate = 0; /* another share backfilled first: look at the queue again */
        pthread_mutex_unlock(&g->streams_lock);
        *look_ns = 1000;
        return 0;
    }
    e->tbackfill = 1;
    pthread_mutex_unlock(&g->streams_lock);
    atomic_fetch_add(&h->backfills, 1);
    gs_tl.tail = e;
    gs_tl.tail_gpu = g;
    return 1;
}

void gs_before_launch(void) {
    struct gs_stream *e = gs_tl.tail;
    struct gs_gpu *g = gs_tl.tail_gpu;
    if (!e || !g) return;
    pthread_mutex_lock(&g->streams_lock);
    if (e->tstate == 1 && e->stream) {
        /* t0 again, right before the launch: its device time is the launch's (the admission
         * checked that nothing of ours is queued on the stream) */
        uint64_t now = gs_now();
        if (real_cuEventRecord(e->t0, e->stream) == CUDA_SUCCESS) e->t0_host = now;
        uint64_t q = gs.quantum_ns ? gs.quantum_ns : GS_DEFAULT_QUANTUM_NS;
        if (e->idle_from && e->idle_from < e->t0_host && e->t0_host - e->idle_from < q) {
            struct gpushare_wire_slot *account = atomic_load(&g->account);
            atomic_fetch_add(&account->idle_ns, e->t0_host - e->idle_from);
        }
        e->idle_from = 0;
    }
    pthread_mutex_unlock(&g->streams_lock);
}

void gs_after_launch(CUresult r) {
    struct gs_stream *e = gs_tl.tail;
    struct gs_gpu *g = gs_tl.tail_gpu;
    gs_tl.tail = NULL;
    gs_tl.tail_gpu = NULL;
    if (!e || !g) return;
    pthread_mutex_lock(&g->streams_lock);
    if (e->tstate == 1) {
        if (r == CUDA_SUCCESS && e->stream && real_cuEventRecord(e->t1, e->stream) == CUDA_SUCCESS)
            e->tstate = 2;
        else
            e->tstate = e->tbackfill = 0;
    }
    pthread_mutex_unlock(&g->streams_lock);
}
