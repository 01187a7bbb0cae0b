/* A pool allocator for the pool tests (libfakepool.so): takes chunks of POOL_CHUNK bytes (or the
 * request, when larger) from the driver through fakert_malloc and hands out pieces of them;
 * pool_free keeps the memory in the pool, pool_release gives every chunk back (empty_cache). The
 * tests name it as a pool in ebpf.pool_libraries; mirrored in test_ebpf_pools.py. */
#include <stddef.h>

typedef unsigned long long CUdeviceptr;
int fakert_malloc(CUdeviceptr *, size_t);
int fakert_free(CUdeviceptr);

#define POOL_CHUNK (32ULL << 20)
#define MAX_CHUNKS 4096

static CUdeviceptr chunks[MAX_CHUNKS];
static int nchunks;
static size_t room;   /* bytes left in the last chunk */
static CUdeviceptr next;
volatile int pool_calls;

__attribute__((noinline)) static int pool_grow(size_t n) {
    size_t size = n > POOL_CHUNK ? n : POOL_CHUNK;
    CUdeviceptr p = 0;
    if (nchunks == MAX_CHUNKS || fakert_malloc(&p, size) != 0)
        return -1;
    chunks[nchunks++] = p;
    next = p;
    room = size;
    pool_calls++;
    return 0;
}

CUdeviceptr pool_alloc(size_t n) {
    n = (n + 511) & ~511ULL;
    if (n > room && pool_grow(n) != 0)
        return 0;
    CUdeviceptr p = next;
    next += n;
    room -= n;
    pool_calls++;
    return p;
}

void pool_free(CUdeviceptr p) { (void)p; pool_calls++; }  /* kept in the pool */

void pool_release(void) {
    for (int i = 0; i < nchunks; i++)
        fakert_free(chunks[i]);
    nchunks = 0;
    room = 0;
    pool_calls++;
}
