/* launch.c - every launch path waits for a lease: cuLaunchKernel, cuLaunchKernelEx, cooperative
 * launches, cuGraphLaunch and their _ptsz variants. Launches into a stream that is being
 * captured into a graph are not work (they run when the graph is launched) and pass untouched.
 * cuInit, stream destruction and stream capture are tracked here too.
 */
#include "gs.h"

CUresult cuInit(unsigned int Flags) {
    gs_resolve();
    if (!real_cuInit) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real_cuInit(Flags);
    if (r == CUDA_SUCCESS) gs_init();
    return r;
}

/* Admission for a launch on `stream` in the current context. */
static inline CUresult admit(CUstream stream) {
    struct gs_gpu *g = gs_current_gpu();
    if (__builtin_expect(g == NULL, 0)) {
        if (gs.enabled && atomic_load(&gs.denied)) {
            gs_deny_message();
            return CUDA_ERROR_NOT_PERMITTED;
        }
        return CUDA_SUCCESS;
    }
    if (__builtin_expect(atomic_load_explicit(&gs.capturing, memory_order_relaxed) != 0, 0) &&
        gs_stream_capturing(stream))
        return CUDA_SUCCESS;
    return gs_admit(g, stream);
}

int gs_stream_capturing(CUstream stream) {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (real_cuStreamIsCapturing && real_cuStreamIsCapturing(stream, &status) == CUDA_SUCCESS)
        return status != CU_STREAM_CAPTURE_STATUS_NONE;
    return 0;
}

#define LAUNCH_ARGS_DECL                                                                           \
    CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,             \
        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                    \
        unsigned int sharedMemBytes, CUstream hStream
#define LAUNCH_ARGS                                                                                \
    f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream

CUresult cuLaunchKernel(LAUNCH_ARGS_DECL, void **kernelParams, void **extra) {
    CUresult r = admit(hStream);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchKernel) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchKernel(LAUNCH_ARGS, kernelParams, extra));
}

CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS_DECL, void **kernelParams, void **extra) {
    CUresult r = admit(hStream ? hStream : CU_STREAM_PER_THREAD);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchKernel_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchKernel_ptsz(LAUNCH_ARGS, kernelParams, extra));
}

CUresult cuLaunchCooperativeKernel(LAUNCH_ARGS_DECL, void **kernelParams) {
    CUresult r = admit(hStream);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchCooperativeKernel) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchCooperativeKernel(LAUNCH_ARGS, kernelParams));
}

CUresult cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS_DECL, void **kernelParams) {
    CUresult r = admit(hStream ? hStream : CU_STREAM_PER_THREAD);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchCooperativeKernel_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS, kernelParams));
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    CUresult r = admit(config ? config->hStream : NULL);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchKernelEx) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchKernelEx(config, f, kernelParams, extra));
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    CUstream s = config ? config->hStream : NULL;
    CUresult r = admit(s ? s : CU_STREAM_PER_THREAD);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuLaunchKernelEx_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuLaunchKernelEx_ptsz(config, f, kernelParams, extra));
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    CUresult r = admit(hStream);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuGraphLaunch) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuGraphLaunch(hGraphExec, hStream));
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    CUresult r = admit(hStream ? hStream : CU_STREAM_PER_THREAD);
    if (r != CUDA_SUCCESS) return r;
    gs_launching();
    if (!real_cuGraphLaunch_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return gs_launched(real_cuGraphLaunch_ptsz(hGraphExec, hStream));
}

/* -- streams -------------------------------------------------------------------------------- */

CUresult cuStreamDestroy(CUstream hStream) {
    gs_init();
    gs_stream_forget(hStream);
    if (!real_cuStreamDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuStreamDestroy(hStream);
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    gs_init();
    gs_stream_forget(hStream);
    if (!real_cuStreamDestroy_v2) return CUDA_ERROR_NOT_SUPPORTED;
    return real_cuStreamDestroy_v2(hStream);
}

static CUresult captured(CUresult r) {
    if (r == CUDA_SUCCESS) atomic_fetch_add(&gs.capturing, 1);
    return r;
}

static void capture_ended(void) {
    int cur = atomic_load(&gs.capturing);
    while (cur > 0 && !atomic_compare_exchange_weak(&gs.capturing, &cur, cur - 1)) {}
}

CUresult cuStreamBeginCapture(CUstream hStream) {
    gs_resolve();
    if (!real_cuStreamBeginCapture) return CUDA_ERROR_NOT_SUPPORTED;
    return captured(real_cuStreamBeginCapture(hStream));
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    gs_resolve();
    if (!real_cuStreamBeginCapture_v2) return CUDA_ERROR_NOT_SUPPORTED;
    return captured(real_cuStreamBeginCapture_v2(hStream, mode));
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    gs_resolve();
    if (!real_cuStreamBeginCapture_v2_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return captured(real_cuStreamBeginCapture_v2_ptsz(hStream, mode));
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    gs_resolve();
    if (!real_cuStreamEndCapture) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult r = real_cuStreamEndCapture(hStream, phGraph);
    capture_ended();
    return r;
}

CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    gs_resolve();
    if (!real_cuStreamEndCapture_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult r = real_cuStreamEndCapture_ptsz(hStream, phGraph);
    capture_ended();
    return r;
}
