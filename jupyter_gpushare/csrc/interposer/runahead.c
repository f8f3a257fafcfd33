/* runahead.c - how much device time a stream has queued: timing marks recorded before launches,
 * the device time per launch learnt from them, the backlog and the drain estimate (drain.c), and
 * the runahead bound that keeps a preemptible lease's queue short.
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

#define MARK_NS 1000000ull /* runahead marks about this much device time apart */

/* Runahead limit: at most ~2 x gs.runahead_launches launches queued on a stream beyond the last
 * completed mark, so that the drain at a lease's end stays short. */
void gs_runahead_check(struct gs_gpu *g, struct gs_stream *e) {
    if (!e || !real_cuEventRecord || !real_cuEventQuery) return;
    pthread_mutex_lock(&g->streams_lock);
    if (!e->event && real_cuEventCreate) real_cuEventCreate(&e->event, GS_DRAIN_EVENT_FLAGS);
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
        /* busy marks only (pure device time between them), and a first estimate */
        if (q == CUDA_SUCCESS && (m->busy == 1 || (m->busy == 2 && !e->launch_ns)) &&
            e->ref_valid && m->count > e->ref_count && real_cuEventElapsedTime_v2 &&
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
uint64_t gs_drain_eta(struct gs_gpu *g, struct gs_stream *e) {
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
int gs_runahead_bound(struct gs_gpu *g, struct gs_stream *e, uint64_t prior, uint64_t bound,
                      uint64_t lease) {
    if (!e || !e->stream || !real_cuEventRecord || !real_cuEventQuery || !real_cuEventCreate ||
        !real_cuEventSynchronize)
        return 1;
    pthread_mutex_lock(&g->streams_lock);
    e->count += prior;
    if (bound) {
        /* the bound is this process's part of its share's (the daemon divides it between the
         * share's processes): split it between the streams it has used under this lease, so
         * that a process queueing on several streams still queues at most its part in all */
        uint64_t streams = 0;
        for (struct gs_stream *o = g->streams; o; o = o->next)
            if (o->stream && (o->lease == lease || o == e)) streams++;
        if (streams > 1) bound = bound / streams > 0 ? bound / streams : 1;
    }
    int waited = 0;
    for (;;) {
        retire_marks(e);
        /* the oldest mark that leaves at most `bound` queued once the device passed it (no
         * bound: at most 2 x gs.runahead_launches launches, as without marks) */
        CUevent wait = NULL;
        uint64_t most = 2 * (uint64_t)gs.runahead_launches;
        if (e->mlen == GS_MARKS) {
            wait = e->marks[e->mhead].event;
        } else if (!bound) {
            for (unsigned k = 0; k < e->mlen && e->count - e->marks[e->mhead].count > most; k++) {
                struct gs_mark *m = &e->marks[(e->mhead + k) % GS_MARKS];
                wait = m->event;
                if (e->count - m->count <= most) break;
            }
        } else if (!e->launch_ns && e->mlen >= 2) {
            /* bounded, per-launch time not learnt yet: one launch queued behind the running
             * one until a busy mark measures it (a deep queue of long kernels would otherwise
             * run a whole lease's worth of work past its end before the bound applies) */
            wait = e->marks[(e->mhead + e->mlen - 1) % GS_MARKS].event;
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
    /* Work that would run past the lease's end by more than the bound - a kernel longer than
     * the bound queued behind a running one - waits until the stream's queue is done (the lease
     * has ended by then, as a rule: no launch now). Otherwise a lease of kernels longer than the
     * quantum ran two of them, and the share's credit went that far into debt: its leases came
     * in bursts, up to twice its limit in a 1 s window (limit 0.125, 50 ms kernels). While the
     * device time per launch is not known, nothing is queued behind a running launch until the
     * mark after it measures it (a first lease of 50 ms kernels queued three). On an idle stream
     * a launch always goes: a lease runs at least one kernel, however long. */
    int past = 0;
    if (bound && e->launch_ns) {
        uint64_t eta = gs_drain_eta(g, e); /* 0: nothing known queued */
        past = eta && eta + e->launch_ns > lease + bound;
    } else if (bound) {
        past = e->count > (e->ref_valid ? e->ref_count : e->mlen ? e->marks[e->mhead].count : 0);
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
        if (past && real_cuEventQuery(m->event) == CUDA_ERROR_NOT_READY) {
            /* a launch is still running: with no estimate yet, the time from the newest mark
             * (recorded right before it) to this one is that launch's (busy 2: gs.h) */
            if (!m->busy && !e->launch_ns) m->busy = 2;
            CUevent done = m->event; /* behind everything queued: wait outside the lock */
            pthread_mutex_unlock(&g->streams_lock);
            real_cuEventSynchronize(done);
            pthread_mutex_lock(&g->streams_lock);
            if (atomic_load(&g->slot->lease_until_ns) != lease) {
                pthread_mutex_unlock(&g->streams_lock);
                return -1; /* its next admission launches (the mark stays: it counts no launch) */
            }
        }
    }
    e->count += 1; /* the launch being admitted */
    uint64_t per = e->launch_ns;
    pthread_mutex_unlock(&g->streams_lock);
    /* not measured yet (the stream has not been busy): bounded, look at every launch */
    if (!per) return bound ? 1 : gs.runahead_launches;
    /* marks about a quarter of the bound apart, or MARK_NS (the drain estimate's grain) */
    uint64_t n = (bound ? bound / 4 : MARK_NS) / per;
    return n<1 ? 1 : n>(uint64_t) gs.runahead_launches ? gs.runahead_launches : (int)n;
}
