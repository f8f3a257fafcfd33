/* cuda_entry.c - error names, cuGetProcAddress (the driver's symbol table) and cuGetExportTable. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

/* -- errors ----------------------------------------------------------------------------------- */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_PROFILER_DISABLED, "CUDA_ERROR_PROFILER_DISABLED",
     "profiler disabled while using external profiling tool"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE",
     "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_DEVICE_NOT_LICENSED, "CUDA_ERROR_DEVICE_NOT_LICENSED",
     "device doesn't have valid Grid license"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
     "context already current"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_UNMAP_FAILED, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU",
     "no kernel image is available for execution on the device"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT",
     "limit is not supported on this architecture"},
    {CUDA_ERROR_CONTEXT_ALREADY_IN_USE, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
     "exclusive-thread device already in use by a different thread"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
     "shared object symbol not found"},
    {CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
     "shared object initialization failed"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
     "too many resources requested for launch"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT",
     "the launch timed out and was terminated"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
     "peer access has not been enabled"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
     "cannot set while device is active in this process"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
     "too many blocks in cooperative launch"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_SYSTEM_NOT_READY, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
     "system has unsupported display driver / cuda driver combination"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_MERGE, "CUDA_ERROR_STREAM_CAPTURE_MERGE",
     "operation would result in a merge of separate capture sequences"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
     "capture was not ended in the same stream as it began"},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
     "capturing stream has unjoined work"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "dependency created on uncaptured work in another stream"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
     "the graph update was not performed because it included changes which violated constraints "
     "specific to instantiated graph update"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int error_index(CUresult e) {
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == e) return (int)i;
    return -1;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(error);
    *pStr = i >= 0 ? errors[i].name : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(error);
    *pStr = i >= 0 ? errors[i].text : NULL;
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The CUDA runtime (libcudart: PyTorch, CuPy, ...) asks for the driver's private export tables
 * first thing; without them it fails every call with cudaErrorNotSupported and says nothing about
 * why. Say it once per process, on stderr, in the user's words. */
static const char runtime_note[] =
    "gpushare simulator: this simulated GPU runs CUDA driver-API programs only. The CUDA runtime "
    "(libcudart, used by PyTorch, CuPy, ...) needs private driver tables that the simulator does "
    "not have, so its calls fail with cudaErrorNotSupported. Run such programs on a real NVIDIA "
    "GPU: leave out --simulate / GPUSHARE_SIMULATE on a machine with the NVIDIA driver.\n";
static atomic_int runtime_noted;

CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    (void)pExportTableId;
    if (!atomic_exchange(&runtime_noted, 1)) {
        if (write(STDERR_FILENO, runtime_note, sizeof runtime_note - 1) < 0) {
            /* nothing to do: stderr is closed */
        }
    }
    if (ppExportTable) *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* -- cuGetProcAddress ------------------------------------------------------------------------- */

/* One row per (name, version): the row with the highest `since` not above the caller's CUDA
 * version wins; `ptds` is the per-thread-default-stream variant, when CUDA has one. */
struct proc_row {
    const char *name;
    int since;
    void *fn;
    void *ptds;
};

#define ROW(name, fn)         {name, 0, (void *)(fn), NULL}
#define ROWV(name, since, fn) {name, since, (void *)(fn), NULL}
#define ROWP(name, fn, ptds)  {name, 0, (void *)(fn), (void *)(ptds)}
#define SELF(fn)              ROW(#fn, fn)

