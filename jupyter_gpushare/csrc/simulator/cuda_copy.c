/* cuda_copy.c - copies and sets. Device memory is host memory (see cuda_memory.c), so they move
 * real bytes; device-side ranges are checked against the allocations first. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "sim_cuda.h"

/* -- copies and sets -------------------------------------------------------------------------- */

enum side { HOST, DEVICE, ANY };

/* Synchronous copies first wait for the work issued before them (the legacy stream's, or the
 * calling thread's default stream's), as real ones do; asynchronous ones copy at once (simulated
 * kernels never touch the bytes, so the result is the same) unless the stream is capturing. */
static CUresult copy(void *dst, enum side dside, const void *src, enum side sside, size_t n,
                     CUstream h, int async, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(async ? h : NULL, ptds, &s);
    if (r) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    if ((dside == DEVICE && !sim_device_range((uint64_t)(uintptr_t)dst, n)) ||
        (sside == DEVICE && !sim_device_range((uint64_t)(uintptr_t)src, n)))
        return CUDA_ERROR_INVALID_VALUE;
    struct graph_node node = {.kind = NODE_COPY, .dst = dst, .src = src, .count = n};
    if (async && sim_capture_node(s, &node)) return CUDA_SUCCESS;
    if (!async) sim_sleep_until(sim_stream_ready(s));
    memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define D(p) ((void *)(uintptr_t)(p))

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(D(dst), ANY, D(src), ANY, n, NULL, 0, 0);
}
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(D(dst), ANY, D(src), ANY, n, NULL, 0, 1);
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(D(dst), ANY, D(src), ANY, n, h, 1, 0);
}
CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(D(dst), ANY, D(src), ANY, n, h, 1, 1);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    return copy(D(dst), DEVICE, src, HOST, n, NULL, 0, 0);
}
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) {
    return copy(D(dst), DEVICE, src, HOST, n, NULL, 0, 1);
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    return copy(dst, HOST, D(src), DEVICE, n, NULL, 0, 0);
}
CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) {
    return copy(dst, HOST, D(src), DEVICE, n, NULL, 0, 1);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(D(dst), DEVICE, D(src), DEVICE, n, NULL, 0, 0);
}
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(D(dst), DEVICE, D(src), DEVICE, n, NULL, 0, 1);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    return copy(D(dst), DEVICE, src, HOST, n, h, 1, 0);
}
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    return copy(D(dst), DEVICE, src, HOST, n, h, 1, 1);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(dst, HOST, D(src), DEVICE, n, h, 1, 0);
}
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(dst, HOST, D(src), DEVICE, n, h, 1, 1);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(D(dst), DEVICE, D(src), DEVICE, n, h, 1, 0);
}
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    return copy(D(dst), DEVICE, D(src), DEVICE, n, h, 1, 1);
}

static CUresult set(CUdeviceptr dst, unsigned value, size_t count, enum node_kind kind, CUstream h,
                    int async, int ptds) {
    struct CUstream_st *s;
    CUresult r = sim_stream(async ? h : NULL, ptds, &s);
    if (r) return r;
    size_t width = kind == NODE_SET8 ? 1 : (kind == NODE_SET16 ? 2 : 4);
    if (count == 0) return CUDA_SUCCESS;
    if (dst % width || count > SIZE_MAX / width || !sim_device_range(dst, count * width))
        return CUDA_ERROR_INVALID_VALUE;
    struct graph_node node = {.kind = kind, .dst = D(dst), .count = count, .value = value};
    if (async && sim_capture_node(s, &node)) return CUDA_SUCCESS;
    if (!async) sim_sleep_until(sim_stream_ready(s));
    if (kind == NODE_SET8) {
        memset(D(dst), (int)(value & 0xff), count);
    } else if (kind == NODE_SET16) {
        for (size_t i = 0; i < count; i++) ((uint16_t *)D(dst))[i] = (uint16_t)value;
    } else {
        for (size_t i = 0; i < count; i++) ((uint32_t *)D(dst))[i] = value;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    return set(d, v, n, NODE_SET8, NULL, 0, 0);
}
CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) {
    return set(d, v, n, NODE_SET8, NULL, 0, 1);
}
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) {
    return set(d, v, n, NODE_SET16, NULL, 0, 0);
}
CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n) {
    return set(d, v, n, NODE_SET16, NULL, 0, 1);
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) {
    return set(d, v, n, NODE_SET32, NULL, 0, 0);
}
CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n) {
    return set(d, v, n, NODE_SET32, NULL, 0, 1);
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET8, h, 1, 0);
}
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET8, h, 1, 1);
}
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET16, h, 1, 0);
}
CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET16, h, 1, 1);
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET32, h, 1, 0);
}
CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream h) {
    return set(d, v, n, NODE_SET32, h, 1, 1);
}
