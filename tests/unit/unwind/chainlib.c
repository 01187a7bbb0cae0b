/* The library half of the unwinder's test chain (test_unwind.py): built with -O2
 * -fomit-frame-pointer, as vendor libraries are. lib_a -> lib_b (keeps a frame pointer: an
 * rbp-based CFA) -> lib_c (a big frame) -> snap, which copies the registers and the top of the
 * stack at its first instruction, as the eBPF probe does at a hooked function's. */
#include <string.h>

struct snapshot { unsigned long sp, bp, ip; unsigned char stack[8192]; };
void snap(struct snapshot *s);
volatile int chain_calls;

/* at entry: rsp points at the return address; rep movsb copies 8 KiB from there */
__asm__(".text\n.globl snap\n.type snap,@function\nsnap:\n.cfi_startproc\n.Lsnap:\n"
        "mov %rsp, 0(%rdi)\nmov %rbp, 8(%rdi)\nlea .Lsnap(%rip), %rax\nmov %rax, 16(%rdi)\n"
        "lea 24(%rdi), %rdi\nmov %rsp, %rsi\nmov $8192, %ecx\nrep movsb\nret\n.cfi_endproc\n.size snap, .-snap\n");

__attribute__((noinline)) static void lib_c(struct snapshot *s) {
    volatile char big[1000];
    big[0] = 1;
    snap(s);
    chain_calls += big[0];
}

__attribute__((noinline, optimize("no-omit-frame-pointer"))) static void lib_b(struct snapshot *s) {
    lib_c(s);
    chain_calls++;
}

__attribute__((noinline)) void lib_a(struct snapshot *s) {
    lib_b(s);
    chain_calls++;
}
