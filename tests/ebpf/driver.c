/* Drives the fake libcuda.so.1 with a known workload for the eBPF tests.
 *
 * Protocol on stdin/stdout: prints "ready <pid>", waits for a line, runs the workload once, prints
 * "done", then waits for another line or EOF and exits 0. With the argument "early", the handle
 * of kernel C is fetched (cuModuleGetFunction "coop_reduce") before "ready" instead of in the
 * workload: a probe attached after "ready" never sees its name. With "edge", the workload is
 * edge() instead: grids of one block in two dimensions but not the third, and device addresses the
 * allocator hands out again (EDGE_* in test_ebpf_cuda.py). With "graphs", the kernels are named
 * and one graph is captured and instantiated before "ready", and the workload is graphs_work():
 * CUDA graphs built every way the probe follows (GRAPH_* in test_ebpf_graphs.py). The counts below are mirrored in
 * test_ebpf_cuda.py (EXPECTED); keep the two in step. Counts are primes where it matters, so an
 * off-by-something cannot pass by accident.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUfunction, *CUstream, *CUevent, *CUgraphExec, *CUmodule, *CUlibrary, *CUkernel;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2

void fakecuda_set_result(CUresult r);
void fakecuda_reuse_next(CUdeviceptr p);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, CUstream, void **);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const void *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned int, size_t);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned int, size_t, CUstream);
CUresult cuMemsetD2D8_v2(CUdeviceptr, size_t, unsigned char, size_t, size_t);
/* cuda.h's copy descriptors, field for field (CUmemorytype is an enum, CUarray a pointer) */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;
CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *);
CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *);
CUresult cuStreamSynchronize(CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuEventSynchronize(CUevent);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLibraryGetKernel(CUkernel *, CUlibrary, const char *);
CUresult cuKernelGetFunction(CUfunction *, CUkernel);


#define N_ALLOC 307
#define N_FREE 211

static CUdeviceptr ptrs[N_ALLOC];
static char host[65536];

/* Kernel handles, as fakecuda.c hands them out for these names (mirrored in test_ebpf_cuda.py
 * KERNELS, offsets from 0x10000000): A +0xa000 and C +0xc000 from cuModuleGetFunction; B +0xb000 and D +0xd000 from
 * cuLibraryGetKernel + cuKernelGetFunction. D's name is longer than the probe keeps. */
static CUfunction KERNEL_A, KERNEL_B, KERNEL_C, KERNEL_D;
static int early;
#define NAME_D "_ZN5flash3fwd24flash_fwd_splitkv_kernelIN7cutlass10bfloat16_tELi128ELi64ELi128ELi4ELb0ELb0ELb1ELb1ELb0ELb0ELb1ELb0ELb0ELb1ELb1ELb0ELb1EEEvNS0_16Flash_fwd_paramsE"
#define STREAM(n) ((CUstream)(0x5000 + (n)))

static void names(void) {
    CUkernel k = 0;
    CUfunction bogus = (CUfunction)0xe000;
    cuModuleGetFunction(&KERNEL_A, 0, "_Z10add_kernelPfi");
    if (!early)
        cuModuleGetFunction(&KERNEL_C, 0, "coop_reduce");
    fakecuda_set_result(CUDA_ERROR_INVALID_VALUE);          /* a failing lookup: nothing is named */
    cuModuleGetFunction(&bogus, 0, "never_named");
    fakecuda_set_result(0);
    cuLibraryGetKernel(&k, 0, "gemm_bf16");
    cuKernelGetFunction(&KERNEL_B, k);
    cuLibraryGetKernel(&k, 0, NAME_D);
    cuKernelGetFunction(&KERNEL_D, k);
}

static void *launcher(void *arg) {
    /* D: grid (3,5,7) block (32,4,2) shm 1024: bz and shm in stack slots */
    for (int i = 0; i < 101; i++)
        cuLaunchKernel_ptsz(KERNEL_D, 3, 5, 7, 32, 4, 2, 1024, STREAM(4), 0, 0);
    return NULL;
}

static void work(void) {
    names();
    /* A: 1009 launches; the first with a grid of one block (degenerate), then grid (1056,1,1);
     * block (256,1,1), shm 0 */
    for (int i = 0; i < 1009; i++)
        cuLaunchKernel(KERNEL_A, i == 0 ? 1 : 1056, 1, 1, 256, 1, 1, 0, STREAM(1), 0, 0);
    /* B: 53 launches through cuLaunchKernelEx; the last one grid (7,3,2) block (128,2,1) shm 4096 */
    CUlaunchConfig cfg = {132, 1, 1, 384, 1, 1, 213188, STREAM(2), 0, 0};
    for (int i = 0; i < 52; i++)
        cuLaunchKernelEx(&cfg, KERNEL_B, 0, 0);
    CUlaunchConfig last = {7, 3, 2, 128, 2, 1, 4096, STREAM(2), 0, 0};
    cuLaunchKernelEx(&last, KERNEL_B, 0, 0);
    /* C: 11 degenerate launches, grid (1,1,1) block (64,1,1) shm 48 */
    for (int i = 0; i < 11; i++)
        cuLaunchCooperativeKernel(KERNEL_C, 1, 1, 1, 64, 1, 1, 48, STREAM(3), 0);
    for (int i = 0; i < 13; i++)
        cuGraphLaunch(0, 0);
    fakecuda_set_result(CUDA_ERROR_INVALID_VALUE);           /* 4 failing graph launches */
    for (int i = 0; i < 4; i++)
        cuGraphLaunch(0, 0);
    fakecuda_set_result(0);
    pthread_t t[4];                                          /* 4 x 101 cuLaunchKernel_ptsz */
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, launcher, NULL);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);

    /* 307 allocations of (i+1)*4096 bytes; the first 211 freed */
    for (int i = 0; i < N_ALLOC; i++)
        cuMemAlloc_v2(&ptrs[i], (size_t)(i + 1) * 4096);
    for (int i = 0; i < N_FREE; i++)
        cuMemFree_v2(ptrs[i]);
    fakecuda_set_result(CUDA_ERROR_OUT_OF_MEMORY);           /* 5 failing allocations of 1 GiB */
    for (int i = 0; i < 5; i++) {
        CUdeviceptr p;
        cuMemAlloc_v2(&p, 1ULL << 30);
    }
    fakecuda_set_result(CUDA_ERROR_INVALID_VALUE);           /* 3 failing frees of live pointers */
    for (int i = 0; i < 3; i++)
        cuMemFree_v2(ptrs[N_ALLOC - 1 - i]);
    fakecuda_set_result(0);
    CUdeviceptr p2;
    size_t pitch;
    for (int i = 0; i < 3; i++)                               /* 3 x pitch 1024 x height 17 */
        cuMemAllocPitch_v2(&p2, &pitch, 1000, 17, 4);
    for (int i = 0; i < 2; i++)
        cuMemAllocManaged(&p2, 1 << 20, 1);
    CUdeviceptr ap[4];
    for (int i = 0; i < 4; i++)
        cuMemAllocAsync(&ap[i], 8192, 0);
    for (int i = 0; i < 4; i++)
        cuMemFreeAsync(ap[i], 0);
    CUmemGenericAllocationHandle h[2];
    for (int i = 0; i < 2; i++)
        cuMemCreate(&h[i], 2 << 20, 0, 0);
    cuMemRelease(h[0]);

    for (int i = 0; i < 101; i++)
        cuMemcpyHtoD_v2(ptrs[N_ALLOC - 1], host, 65536);
    for (int i = 0; i < 103; i++)
        cuMemcpyDtoH_v2(host, ptrs[N_ALLOC - 1], 4096);
    for (int i = 0; i < 17; i++)
        cuMemcpyDtoD_v2(ptrs[N_ALLOC - 1], ptrs[N_ALLOC - 2], 1000);
    for (int i = 0; i < 19; i++)
        cuMemcpyAsync(ptrs[N_ALLOC - 1], ptrs[N_ALLOC - 2], 333, 0);
    for (int i = 0; i < 23; i++)
        cuMemcpyHtoDAsync_v2(ptrs[N_ALLOC - 1], host, 128, 0);
    for (int i = 0; i < 29; i++)
        cuMemsetD8_v2(ptrs[N_ALLOC - 1], 0, 100);
    for (int i = 0; i < 31; i++)
        cuMemsetD32_v2(ptrs[N_ALLOC - 1], 0, 100);
    for (int i = 0; i < 37; i++)
        cuMemsetD32Async(ptrs[N_ALLOC - 1], 0, 10, 0);
    for (int i = 0; i < 7; i++)
        cuMemsetD2D8_v2(ptrs[N_ALLOC - 1], 1024, 0, 100, 9);
    CUDA_MEMCPY2D c2 = {.srcPitch = 512, .dstPitch = 512, .WidthInBytes = 300, .Height = 7};
    for (int i = 0; i < 13; i++)                              /* 13 x 300 x 7 bytes */
        cuMemcpy2D_v2(&c2);
    CUDA_MEMCPY3D c3 = {.srcPitch = 64, .srcHeight = 8, .dstPitch = 64, .dstHeight = 8,
                        .WidthInBytes = 64, .Height = 8, .Depth = 3};
    for (int i = 0; i < 5; i++)                               /* 5 x 64 x 8 x 3 bytes */
        cuMemcpy3D_v2(&c3);
    for (int i = 0; i < 41; i++)
        cuStreamSynchronize(0);
    for (int i = 0; i < 43; i++)
        cuCtxSynchronize();
    for (int i = 0; i < 47; i++)
        cuEventSynchronize(0);
}

