/* Device memory through a pool or not, for the pool tests: prints "ready <pid>", then runs one
 * command a line and answers "ok" to each:
 *   pool N      pool_alloc(N) from libfakepool.so (chunks of 32 MiB taken through libfakert.so)
 *   plain N     fakert_malloc(N): a plain cudaMalloc, through the same libfakert.so
 *   driver N    cuMemAlloc_v2(N) straight from here
 *   release     pool_release(): the pool's chunks back to the driver
 *   leak pool|plain N MS   from now on, N bytes that way every MS milliseconds (a thread), never freed
 * EOF exits 0. Built with frame pointers: the probe walks the user stack of allocations. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
int cuMemAlloc_v2(CUdeviceptr *, size_t);
int fakert_malloc(CUdeviceptr *, size_t);
CUdeviceptr pool_alloc(size_t);
void pool_release(void);

volatile int allocs_calls;

__attribute__((noinline)) static void plain(size_t n) {
    CUdeviceptr p;
    fakert_malloc(&p, n);
    allocs_calls++;
}

__attribute__((noinline)) static void pooled(size_t n) {
    pool_alloc(n);
    allocs_calls++;
}

struct leak { int pool; size_t bytes; long ms; };

static void *leaker(void *arg) {
    struct leak *l = arg;
    struct timespec ts = {l->ms / 1000, (l->ms % 1000) * 1000000L};
    for (;;) {
        if (l->pool)
            pooled(l->bytes);
        else
            plain(l->bytes);
        nanosleep(&ts, NULL);
    }
    return NULL;
}

int main(void) {
    char line[128], kind[16];
    unsigned long long n;
    long ms;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d\n", (int)getpid());
    while (fgets(line, sizeof line, stdin)) {
        if (sscanf(line, "pool %llu", &n) == 1)
            pooled(n);
        else if (sscanf(line, "plain %llu", &n) == 1)
            plain(n);
        else if (sscanf(line, "driver %llu", &n) == 1) {
            CUdeviceptr p;
            cuMemAlloc_v2(&p, n);
        } else if (strncmp(line, "release", 7) == 0)
            pool_release();
        else if (sscanf(line, "leak %15s %llu %ld", kind, &n, &ms) == 3) {
            struct leak *l = malloc(sizeof *l);
            pthread_t t;
            l->pool = strcmp(kind, "pool") == 0;
            l->bytes = n;
            l->ms = ms;
            pthread_create(&t, NULL, leaker, l);
        } else {
            printf("unknown command: %s", line);
            continue;
        }
        printf("ok\n");
    }
    return 0;
}
