/* A stand-in libcuda.so.1 for the eBPF tests: exports hooked CUDA driver API functions with their
 * true signatures from cuda.h (x86-64 SysV), so the probe decodes the same registers it decodes in
 * the real driver. Every function returns fake_result (set with fakecuda_set_result) and does the
 * least the real one does: allocations hand out fake device pointers and write them through the
 * pointer argument.
 *
 * Deliberately NOT exported (the probe must list them as skipped): cuGraphLaunch_ptsz,
 * cuMemcpy3DAsync_v2_ptsz, and most _ptds/_ptsz forms; of the graph calls, the v1 forms of
 * cuGraphAddKernelNode, cuGraphInstantiate and cuGraphExecUpdate.
 *
 * Kernel handles (mirrored in driver.c and test_ebpf_cuda.py), offsets from OBJECTS (0x10000000):
 * cuModuleGetFunction gives "_Z10add_kernelPfi" +0xa000 and "coop_reduce" +0xc000; cuLibraryGetKernel
 * gives "gemm_bf16" the CUkernel +0xb100 and any name longer than 127 bytes +0xd100;
 * cuKernelGetFunction(k) gives k - 0x100. Other names get fresh objects. Every handle points at an
 * object that holds its name, as in the real driver (see "Function and kernel objects" below).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* An address the next allocation hands out again (as a real allocator does after a free), once. */
static CUdeviceptr reuse_dptr = 0;
void fakecuda_reuse_next(CUdeviceptr p) { reuse_dptr = p; }

static CUdeviceptr fake_alloc(size_t n) {
    CUdeviceptr p = __atomic_exchange_n(&reuse_dptr, 0, __ATOMIC_RELAXED);
    if (p)
        return p;
    return __atomic_fetch_add(&next_dptr, (n + 255) & ~255ULL, __ATOMIC_RELAXED);
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
/* the descriptors are only passed through: their layout is driver.c's business (cuda.h's) */
CUresult cuMemcpy2D_v2(const void *pCopy) { RET; }
CUresult cuMemcpy3D_v2(const void *pCopy) { RET; }

/* synchronisation and names */
CUresult cuStreamSynchronize(CUstream s) { RET; }
CUresult cuStreamSynchronize_ptsz(CUstream s) { RET; }
CUresult cuCtxSynchronize(void) { RET; }
CUresult cuEventSynchronize(CUevent e) { RET; }
/* Function and kernel objects, laid out NOT like the real driver's (which keeps the name pointer at
 * +8 of the object, driver 580): here object +16 -> info, info +24 -> name, so the probe's
 * calibration (probes/ebpf/driver_names.py) has to find the chain (16, 24) itself. Objects live at
 * fixed addresses, so tests know the handles: OBJECTS + 0xa000 etc. */
#define OBJECTS 0x10000000UL
struct fake_info { uint64_t pad[3]; const char *name; };
struct fake_object { uint64_t magic, pad; struct fake_info *info; };
static uintptr_t next_object = OBJECTS + 0x20000;  /* objects for other names, 0x400 apart */

__attribute__((constructor)) static void map_objects(void) {
    mmap((void *)OBJECTS, 0x100000, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
}

static uintptr_t make_object(uintptr_t at, const char *name) {
    struct fake_info *info = calloc(1, sizeof *info);
    info->name = strdup(name);
    struct fake_object *o = (struct fake_object *)at;
    o->magic = 0xc0da;
    o->info = info;
    return at;
}

static uintptr_t fresh_object(void) {
    return __atomic_fetch_add(&next_object, 0x400, __ATOMIC_RELAXED);
}

static int is_object(const void *h) {
    uintptr_t a = (uintptr_t)h;
    return a >= OBJECTS && a < OBJECTS + 0x100000 && ((struct fake_object *)a)->magic == 0xc0da;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (fake_result == 0) {
        uintptr_t h;
        if (strcmp(name, "_Z10add_kernelPfi") == 0) h = OBJECTS + 0xa000;
        else if (strcmp(name, "coop_reduce") == 0) h = OBJECTS + 0xc000;
        else h = fresh_object();
        *f = (CUfunction)make_object(h, name);
    }
    RET;
}
/* a CUkernel at k, its CUfunction at k - 0x100 */
CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name) {
    if (fake_result == 0) {
        uintptr_t h;
        if (strcmp(name, "gemm_bf16") == 0) h = OBJECTS + 0xb100;
        else if (strlen(name) > 127) h = OBJECTS + 0xd100;
        else h = fresh_object() + 0x100;
        make_object(h - 0x100, name);
        *k = (CUkernel)make_object(h, name);
    }
    RET;
}
CUresult cuKernelGetFunction(CUfunction *f, CUkernel k) {
    if (fake_result == 0) *f = (CUfunction)((uintptr_t)k - 0x100);
    RET;
}

/* what the calibration needs: a context, a module from PTX, names */
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, int dev) { *ctx = (CUcontext)0x1; return 0; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return 0; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    *m = (CUmodule)0x2;
    return strstr((const char *)image, ".entry") ? 0 : 218; /* CUDA_ERROR_INVALID_PTX */
}
CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, void *jo, void **jv, unsigned nj, void *lo,
                           void **lv, unsigned nl) { *lib = (CUlibrary)0x3; return 0; }
