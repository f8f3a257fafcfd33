/* drain.c - the end of a lease. The first thread of a process to launch under a lease "joins" it
 * (slot.joined += 1, admit.c); the agent thread then wakes when the lease ends (or when the
 * process went idle while others wait), records an event on every stream the process used under
 * the lease, waits for them, publishes the drain end and sends `done`: queued work never spills
 * into the next tenant's lease, and the tenant is charged the whole interval.
 *
 * Handoffs go from process to process (wire.md: direct handoff): the draining agent grants the
 * next holder the daemon published, in shared memory. To keep that short: while the slot uses
 * more than its request of a shared GPU a stream queues at most `runahead_ns` of device time
 * ahead (runahead.c: a preempted lease drains quickly), and the agent sleeps until the device
 * finished (a blocking-sync event, wait_drained): the grant follows the device's end by one
 * wake-up of the agent, and the next holder's first launch by one futex wake-up - the host's own
 * floor (benchmarks/enforcement.py --only handoff measures both side by side).
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

/* after a direct handoff, `done` waits for the next holder's first launch, at most this long */
#define HANDOFF_QUIET_NS      1000000ull
#define HANDOFF_QUIET_STEP_NS 50000ull

/* -- streams used under a lease ------------------------------------------------------------ */

static CUstream norm_stream(CUstream s) {
    return (s == NULL || s == CU_STREAM_PER_THREAD) ? CU_STREAM_LEGACY : s;
}

/* Records the stream as used under `lease`; returns its entry. */
struct gs_stream *gs_note_stream(struct gs_gpu *g, CUstream stream, uint64_t lease) {
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
                        real_cuEventCreate(&e->event, GS_DRAIN_EVENT_FLAGS);
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

/* Waits for `event` (recorded on e's stream), publishing when the agent expects it
 * (`drain_eta_ns`, for observers; runahead.c estimates it from the stream's timing marks).
 *
 * It sleeps in the driver until the device signals the event (a blocking-sync event: on a GPU
 * the driver wakes the thread from the completion interrupt; on the simulator, a timer at the
 * event's device time), so the drain's end costs one wake-up. Polling from just before an
 * estimated end, as this once did, was as fast on an idle host, but a spinning thread on a busy
 * one uses up its slice and is preempted for milliseconds right at the handoff (2 tenants next
 * to 2 CPU-bound processes on 2 cores: handoff p99 4.0 ms against the host's 0.25 ms floor; with
 * the one wake-up 0.23 ms against 0.19 ms). */
static void wait_drained(struct gs_gpu *g, struct gs_stream *e, CUevent event) {
    uint64_t eta = gs_drain_eta(g, e);
    if (eta) gs_atomic_max64(&g->slot->drain_eta_ns, eta);
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
        if (!e->event && real_cuEventCreate) real_cuEventCreate(&e->event, GS_DRAIN_EVENT_FLAGS);
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
            if (e->t0 && real_cuEventDestroy_v2) real_cuEventDestroy_v2(e->t0);
            if (e->t1 && real_cuEventDestroy_v2) real_cuEventDestroy_v2(e->t1);
            if (gs_tl.tail == e) gs_tl.tail = NULL;
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
    /* an untimed lease (extended: its queue started under the previous one) ended when the
     * agent woke from its events: a wake-up later than the device (charged to it) */
    return now;
}

/* Direct handoff (see wire.md): the last process to drain grants the GPU to the holder the
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
    struct gpushare_wire_slot *n = gpushare_wire_slot_at(h, next - 1);
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
int gs_streams_busy(struct gs_gpu *g, uint64_t lease) {
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
void gs_finish_lease(struct gs_gpu *g, uint64_t lease) {
    uint64_t end = drain(g, lease);
    struct gpushare_wire_slot *s = g->slot;
    gs_atomic_max64(&s->drain_end_ns, end);
    int handed = atomic_load(&g->joined_lease) == lease ? try_handoff(g) : -1;
    uint64_t expected = lease;
    if (atomic_compare_exchange_strong(&g->joined_lease, &expected, 0)) gs_dec_floor(&s->joined);
    if (handed >= 0 && atomic_load(&gs.connected)) {
        /* The next holder's thread is waking up now: a message would wake the daemon (and its
         * event loop's work) on the same few CPUs at the same moment, so it waits until that
         * thread has launched (its first_launch_ns), at most HANDOFF_QUIET_NS. The daemon
         * charges from the board's timestamps, not from when the message comes. */
        struct gpushare_wire_slot *n = gpushare_wire_slot_at(g->header, (size_t)handed);
        uint64_t quiet_until = gs_now() + HANDOFF_QUIET_NS;
        while (atomic_load(&n->first_launch_ns) == 0 && gs_now() < quiet_until)
            gs_sleep_ns(HANDOFF_QUIET_STEP_NS);
        char line[256];
        snprintf(line, sizeof line,
                 "{\"op\":\"done\",\"gpu\":\"%s\",\"lease\":%llu,\"handoff\":%d}\n", g->uuid,
                 (unsigned long long)lease, handed);
        gs_send_line(line);
    } else {
        gs_send_lease_msg("done", g, lease);
    }
}

/* The daemon picked us again (nobody else may run now): keep the GPU without draining (nothing
 * can spill into another tenant's slice). The old lease is charged up to now, the new one starts
 * now; this process stays joined. Returns 0 when it extended. */
int gs_try_extend(struct gs_gpu *g, uint64_t lease) {
    struct gpushare_wire_header *h = g->header;
    struct gpushare_wire_slot *s = g->slot;
    if (!h || g->slot_index < 0 || !atomic_load(&gs.connected)) return -1;
    uint32_t mine = (uint32_t)g->slot_index + 1;
    if (atomic_load(&s->lease_until_ns) != lease || atomic_load(&s->joined) != 1 ||
        atomic_load(&h->next_slot) != mine || atomic_load(&h->holder) != mine ||
        atomic_load(&g->policy->state) != GPUSHARE_SLOT_ACTIVE)
        return -1;
    uint64_t now = gs_now(), lease_ns = atomic_load(&h->next_lease_ns);
    /* No launch during this lease and nobody waiting to: the process went idle, let the lease
     * end. A process waiting for a kernel longer than the quantum is not idle (it launches
     * again as soon as the kernel ends): without a limit, where the daemon's ranking alone
     * shares spare time, its lease is extended while its streams still have work queued
     * (else it went to whoever waited next at every kernel: requests 0.2/0.3 got 0.5/0.5).
     * Under a limit the credit keeps the proportions, and extending a limited holder that
     * waits on several streams left the device idle (4 streams of 50 ms kernels at 0.3/0.7:
     * 0.29/0.60), so there it ends as before. */
    if (atomic_load(&g->last_launch_ns) < atomic_load(&s->lease_start_ns) &&
        atomic_load(&s->waiters) == 0 &&
        !(atomic_load(&g->policy->limit_ppm) >= 1000000u && gs_streams_busy(g, lease)))
        return -1;
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
    /* first_launch_ns stays: the daemon charges the old lease from it when it adopts this
     * extension (usually after this store), and it is before the new lease's start, where the
     * daemon charges an extension from (the process is still joined: nobody joins it anew) */
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
    gs_send_line(line);
    return 0;
}
