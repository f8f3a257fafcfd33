/* cuda_event.c - events: an event holds the instant the work before it on its stream completes,
 * so queries, synchronisation and elapsed times are exact. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

/* -- events ----------------------------------------------------------------------------------- */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!phEvent || (Flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = Flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (!e || e->magic != MAGIC_EVENT) return CUDA_ERROR_INVALID_HANDLE;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (g) {
        atomic_store(&e->capture, g);
        return CUDA_SUCCESS;
    }
    atomic_store(&e->capture, NULL);
    uint64_t now = sim_now_ns();
    uint64_t ready = sim_stream_ready(s);
    atomic_store(&e->time, ready > now ? ready : now);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 0);
}
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 1);
}

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
    if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    return event_record(hEvent, hStream, 0);
}

CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
    if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    return event_record(hEvent, hStream, 1);
}

static CUresult check_event(CUevent e) {
    SIM_TRY(sim_ready());
    return e && e->magic == MAGIC_EVENT ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventQuery(CUevent hEvent) {
    CUresult r = check_event(hEvent);
    if (r) return r;
    return atomic_load(&hEvent->time) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    CUresult r = check_event(hEvent);
    if (r) return r;
    sim_sleep_until(atomic_load(&hEvent->time));
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    CUresult r = check_event(hStart);
    if (!r) r = check_event(hEnd);
    if (r) return r;
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t a = atomic_load(&hStart->time), b = atomic_load(&hEnd->time);
    if (!a || !b) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = sim_now_ns();
    if (a > now || b > now) return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)((int64_t)(b - a)) / 1e6);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
    CUresult r = check_event(hEvent);
    if (r) return r;
    hEvent->magic = MAGIC_DEAD;
    free(hEvent);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent hEvent) {
    return cuEventDestroy_v2(hEvent);
}
