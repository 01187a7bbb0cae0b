/* A process that makes a known number of hooked CUDA driver calls as fast as it can, for
 * bench/ebpf_throughput.py. Linked against tests/ebpf/fakecuda.c (a libcuda.so.1 with the true
 * signatures): what is measured is the probe's cost per call, not a GPU's.
 * Usage: hooked_calls launch|sync THREADS CALLS_PER_THREAD; prints "ready PID", waits for a line,
 * runs, prints "done SECONDS". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                        void **, void **);
CUresult cuStreamSynchronize(void *);

static long calls;
static int sync_mode;

static void *run(void *arg) {
    for (long i = 0; i < calls; i++) {
        if (sync_mode)
            cuStreamSynchronize(0);
        else
            cuLaunchKernel((void *)0x1000, 64, 1, 1, 128, 1, 1, 0, 0, 0, 0);
    }
    return NULL;
}

int main(int argc, char **argv) {
    char line[16];
    if (argc != 4) {
        fprintf(stderr, "usage: %s launch|sync THREADS CALLS_PER_THREAD\n", argv[0]);
        return 2;
    }
    sync_mode = strcmp(argv[1], "sync") == 0;
    int threads = atoi(argv[2]);
    calls = atol(argv[3]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %d\n", (int)getpid());
    if (!fgets(line, sizeof line, stdin))
        return 1;
    struct timespec t0, t1;
    pthread_t t[256];
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < threads && i < 256; i++)
        pthread_create(&t[i], NULL, run, NULL);
    for (int i = 0; i < threads && i < 256; i++)
        pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("done %.6f\n", (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
