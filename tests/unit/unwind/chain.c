/* The program half of the unwinder's test chain (test_unwind.py), -O2 -fomit-frame-pointer:
 * main -> outer -> lib_a (libchain.so) -> ... -> snap. Writes the snapshot to argv[1], says
 * "ready" and waits for a line (the test unwinds it while the process and its mappings live). */
#include <stdio.h>
#include <string.h>

struct snapshot { unsigned long sp, bp, ip; unsigned char stack[8192]; };
void lib_a(struct snapshot *s);
static struct snapshot s;
volatile int outer_calls;

__attribute__((noinline)) static void outer(void) {
    lib_a(&s);
    outer_calls++;
}

int main(int argc, char **argv) {
    volatile char pad[16384];  /* room above: snap copies 8 KiB upward from its frame */
    pad[0] = 0;
    outer();
    FILE *f = fopen(argv[1], "wb");
    fwrite(&s, sizeof s, 1, f);
    fclose(f);
    printf("ready\n");
    fflush(stdout);
    char line[8];
    fgets(line, sizeof line, stdin);
    return pad[0];
}
