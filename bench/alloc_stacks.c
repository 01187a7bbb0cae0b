/* Allocations from fresh or repeated stacks, for bench/stack_cost.py: prints "ready PID", then for
 * each line "N VARY" makes N cuMemAlloc_v2 + cuMemFree_v2 pairs and answers the thread CPU time
 * per pair in ns (the uprobes' time is the thread's system time). VARY=1: each allocation from
 * another stack depth (alloca), so each is a new (stack, caller, rsp) and has its stack copied;
 * VARY=0: every allocation from the same stack (copied once). Built -O2 -fomit-frame-pointer. */
#include <alloca.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
int cuMemAlloc_v2(CUdeviceptr *, size_t);
int cuMemFree_v2(CUdeviceptr);
volatile int sink;

__attribute__((noinline)) static void pair(void) {
    CUdeviceptr p = 0;
    cuMemAlloc_v2(&p, 4096);
    cuMemFree_v2(p);
    sink++;
}

__attribute__((noinline)) static void at_depth(int k) {
    volatile char *pad = alloca(16 * (size_t)k + 16);
    pad[0] = 0;
    pair();
    sink += pad[0];
}

int main(void) {
    char line[64];
    long n;
    int vary;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d\n", (int)getpid());
    while (fgets(line, sizeof line, stdin) && sscanf(line, "%ld %d", &n, &vary) == 2) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        for (long i = 0; i < n; i++)
            at_depth(vary ? (int)(i % 250) : 0);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n);
    }
    return 0;
}
