/* A stand-in libcuda.so.1 for the eBPF tests: exports hooked CUDA driver API functions with their
 * true signatures from cuda.h (x86-64 SysV), so the probe decodes the same registers it decodes in
 * the real driver. Every function returns fake_result (set with fakecuda_set_result) and does the
 * least the real one does: allocations hand out fake device pointers and write them through the
 * pointer argument.
 *
 * Deliberately NOT exported (the probe must list them as skipped): cuGraphLaunch_ptsz,
 * cuMemcpy3DAsync_v2_ptsz, and most _ptds/_ptsz forms.
 *
 * Kernel handles (mirrored in driver.c and test_ebpf_cuda.py): cuModuleGetFunction gives
 * "_Z10add_kernelPfi" 0xa000 and "coop_reduce" 0xc000; cuLibraryGetKernel gives "gemm_bf16" the
 * CUkernel 0xb100 and any name longer than 127 bytes 0xd100; cuKernelGetFunction(k) gives k - 0x100.
 * Other names get 0x1234 (functions) and 0x4321 (kernels).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUctx_st *CUcontext;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
typedef struct CUmemAllocationProp_st CUmemAllocationProp;

static volatile CUresult fake_result = 0;
static CUdeviceptr next_dptr = 0x7f0000000000ULL;
static CUmemGenericAllocationHandle next_handle = 0x1000;
volatile unsigned long long fake_work;  /* side effect so calls are not optimised away */

void fakecuda_set_result(CUresult r) { fake_result = r; }

static CUdeviceptr fake_alloc(size_t n) {
    CUdeviceptr p = __atomic_fetch_add(&next_dptr, (n + 255) & ~255ULL, __ATOMIC_RELAXED);
    return p;
}

#define RET do { fake_work++; return fake_result; } while (0)

/* launches */
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream s, void **params, void **extra) { RET; }
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned smem, CUstream s, void **params, void **extra) { RET; }
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    fake_work += config->gridDimX; RET;
}
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) { RET; }
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned smem, CUstream s, void **params) { RET; }
CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) { RET; }

/* allocations */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (fake_result == 0) *dptr = fake_alloc(bytesize);
    RET;
}
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (fake_result == 0) *dptr = fake_alloc(bytesize);
    RET;
}
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, unsigned elt) {
    if (fake_result == 0) {
        *pPitch = (width + 511) & ~(size_t)511;
        *dptr = fake_alloc(*pPitch * height);
    }
    RET;
}
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    if (fake_result == 0) *dptr = fake_alloc(bytesize);
    RET;
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    if (fake_result == 0) *dptr = fake_alloc(bytesize);
    RET;
}
CUresult cuMemFree_v2(CUdeviceptr dptr) { RET; }
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { RET; }
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    if (fake_result == 0) *handle = next_handle++;
    RET;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { RET; }
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) { RET; }
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { RET; }

/* copies and sets */
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { RET; }
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { RET; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { RET; }
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { RET; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { RET; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { RET; }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { RET; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { RET; }
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) { RET; }
CUresult cuMemsetD16_v2(CUdeviceptr dst, unsigned short us, size_t n) { RET; }
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int ui, size_t n) { RET; }
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) { RET; }
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) { RET; }
CUresult cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char uc, size_t w, size_t h) { RET; }

/* synchronisation and names */
CUresult cuStreamSynchronize(CUstream s) { RET; }
CUresult cuStreamSynchronize_ptsz(CUstream s) { RET; }
CUresult cuCtxSynchronize(void) { RET; }
CUresult cuEventSynchronize(CUevent e) { RET; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (fake_result == 0) {
        uintptr_t h = 0x1234;
        if (strcmp(name, "_Z10add_kernelPfi") == 0) h = 0xa000;
        else if (strcmp(name, "coop_reduce") == 0) h = 0xc000;
        *f = (CUfunction)h;
    }
    RET;
}
CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name) {
    if (fake_result == 0) {
        uintptr_t h = 0x4321;
        if (strcmp(name, "gemm_bf16") == 0) h = 0xb100;
        else if (strlen(name) > 127) h = 0xd100;
        *k = (CUkernel)h;
    }
    RET;
}
CUresult cuKernelGetFunction(CUfunction *f, CUkernel k) {
    if (fake_result == 0) *f = (CUfunction)((uintptr_t)k - 0x100);
    RET;
}