static const struct proc_row rows[] = {
    SELF(cuInit),
    SELF(cuDriverGetVersion),
    SELF(cuGetErrorName),
    SELF(cuGetErrorString),
    SELF(cuGetExportTable),
    ROW("cuGetProcAddress", cuGetProcAddress),
    ROWV("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    SELF(cuDeviceGet),
    SELF(cuDeviceGetCount),
    SELF(cuDeviceGetName),
    ROW("cuDeviceGetUuid", cuDeviceGetUuid),
    ROWV("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    ROW("cuDeviceTotalMem", cuDeviceTotalMem_v2),
    SELF(cuDeviceGetAttribute),
    SELF(cuDeviceComputeCapability),
    SELF(cuDeviceGetPCIBusId),
    SELF(cuDeviceCanAccessPeer),
    SELF(cuDeviceGetP2PAttribute),
    SELF(cuDeviceGetByPCIBusId),
    SELF(cuCtxSetCacheConfig),
    SELF(cuCtxGetCacheConfig),
    SELF(cuCtxEnablePeerAccess),
    SELF(cuCtxDisablePeerAccess),
    SELF(cuProfilerStart),
    SELF(cuProfilerStop),
    SELF(cuOccupancyMaxPotentialBlockSize),
    SELF(cuFuncSetCacheConfig),
    ROW("cuMemHostGetDevicePointer", cuMemHostGetDevicePointer_v2),
    ROWP("cuMemPrefetchAsync", cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz),
    {"cuMemPrefetchAsync", 12020, (void *)cuMemPrefetchAsync_v2,
     (void *)cuMemPrefetchAsync_v2_ptsz},
    ROW("cuMemAdvise", cuMemAdvise),
    ROWV("cuMemAdvise", 12020, cuMemAdvise_v2),
    ROWP("cuStreamGetDevice", cuStreamGetDevice, cuStreamGetDevice_ptsz),
    SELF(cuDevicePrimaryCtxRetain),
    ROW("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
    ROW("cuDevicePrimaryCtxReset", cuDevicePrimaryCtxReset_v2),
    SELF(cuDevicePrimaryCtxGetState),
    ROW("cuDevicePrimaryCtxSetFlags", cuDevicePrimaryCtxSetFlags_v2),
    ROW("cuCtxCreate", cuCtxCreate_v2),
    ROWV("cuCtxCreate", 11040, cuCtxCreate_v3),
    ROWV("cuCtxCreate", 12050, cuCtxCreate_v4),
    ROW("cuCtxDestroy", cuCtxDestroy_v2),
    SELF(cuCtxSetCurrent),
    SELF(cuCtxGetCurrent),
    ROW("cuCtxPushCurrent", cuCtxPushCurrent_v2),
    ROW("cuCtxPopCurrent", cuCtxPopCurrent_v2),
    SELF(cuCtxGetDevice),
    ROWV("cuCtxGetDevice", 12080, cuCtxGetDevice_v2),
    SELF(cuCtxGetFlags),
    SELF(cuCtxSetFlags),
    SELF(cuCtxGetApiVersion),
    SELF(cuCtxGetId),
    SELF(cuCtxSynchronize),
    SELF(cuCtxGetLimit),
    SELF(cuCtxSetLimit),
    SELF(cuCtxGetStreamPriorityRange),
    SELF(cuModuleLoad),
    SELF(cuModuleLoadData),
    SELF(cuModuleLoadDataEx),
    SELF(cuModuleLoadFatBinary),
    SELF(cuModuleUnload),
    SELF(cuModuleGetFunction),
    ROW("cuModuleGetGlobal", cuModuleGetGlobal_v2),
    SELF(cuModuleGetLoadingMode),
    SELF(cuLibraryLoadData),
    SELF(cuLibraryUnload),
    SELF(cuLibraryGetKernel),
    SELF(cuKernelGetFunction),
    SELF(cuFuncGetAttribute),
    SELF(cuFuncSetAttribute),
    SELF(cuFuncGetName),
    SELF(cuOccupancyMaxActiveBlocksPerMultiprocessor),
    ROWP("cuLaunchKernel", cuLaunchKernel, cuLaunchKernel_ptsz),
    ROWP("cuLaunchKernelEx", cuLaunchKernelEx, cuLaunchKernelEx_ptsz),
    ROWP("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz),
    ROWP("cuLaunchHostFunc", cuLaunchHostFunc, cuLaunchHostFunc_ptsz),
    SELF(cuStreamCreate),
    SELF(cuStreamCreateWithPriority),
    ROW("cuStreamDestroy", cuStreamDestroy_v2),
    ROWP("cuStreamSynchronize", cuStreamSynchronize, cuStreamSynchronize_ptsz),
    ROWP("cuStreamQuery", cuStreamQuery, cuStreamQuery_ptsz),
    ROWP("cuStreamWaitEvent", cuStreamWaitEvent, cuStreamWaitEvent_ptsz),
    ROWP("cuStreamGetFlags", cuStreamGetFlags, cuStreamGetFlags_ptsz),
    ROWP("cuStreamGetPriority", cuStreamGetPriority, cuStreamGetPriority_ptsz),
    ROWP("cuStreamGetCtx", cuStreamGetCtx, cuStreamGetCtx_ptsz),
    ROWP("cuStreamGetId", cuStreamGetId, cuStreamGetId_ptsz),
    ROWP("cuStreamAddCallback", cuStreamAddCallback, cuStreamAddCallback_ptsz),
    ROWP("cuStreamBeginCapture", cuStreamBeginCapture, cuStreamBeginCapture_ptsz),
    {"cuStreamBeginCapture", 10010, (void *)cuStreamBeginCapture_v2,
     (void *)cuStreamBeginCapture_v2_ptsz},
    ROWP("cuStreamEndCapture", cuStreamEndCapture, cuStreamEndCapture_ptsz),
    ROWP("cuStreamIsCapturing", cuStreamIsCapturing, cuStreamIsCapturing_ptsz),
    ROWP("cuStreamGetCaptureInfo", cuStreamGetCaptureInfo_v2, cuStreamGetCaptureInfo_v2_ptsz),
    {"cuStreamGetCaptureInfo", 12030, (void *)cuStreamGetCaptureInfo_v3,
     (void *)cuStreamGetCaptureInfo_v3_ptsz},
    SELF(cuThreadExchangeStreamCaptureMode),
    SELF(cuEventCreate),
    ROWP("cuEventRecord", cuEventRecord, cuEventRecord_ptsz),
    ROWP("cuEventRecordWithFlags", cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz),
    SELF(cuEventQuery),
    SELF(cuEventSynchronize),
    ROW("cuEventElapsedTime", cuEventElapsedTime),
    ROWV("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    ROW("cuEventDestroy", cuEventDestroy_v2),
    ROW("cuMemGetInfo", cuMemGetInfo_v2),
    ROW("cuMemAlloc", cuMemAlloc_v2),
    ROW("cuMemAllocPitch", cuMemAllocPitch_v2),
    SELF(cuMemAllocManaged),
    ROW("cuMemFree", cuMemFree_v2),
    ROW("cuMemGetAddressRange", cuMemGetAddressRange_v2),
    ROW("cuMemAllocHost", cuMemAllocHost_v2),
    SELF(cuMemHostAlloc),
    SELF(cuMemFreeHost),
    ROW("cuMemHostRegister", cuMemHostRegister_v2),
    SELF(cuMemHostUnregister),
    SELF(cuPointerGetAttribute),
    ROWP("cuMemAllocAsync", cuMemAllocAsync, cuMemAllocAsync_ptsz),
    ROWP("cuMemFreeAsync", cuMemFreeAsync, cuMemFreeAsync_ptsz),
    ROWP("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz),
    SELF(cuMemPoolCreate),
    SELF(cuMemPoolDestroy),
    SELF(cuMemPoolTrimTo),
    SELF(cuMemPoolSetAttribute),
    SELF(cuMemPoolGetAttribute),
    SELF(cuDeviceGetDefaultMemPool),
    SELF(cuDeviceGetMemPool),
    SELF(cuDeviceSetMemPool),
    SELF(cuMemCreate),
    SELF(cuMemRelease),
    SELF(cuMemAddressReserve),
    SELF(cuMemAddressFree),
    SELF(cuMemMap),
    SELF(cuMemUnmap),
    SELF(cuMemSetAccess),
    SELF(cuMemGetAllocationGranularity),
    SELF(cuMemGetAllocationPropertiesFromHandle),
    ROW("cuArrayCreate", cuArrayCreate_v2),
    ROW("cuArray3DCreate", cuArray3DCreate_v2),
    SELF(cuArrayDestroy),
    ROWP("cuMemcpy", cuMemcpy, cuMemcpy_ptds),
    ROWP("cuMemcpyAsync", cuMemcpyAsync, cuMemcpyAsync_ptsz),
    ROWP("cuMemcpyHtoD", cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds),
    ROWP("cuMemcpyDtoH", cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
    ROWP("cuMemcpyDtoD", cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds),
    ROWP("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz),
    ROWP("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz),
    ROWP("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz),
    ROWP("cuMemsetD8", cuMemsetD8_v2, cuMemsetD8_v2_ptds),
    ROWP("cuMemsetD16", cuMemsetD16_v2, cuMemsetD16_v2_ptds),
    ROWP("cuMemsetD32", cuMemsetD32_v2, cuMemsetD32_v2_ptds),
    ROWP("cuMemsetD8Async", cuMemsetD8Async, cuMemsetD8Async_ptsz),
    ROWP("cuMemsetD16Async", cuMemsetD16Async, cuMemsetD16Async_ptsz),
    ROWP("cuMemsetD32Async", cuMemsetD32Async, cuMemsetD32Async_ptsz),
    ROW("cuGraphInstantiate", cuGraphInstantiate),
    ROWV("cuGraphInstantiate", 11000, cuGraphInstantiate_v2),
    ROWV("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags),
    SELF(cuGraphInstantiateWithFlags),
    ROWP("cuGraphLaunch", cuGraphLaunch, cuGraphLaunch_ptsz),
    SELF(cuGraphUpload),
    SELF(cuGraphExecDestroy),
    SELF(cuGraphDestroy),
};

static CUresult lookup(const char *symbol, int version, cuuint64_t flags, void **pfn,
                       CUdriverProcAddressQueryResult *status) {
    const struct proc_row *best = NULL;
    int named = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        if (strcmp(rows[i].name, symbol) != 0) continue;
        named = 1;
        if (rows[i].since <= version && (!best || rows[i].since >= best->since)) best = &rows[i];
    }
    if (!best) {
        *pfn = NULL;
        if (status)
            *status = named ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptds ? best->ptds
                                                                                 : best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    if (!symbol || !pfn || (flags & ~(cuuint64_t)3)) return CUDA_ERROR_INVALID_VALUE;
    return lookup(symbol, cudaVersion, flags, pfn, symbolStatus);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
