/* A stand-in for libcudart in the pool tests: fakert_malloc/fakert_free call the fake libcuda's
 * cuMemAlloc_v2/cuMemFree_v2, as cudaMalloc/cudaFree call the driver. Both the pool (fakepool.c)
 * and plain callers (allocs.c) go through it, so the caller of cuMemAlloc_v2 is this library either
 * way and only the frames beyond it tell pooled from plain, as with PyTorch over libcudart.
 * Built with frame pointers (CUDA 13's libcudart keeps them). */
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);

volatile int fakert_calls;  /* a side effect: the calls are not tail calls (the walk keeps this frame) */

__attribute__((noinline)) int fakert_malloc(CUdeviceptr *p, size_t n) {
    int r = cuMemAlloc_v2(p, n);
    fakert_calls++;
    return r;
}

__attribute__((noinline)) int fakert_free(CUdeviceptr p) {
    int r = cuMemFree_v2(p);
    fakert_calls++;
    return r;
}
