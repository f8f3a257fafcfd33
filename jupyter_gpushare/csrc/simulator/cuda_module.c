/* cuda_module.c - modules, libraries and functions. The simulator runs no code: any image loads,
 * any name resolves to a function, and a function whose name contains `busy_us` keeps the device
 * busy for its first (u64) parameter's microseconds when launched. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_cuda.h"

/* -- modules, libraries, functions ------------------------------------------------------------ */

/* Loaded modules belong to the driver until unloaded (as with a real one, a program may drop
 * its handle and keep using the functions). */
static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUmod_st *modules;

static CUresult module_new(CUmodule *out, uint32_t magic) {
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = magic;
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_lock(&modules_lock);
    m->next = modules;
    modules = m;
    pthread_mutex_unlock(&modules_lock);
    *out = m;
    return CUDA_SUCCESS;
}

static CUresult module_load(CUmodule *module, const void *image) {
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, MAGIC_MODULE);
}

CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    if (fname && access(fname, R_OK) != 0)
        return sim_ready() ? sim_ready() : CUDA_ERROR_FILE_NOT_FOUND;
    return module_load(module, fname);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    return module_load(module, image);
}

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues) {
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return module_load(module, image);
}

CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return module_load(module, fatCubin);
}

static void module_free(struct CUmod_st *m) {
    pthread_mutex_lock(&modules_lock);
    for (struct CUmod_st **pp = &modules; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    }
    pthread_mutex_unlock(&modules_lock);
    m->magic = MAGIC_DEAD;
    for (struct CUfunc_st *f = m->funcs, *n; f; f = n) {
        n = f->next;
        f->magic = MAGIC_DEAD;
        free(f);
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

CUresult cuModuleUnload(CUmodule hmod) {
    SIM_TRY(sim_ready());
    if (!hmod || hmod->magic != MAGIC_MODULE) return CUDA_ERROR_INVALID_HANDLE;
    module_free(hmod);
    return CUDA_SUCCESS;
}

/* Any name resolves: the simulator has no code to check against. */
static CUresult module_function(struct CUmod_st *m, const char *name, struct CUfunc_st **out) {
    if (!name || !out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&m->lock);
    struct CUfunc_st *f = m->funcs;
    while (f && strcmp(f->name, name) != 0) f = f->next;
    if (!f) {
        size_t len = strlen(name);
        f = calloc(1, sizeof *f + len + 1);
        if (f) {
            f->magic = MAGIC_FUNC;
            f->busy = strstr(name, "busy_us") != NULL;
            f->module = m;
            memcpy(f->name, name, len + 1);
            f->next = m->funcs;
            m->funcs = f;
        }
    }
    pthread_mutex_unlock(&m->lock);
    *out = f;
    return f ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    SIM_TRY(sim_ready());
    if (!hmod || hmod->magic != MAGIC_MODULE) return CUDA_ERROR_INVALID_HANDLE;
    return module_function(hmod, name, hfunc);
}

CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name) {
    (void)dptr;
    (void)bytes;
    (void)name;
    SIM_TRY(sim_ready());
    if (!hmod || hmod->magic != MAGIC_MODULE) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_FOUND; /* simulated modules have no globals */
}

CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = 2; /* CU_MODULE_LAZY_LOADING */
    return CUDA_SUCCESS;
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions) {
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    SIM_TRY(sim_ready());
    if (!library || !code) return CUDA_ERROR_INVALID_VALUE;
    CUmodule m;
    SIM_TRY(module_new(&m, MAGIC_LIBRARY));
    *library = (CUlibrary)m;
    return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(CUlibrary library) {
    struct CUmod_st *m = (struct CUmod_st *)library;
    if (!m || m->magic != MAGIC_LIBRARY) return CUDA_ERROR_INVALID_HANDLE;
    module_free(m);
    return CUDA_SUCCESS;
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    struct CUmod_st *m = (struct CUmod_st *)library;
    if (!m || m->magic != MAGIC_LIBRARY) return CUDA_ERROR_INVALID_HANDLE;
    struct CUfunc_st *f;
    CUresult r = module_function(m, name, &f);
    if (!r && pKernel)
        *pKernel = (CUkernel)f; /* a CUkernel is launchable as a CUfunction, as in CUDA 12 */
    return r;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    struct CUfunc_st *f = (struct CUfunc_st *)kernel;
    if (!f || f->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    *pFunc = f;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
    if (!hfunc || hfunc->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        *pi = 1024;
        break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS:
        *pi = 32;
        break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
        *pi = 80;
        break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        *pi = hfunc->max_dynamic_shared;
        break;
    default:
        *pi = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
    if (!hfunc || hfunc->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        hfunc->max_dynamic_shared = value;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    if (!hfunc || hfunc->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    *name = hfunc->name;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                     size_t dynamicSMemSize) {
    (void)dynamicSMemSize;
    if (!func || func->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!numBlocks || blockSize <= 0) return CUDA_ERROR_INVALID_VALUE;
    int b = 2048 / blockSize;
    *numBlocks = b > 32 ? 32 : (b < 1 ? 1 : b);
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                          CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                          size_t dynamicSMemSize, int blockSizeLimit) {
    (void)blockSizeToDynamicSMemSize;
    (void)dynamicSMemSize;
    struct CUctx_st *c;
    SIM_TRY(sim_current_ctx(&c));
    if (!func || func->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    if (!minGridSize || !blockSize) return CUDA_ERROR_INVALID_VALUE;
    int block = blockSizeLimit > 0 && blockSizeLimit < 1024 ? blockSizeLimit : 1024;
    *blockSize = block;
    uint32_t sms = sim_dev(c->slot)->sms; /* shared state: bounded before the product */
    *minGridSize = (int)(sms < SIM_MAX_SMS ? sms : SIM_MAX_SMS) * (2048 / block);
    return CUDA_SUCCESS;
}

CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) {
    if (!hfunc || hfunc->magic != MAGIC_FUNC) return CUDA_ERROR_INVALID_HANDLE;
    return config >= 0 && config <= 3 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
