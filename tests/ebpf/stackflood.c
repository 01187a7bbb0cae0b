/* Device allocations from many distinct call stacks, for the stack-map tests: `stackflood N free`
 * allocates and frees once from each of N distinct stacks (N <= 4096) and exits; `stackflood N keep`
 * keeps the N allocations, prints "done" and waits for EOF on stdin. Stack i goes through left()
 * or right() at each of 12 levels, by the bits of i: the return addresses differ, so the stacks do
 * (and each process's differ from the last's: ASLR). Built -O0 with frame pointers: no call is
 * inlined or made a tail call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long CUdeviceptr;
int cuMemAlloc_v2(CUdeviceptr *, size_t);
int cuMemFree_v2(CUdeviceptr);

#define LEVELS 12

static int keep;

static void at(unsigned bits, int level);

__attribute__((noinline)) static void left(unsigned bits, int level) { at(bits, level); }
__attribute__((noinline)) static void right(unsigned bits, int level) { at(bits, level); }

__attribute__((noinline)) static void at(unsigned bits, int level) {
    if (level == LEVELS) {
        CUdeviceptr p = 0;
        if (cuMemAlloc_v2(&p, 4096) == 0 && !keep)
            cuMemFree_v2(p);
        return;
    }
    if (bits & 1)
        left(bits >> 1, level + 1);
    else
        right(bits >> 1, level + 1);
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[2], "free") && strcmp(argv[2], "keep"))) {
        fprintf(stderr, "usage: stackflood N free|keep\n");
        return 2;
    }
    int n = atoi(argv[1]);
    if (n < 0 || n > (1 << LEVELS))
        n = 1 << LEVELS;
    keep = !strcmp(argv[2], "keep");
    for (int i = 0; i < n; i++)
        at((unsigned)i, 0);
    if (keep) {
        printf("done\n");
        fflush(stdout);
        char line[64];
        while (fgets(line, sizeof line, stdin))
            ;
    }
    return 0;
}
