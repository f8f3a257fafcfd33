/* cuda_graph.c - graphs made by stream capture: launches on a capturing stream (and on streams
 * that joined it through events) become nodes; an instantiated graph runs as one piece of device
 * work lasting its kernels' total time, after performing its copies and sets. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

/* -- graphs (stream capture) ------------------------------------------------------------------ */

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    if (s->kind == STREAM_LEGACY) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC_GRAPH;
    pthread_mutex_init(&g->lock, NULL);
    g->origin = s;
    struct CUgraph_st *none = NULL;
    if (!atomic_compare_exchange_strong(&s->capture, &none, g)) {
        free(g);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream hStream) {
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 0);
}

CUresult cuStreamBeginCapture_ptsz(CUstream hStream) {
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (!g || g->origin != s) return CUDA_ERROR_ILLEGAL_STATE;
    atomic_store(&s->capture, NULL);
    /* Streams that joined through events leave the capture with it. */
    pthread_mutex_lock(&g->lock);
    for (int i = 0; i < g->njoined; i++) {
        struct CUgraph_st *expected = g;
        if (g->joined[i]->magic == MAGIC_STREAM)
            atomic_compare_exchange_strong(&g->joined[i]->capture, &expected, NULL);
    }
    g->njoined = 0;
    pthread_mutex_unlock(&g->lock);
    *phGraph = g;
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 0);
}

CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 1);
}

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *status, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status =
        atomic_load(&s->capture) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 0);
}

CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 1);
}

static CUresult capture_info(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                             CUgraph *graph, const CUgraphNode **deps, size_t *ndeps, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    struct CUgraph_st *g = atomic_load(&s->capture);
    if (status) *status = g ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    if (id) *id = (cuuint64_t)(uintptr_t)g;
    if (graph) *graph = g;
    if (deps) *deps = NULL;
    if (ndeps) *ndeps = 0;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                   cuuint64_t *id_out, CUgraph *graph_out,
                                   const CUgraphNode **dependencies_out,
                                   size_t *numDependencies_out) {
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 0);
}

CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                        cuuint64_t *id_out, CUgraph *graph_out,
                                        const CUgraphNode **dependencies_out,
                                        size_t *numDependencies_out) {
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 1);
}

CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                   cuuint64_t *id_out, CUgraph *graph_out,
                                   const CUgraphNode **dependencies_out,
                                   const CUgraphEdgeData **edgeData_out,
                                   size_t *numDependencies_out) {
    if (edgeData_out) *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 0);
}

CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                        cuuint64_t *id_out, CUgraph *graph_out,
                                        const CUgraphNode **dependencies_out,
                                        const CUgraphEdgeData **edgeData_out,
                                        size_t *numDependencies_out) {
    if (edgeData_out) *edgeData_out = NULL;
    return capture_info(hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        numDependencies_out, 1);
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    static __thread int current;
    if (!mode || *mode < 0 || *mode > 2) return CUDA_ERROR_INVALID_VALUE;
    int old = current;
    current = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags) {
    (void)flags;
    SIM_TRY(sim_ready());
    if (!hGraph || hGraph->magic != MAGIC_GRAPH) return CUDA_ERROR_INVALID_HANDLE;
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *x = calloc(1, sizeof *x);
    if (!x) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&hGraph->lock);
    if (hGraph->count) {
        x->nodes = malloc(hGraph->count * sizeof *x->nodes);
        if (!x->nodes) {
            pthread_mutex_unlock(&hGraph->lock);
            free(x);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        memcpy(x->nodes, hGraph->nodes, hGraph->count * sizeof *x->nodes);
    }
    x->count = hGraph->count;
    pthread_mutex_unlock(&hGraph->lock);
    for (size_t i = 0; i < x->count; i++)
        if (x->nodes[i].kind == NODE_KERNEL) x->total_ns += x->nodes[i].ns;
    x->magic = MAGIC_GRAPH_EXEC;
    *phGraphExec = x;
    return CUDA_SUCCESS;
}

/* The CUDA 11 signature, still exported as cuGraphInstantiate / cuGraphInstantiate_v2. */
CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize) {
    if (phErrorNode) *phErrorNode = NULL;
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

static void run_copy_nodes(const struct CUgraphExec_st *x) {
    for (size_t i = 0; i < x->count; i++) {
        const struct graph_node *n = &x->nodes[i];
        switch (n->kind) {
        case NODE_COPY:
            memmove(n->dst, n->src, n->count);
            break;
        case NODE_SET8:
            memset(n->dst, (int)(n->value & 0xff), n->count);
            break;
        case NODE_SET16:
            for (size_t k = 0; k < n->count; k++) ((uint16_t *)n->dst)[k] = (uint16_t)n->value;
            break;
        case NODE_SET32:
            for (size_t k = 0; k < n->count; k++) ((uint32_t *)n->dst)[k] = n->value;
            break;
        case NODE_KERNEL:
            break;
        }
    }
}

/* A graph runs as one piece of device work lasting its kernels' total time. */
static CUresult graph_launch(CUgraphExec x, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(h, ptds, &s);
    if (r) return r;
    if (!x || x->magic != MAGIC_GRAPH_EXEC) return CUDA_ERROR_INVALID_HANDLE;
    run_copy_nodes(x);
    return sim_enqueue(s, x->total_ns);
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 1);
}

CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    struct CUstream_st *s;
    CUresult r = sim_stream(hStream, 0, &s);
    if (r) return r;
    return hGraphExec && hGraphExec->magic == MAGIC_GRAPH_EXEC ? CUDA_SUCCESS
                                                               : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    if (!hGraphExec || hGraphExec->magic != MAGIC_GRAPH_EXEC) return CUDA_ERROR_INVALID_HANDLE;
    hGraphExec->magic = MAGIC_DEAD;
    free(hGraphExec->nodes);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph hGraph) {
    if (!hGraph || hGraph->magic != MAGIC_GRAPH) return CUDA_ERROR_INVALID_HANDLE;
    hGraph->magic = MAGIC_DEAD;
    free(hGraph->nodes);
    pthread_mutex_destroy(&hGraph->lock);
    free(hGraph);
    return CUDA_SUCCESS;
}
