/* What a hostile user's process does to bloat the agent (issue 31, breaks 2 and 3), through the
 * fake libcuda (fakecuda.c), loaded with dlopen(RTLD_LOCAL) as a program may load any copy:
 *
 *   attacker graphs LIB NODES EXECS   after "go": capture one graph of NODES launches, each of a
 *                                      grid of its own (NODES distinct node configurations), and
 *                                      instantiate it EXECS times; each executable graph is launched
 *                                      once; then "done"
 *   attacker copies DIR N             load DIR/0/libcuda.so.1 ... DIR/N-1/libcuda.so.1 (private
 *                                      copies: N files, N inodes), then "ready" and wait
 *
 * Both print "ready PID" and exit at the end of stdin. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream, *CUgraph, *CUgraphExec, *CUfunction;
#define STREAM ((CUstream)0x5077)
#define KERNEL ((CUfunction)0xa000)

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "no %s: %s\n", name, dlerror());
        exit(2);
    }
    return f;
}

static int graphs(const char *path, int nodes, int execs) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    CUresult (*begin)(CUstream, int) = sym(lib, "cuStreamBeginCapture_v2");
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **) = sym(lib, "cuLaunchKernel");
    CUresult (*end)(CUstream, CUgraph *) = sym(lib, "cuStreamEndCapture");
    CUresult (*instantiate)(CUgraphExec *, CUgraph, unsigned long long) = sym(lib, "cuGraphInstantiateWithFlags");
    CUresult (*replay)(CUgraphExec, CUstream) = sym(lib, "cuGraphLaunch");
    char line[64];
    printf("ready %d\n", (int)getpid());
    if (!fgets(line, sizeof line, stdin))
        return 1;
    CUgraph g;
    begin(STREAM, 0);
    usleep(500000);  /* a capture turns the agent's sampled launch probes on: its nodes are all seen */
    for (int i = 0; i < nodes; i++)
        launch(KERNEL, 1 + i, 1, 1, 128, 1, 1, 0, STREAM, 0, 0);
    end(STREAM, &g);
    for (int i = 0; i < execs; i++) {
        CUgraphExec x;
        instantiate(&x, g, 0);
        replay(x, STREAM);
    }
    printf("done\n");
    while (fgets(line, sizeof line, stdin))
        ;
    return 0;
}

static int copies(const char *dir, int n) {
    char path[4096], line[64];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%d/libcuda.so.1", dir, i);
        if (!dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
            fprintf(stderr, "%s\n", dlerror());
            return 2;
        }
    }
    printf("ready %d\n", (int)getpid());
    while (fgets(line, sizeof line, stdin))
        ;
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 5 && strcmp(argv[1], "graphs") == 0)
        return graphs(argv[2], atoi(argv[3]), atoi(argv[4]));
    if (argc == 4 && strcmp(argv[1], "copies") == 0)
        return copies(argv[2], atoi(argv[3]));
    fprintf(stderr, "usage: attacker graphs LIB NODES EXECS | attacker copies DIR N\n");
    return 2;
}