/* ---- CUDA graphs (mode "graphs", mirrored in test_ebpf_graphs.py) ---------------------------- */
typedef void *CUgraph, *CUgraphNode;
typedef struct {
    CUfunction func;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams, **extra;
    CUkernel kern;  /* v2: used when func is NULL */
    void *ctx;
} CUDA_KERNEL_NODE_PARAMS;
typedef struct {
    int type;  /* 0: kernel, 1: memcpy, ... */
    int reserved0[3];
    union { long long reserved1[29]; CUDA_KERNEL_NODE_PARAMS kernel; };
    long long reserved2;
} CUgraphNodeParams;
void fakecuda_reuse_exec(CUgraphExec);
CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphAddKernelNode_v2(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
CUresult cuGraphDestroy(CUgraph);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
#define EVENT(n) ((CUevent)(0x6000 + (n)))

static CUgraphExec X0;  /* instantiated before the probe attached: its content is unknown to it */

static void launch_a(CUstream s, int n) {
    for (int i = 0; i < n; i++)
        cuLaunchKernel(KERNEL_A, 1056, 1, 1, 256, 1, 1, 0, s, 0, 0);
}

static void graphs_before(void) {
    CUgraph g;
    cuStreamBeginCapture_v2(STREAM(9), 0);
    launch_a(STREAM(9), 3);
    cuStreamEndCapture(STREAM(9), &g);
    cuGraphInstantiateWithFlags(&X0, g, 0);
}

static void launch_graph(CUgraphExec x, int n) {
    for (int i = 0; i < n; i++)
        cuGraphLaunch(x, STREAM(1));
}

static void graphs_work(void) {
    CUgraph g1, g2, g3, g4, g5;
    CUgraphExec x1, x2, x3, x5;
    names();                                                 /* again, for the probe to see */
    /* 1. one stream captured: A x5 and B x2 are nodes; A x1 on another stream meanwhile runs */
    cuStreamBeginCapture_v2(STREAM(1), 0);
    launch_a(STREAM(1), 5);
    launch_a(STREAM(2), 1);
    CUlaunchConfig b = {7, 3, 2, 128, 2, 1, 4096, STREAM(1), 0, 0};
    for (int i = 0; i < 2; i++)
        cuLaunchKernelEx(&b, KERNEL_B, 0, 0);
    cuStreamEndCapture(STREAM(1), &g1);
    cuGraphInstantiateWithFlags(&x1, g1, 0);
    launch_graph(x1, 7);                                     /* A 35, B 14 */
    /* 2. a capture forked to a second stream through an event, joined back: C x1 (one block)
     * on S3, D x3 on S4; after it, D x2 on S4 runs (S4 is no longer captured) */
    cuStreamBeginCapture_v2(STREAM(3), 0);
    cuLaunchCooperativeKernel(KERNEL_C, 1, 1, 1, 64, 1, 1, 48, STREAM(3), 0);
    cuEventRecord(EVENT(1), STREAM(3));
    cuStreamWaitEvent(STREAM(4), EVENT(1), 0);
    for (int i = 0; i < 3; i++)
        cuLaunchKernel_ptsz(KERNEL_D, 3, 5, 7, 32, 4, 2, 1024, STREAM(4), 0, 0);
    cuEventRecord(EVENT(2), STREAM(4));
    cuStreamWaitEvent(STREAM(3), EVENT(2), 0);
    cuStreamEndCapture(STREAM(3), &g2);
    for (int i = 0; i < 2; i++)
        cuLaunchKernel_ptsz(KERNEL_D, 3, 5, 7, 32, 4, 2, 1024, STREAM(4), 0, 0);
    cuGraphInstantiateWithFlags(&x2, g2, 0);
    launch_graph(x2, 11);                                    /* C 11 (one block), D 33 */
    /* 3. an explicit graph: A (grid 7), B by its CUkernel (func NULL), C through cuGraphAddNode,
     * and a memcpy node (not a kernel) */
    cuGraphCreate(&g3, 0);
    CUgraphNode n1, n2, n3, n4;
    CUDA_KERNEL_NODE_PARAMS pa = {.func = KERNEL_A, 7, 1, 1, 128, 1, 1, 0};
    cuGraphAddKernelNode_v2(&n1, g3, 0, 0, &pa);
    CUDA_KERNEL_NODE_PARAMS pb = {.func = 0, 9, 1, 1, 64, 1, 1, 0, .kern = (CUkernel)((char *)KERNEL_B + 0x100)};
    cuGraphAddKernelNode_v2(&n2, g3, &n1, 1, &pb);
    CUgraphNodeParams pc = {.type = 0, .kernel = {.func = KERNEL_C, 1, 1, 1, 64, 1, 1, 48}};
    cuGraphAddNode(&n3, g3, &n2, 1, &pc);
    CUgraphNodeParams copy = {.type = 1};
    cuGraphAddNode(&n4, g3, &n3, 1, &copy);
    cuGraphInstantiateWithFlags(&x3, g3, 0);
    launch_graph(x3, 13);                                    /* A 13, B's CUkernel 13, C 13 */
    CUDA_KERNEL_NODE_PARAMS pd = {.func = KERNEL_D, 3, 5, 7, 32, 4, 2, 1024};
    cuGraphExecKernelNodeSetParams_v2(x3, n1, &pd);          /* A's node now runs D */
    launch_graph(x3, 3);                                     /* D 3, B's CUkernel 3, C 3 */
    /* 4. x1 updated to a graph of D x2 */
    cuStreamBeginCapture_v2(STREAM(1), 0);
    for (int i = 0; i < 2; i++)
        cuLaunchKernel_ptsz(KERNEL_D, 3, 5, 7, 32, 4, 2, 1024, STREAM(1), 0, 0);
    cuStreamEndCapture(STREAM(1), &g4);
    cuGraphExecUpdate_v2(x1, g4, 0);
    launch_graph(x1, 5);                                     /* D 10 */
    /* 5. x2 launched twice more and destroyed; its address is handed out again for g1's
     * instantiation x5 */
    launch_graph(x2, 2);                                     /* C 2, D 6 */
    cuGraphExecDestroy(x2);
    cuGraphDestroy(g2);
    fakecuda_reuse_exec(x2);
    cuGraphInstantiateWithFlags(&x5, g1, 0);
    launch_graph(x5, 4);                                     /* A 20, B 8 */
    /* 6. the graph made before the probe attached */
    launch_graph(X0, 17);
    /* 7. a capture that fails: no graph, and its launch neither ran nor is a node */
    cuStreamBeginCapture_v2(STREAM(5), 0);
    launch_a(STREAM(5), 1);
    fakecuda_set_result(CUDA_ERROR_INVALID_VALUE);
    cuStreamEndCapture(STREAM(5), &g5);
    fakecuda_set_result(0);
}

/* Edge cases the main workload does not have (mirrored in test_ebpf_cuda.py EDGE_*). */
/* ---- "server" (test_graph_server.py): a server's decode step captured once into a CUDA graph at
 * its start, never again, and replayed. "server early": the kernels fetched and SERVER_NODES launches
 * captured within microseconds of the first CUDA call (cuInit); "server warm": SERVER_WARM direct
 * launches first, a pause of SERVER_PAUSE_MS, then the same capture. "ready" comes after the
 * capture; the workload is SERVER_REPLAYS replays of it. */
#define SERVER_A 52  /* nodes of kernel A (grid 1056, block 256) */
#define SERVER_C 26  /* nodes of kernel C (grid 7, block 128, 64 bytes of shared memory), every third: 78 in all */
#define SERVER_WARM 200
#define SERVER_PAUSE_MS 1500
#define SERVER_REPLAYS 300
CUresult cuInit(unsigned);
static CUgraphExec SERVER_X;

static void server_start(int warm) {
    CUgraph g;
    cuInit(0);
    cuModuleGetFunction(&KERNEL_A, 0, "_Z10add_kernelPfi");
    cuModuleGetFunction(&KERNEL_C, 0, "coop_reduce");
    if (warm) {
        launch_a(STREAM(7), SERVER_WARM);
        usleep(SERVER_PAUSE_MS * 1000);
    }
    cuStreamBeginCapture_v2(STREAM(7), 0);
    for (int i = 0; i < SERVER_A + SERVER_C; i++) {
        if (i % 3 == 2)
            cuLaunchKernel(KERNEL_C, 7, 1, 1, 128, 1, 1, 64, STREAM(7), 0, 0);
        else
            cuLaunchKernel(KERNEL_A, 1056, 1, 1, 256, 1, 1, 0, STREAM(7), 0, 0);
    }
    cuStreamEndCapture(STREAM(7), &g);
    cuGraphInstantiateWithFlags(&SERVER_X, g, 0);
}

static void edge(void) {
    CUfunction e = 0, f = 0, g = 0;
    cuModuleGetFunction(&e, 0, "grid_z_only");    /* fakecuda's objects: +0x20000, +0x20400, +0x20800 */
    cuModuleGetFunction(&f, 0, "grid_y_only");
    cuModuleGetFunction(&g, 0, "one_block");
    for (int i = 0; i < 5; i++)                               /* grid (1,1,2): not degenerate */
        cuLaunchKernel(e, 1, 1, 2, 32, 1, 1, 0, STREAM(1), 0, 0);
    CUlaunchConfig y = {1, 3, 1, 64, 1, 1, 0, STREAM(2), 0, 0};
    for (int i = 0; i < 3; i++)                               /* grid (1,3,1): not degenerate */
        cuLaunchKernelEx(&y, f, 0, 0);
    CUlaunchConfig one = {1, 1, 1, 64, 1, 1, 0, STREAM(2), 0, 0};
    for (int i = 0; i < 2; i++)                               /* grid (1,1,1): degenerate */
        cuLaunchKernelEx(&one, g, 0, 0);

    /* a: 4096 B, kept. b: 12288 B, freed; its address is handed out again for c (8192 B), and
     * once more for d (20480 B) with no free between: a free the probe did not see, so d's size
     * replaces c's. Live: a + d = 24576 B in 2 allocations. */
    CUdeviceptr a, b, c, d;
    cuMemAlloc_v2(&a, 4096);
    cuMemAlloc_v2(&b, 12288);
    cuMemFree_v2(b);
    fakecuda_reuse_next(b);
    cuMemAlloc_v2(&c, 8192);
    fakecuda_reuse_next(b);
    cuMemAlloc_v2(&d, 20480);
}

/* "loop": on "go", prints "done" and then calls without end (until killed), each iteration the
 * same five calls in this order: two allocations (4096 bytes, freed below; 8192 bytes, kept),
 * a launch of A, the free, a stream synchronisation. A trace that ends meanwhile must report a
 * prefix of that sequence in every table (LOOP_* in test_trace_cli.py). */
static void loop(void) {
    for (;;) {
        CUdeviceptr a, b;
        cuMemAlloc_v2(&a, 4096);
        cuMemAlloc_v2(&b, 8192);
        cuLaunchKernel(KERNEL_A, 1056, 1, 1, 256, 1, 1, 0, STREAM(1), 0, 0);
        cuMemFree_v2(a);
        cuStreamSynchronize(STREAM(1));
        usleep(20);  /* tens of thousands of kept allocations a second, not millions */
    }
}

int main(int argc, char **argv) {
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    early = argc > 1 && strcmp(argv[1], "early") == 0;
    int edges = argc > 1 && strcmp(argv[1], "edge") == 0;
    int graphs = argc > 1 && strcmp(argv[1], "graphs") == 0;
    int server = argc > 1 && strcmp(argv[1], "server") == 0;
    if (server)
        server_start(argc > 2 && strcmp(argv[2], "warm") == 0);
    if (early)
        cuModuleGetFunction(&KERNEL_C, 0, "coop_reduce");
    if (graphs) {
        names();
        graphs_before();
    }
    printf("ready %d\n", (int)getpid());
    if (!fgets(line, sizeof line, stdin))
        return 1;
    if (argc > 1 && strcmp(argv[1], "loop") == 0) {
        cuModuleGetFunction(&KERNEL_A, 0, "_Z10add_kernelPfi");
        printf("done\n");
        loop();
    }
    if (server)
        launch_graph(SERVER_X, SERVER_REPLAYS);
    else if (edges)
        edge();
    else if (graphs)
        graphs_work();
    else
        work();
    printf("done\n");
    if (!fgets(line, sizeof line, stdin))
        return 0;
    return 0;
}