CUresult cuFuncGetName(const char **name, CUfunction f) {
    if (!is_object(f)) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    *name = ((struct fake_object *)f)->info->name;
    return 0;
}
CUresult cuKernelGetName(const char **name, CUkernel k) { return cuFuncGetName(name, (CUfunction)k); }

/* CUDA graphs: handles from counters (graphs, nodes, executable graphs), nothing runs. The hooked
 * entry points have cuda.h's signatures; cuGraphCreate is not hooked (an explicit graph starts
 * empty). fakecuda_reuse_exec(x): the next instantiation hands out x again, as the driver may. */
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUkernelNodeParams_st CUDA_KERNEL_NODE_PARAMS;
typedef struct CUgraphNodeParams_st CUgraphNodeParams;
static uintptr_t next_graph = 0x30000000, next_node = 0x40000000, next_exec = 0x50000000;
static uintptr_t reuse_exec = 0;
void fakecuda_reuse_exec(CUgraphExec x) { reuse_exec = (uintptr_t)x; }
static uintptr_t fresh(uintptr_t *counter) { return __atomic_fetch_add(counter, 0x10, __ATOMIC_RELAXED); }

CUresult cuGraphCreate(CUgraph *g, unsigned flags) { *g = (CUgraph)fresh(&next_graph); return 0; }
CUresult cuStreamBeginCapture(CUstream s) { RET; }
CUresult cuStreamBeginCapture_v2(CUstream s, int mode) { RET; }
CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps, const void *edges,
                                     size_t n, int mode) { RET; }
CUresult cuStreamEndCapture(CUstream s, CUgraph *g) {
    if (fake_result == 0) *g = (CUgraph)fresh(&next_graph);
    RET;
}
CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t n,
                                 const CUDA_KERNEL_NODE_PARAMS *params) {
    if (fake_result == 0) *node = (CUgraphNode)fresh(&next_node);
    RET;
}
CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t n, CUgraphNodeParams *params) {
    if (fake_result == 0) *node = (CUgraphNode)fresh(&next_node);
    RET;
}
CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *params) { RET; }
CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec x, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *params) { RET; }
CUresult cuGraphInstantiateWithFlags(CUgraphExec *x, CUgraph g, unsigned long long flags) {
    if (fake_result == 0) {
        uintptr_t again = __atomic_exchange_n(&reuse_exec, 0, __ATOMIC_RELAXED);
        *x = (CUgraphExec)(again ? again : fresh(&next_exec));
    }
    RET;
}
CUresult cuGraphExecUpdate_v2(CUgraphExec x, CUgraph g, void *result_info) { RET; }
CUresult cuGraphClone(CUgraph *clone, CUgraph g) {
    if (fake_result == 0) *clone = (CUgraph)fresh(&next_graph);
    RET;
}
CUresult cuGraphDestroy(CUgraph g) { RET; }
CUresult cuGraphExecDestroy(CUgraphExec x) { RET; }
CUresult cuEventRecord(CUevent e, CUstream s) { RET; }
CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned flags) { RET; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) { RET; }
