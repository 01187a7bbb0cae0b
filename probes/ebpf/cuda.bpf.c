// gpuwatch eBPF probe on libcuda: per (process, API) counters, latency histograms and live
// allocations, aggregated in the kernel. Compiled by bcc; the loader replaces the two markers
// below with the text from symbols.py (struct layouts and constants, then one entry and one
// return program per hooked symbol), so layouts and the symbol table are defined in one place.
#include <uapi/linux/ptrace.h>

GW_DEFINITIONS

// 1-based argument n of the hooked function, x86-64 System V (rdi, rsi, rdx, rcx, r8, r9).
#define ARG(n) ((u64)PT_REGS_PARM##n(ctx))

// Hash maps are not preallocated: their sizes are caps, memory follows use.
BPF_F_TABLE("hash", struct gw_api_key, struct gw_api_stats, stats, GW_STATS_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct gw_call_key, struct gw_call, inflight, GW_CALLS_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct gw_live_key, struct gw_live, live, GW_LIVE_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", u32, s64, live_bytes, GW_LIVE_PIDS_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct gw_hist_key, u64, hist, GW_HIST_MAX, BPF_F_NO_PREALLOC);
// What could not be recorded because a map was full: 0 stats, 1 in-flight calls, 2 live
// allocations. (A full histogram map loses buckets silently.)
BPF_ARRAY(dropped, u64, 3);

static __always_inline void gw_drop(int what) {
    dropped.atomic_increment(what);
}

static __always_inline int gw_enter(struct pt_regs *ctx, u32 api, u64 bytes, u64 ptr, u64 aux) {
    struct gw_call_key k = {};
    k.pid_tgid = bpf_get_current_pid_tgid();
    k.api = api;
    struct gw_call c = {};
    c.bytes = bytes;
    c.ptr = ptr;
    c.aux = aux;
    c.ts = bpf_ktime_get_ns();
    if (inflight.update(&k, &c) != 0)
        gw_drop(1);
    return 0;
}

static __always_inline void gw_add_live(u32 pid, s64 delta) {
    s64 zero = 0;
    s64 *v = live_bytes.lookup_or_try_init(&pid, &zero);
    if (v)
        __sync_fetch_and_add(v, delta);
}

static __always_inline int gw_return(struct pt_regs *ctx, u32 api, u32 op) {
    u64 now = bpf_ktime_get_ns();
    struct gw_call_key k = {};
    k.pid_tgid = bpf_get_current_pid_tgid();
    k.api = api;
    struct gw_call *cp = inflight.lookup(&k);
    if (!cp)
        return 0;  // entered before we attached: not counted (nothing to time it by)
    struct gw_call c = *cp;
    inflight.delete(&k);

    u32 pid = k.pid_tgid >> 32;
    int rc = (int)PT_REGS_RC(ctx);  // CUresult
    u64 ns = now - c.ts;
    u64 bytes = c.bytes;

    if (op == GW_OP_ALLOC || op == GW_OP_ALLOC_PITCH || op == GW_OP_CREATE) {
        if (op == GW_OP_ALLOC_PITCH) {
            u64 pitch = 0;
            if (rc == 0 && c.aux)
                bpf_probe_read_user(&pitch, sizeof(pitch), (void *)c.aux);
            bytes = pitch * c.bytes;  // pitch * height; 0 when the call failed
        }
        u64 p = 0;
        if (rc == 0 && c.ptr && bpf_probe_read_user(&p, sizeof(p), (void *)c.ptr) == 0 && p) {
            struct gw_live_key lk = {};
            lk.pid = pid;
            lk.kind = op == GW_OP_CREATE ? GW_KIND_HANDLE : GW_KIND_DPTR;
            lk.ptr = p;
            s64 delta = bytes;
            struct gw_live *old = live.lookup(&lk);
            if (old)
                delta -= old->size;  // a free we did not see: the new size replaces the old
            struct gw_live lv = {};
            lv.size = bytes;
            lv.ts = now;
            lv.api = api;
            if (live.update(&lk, &lv) == 0)
                gw_add_live(pid, delta);
            else
                gw_drop(2);
        }
    } else if (op == GW_OP_FREE || op == GW_OP_RELEASE) {
        bytes = 0;
        // Removed at return, only when the free succeeded. (Another thread reusing the same
        // address between the driver's release and this probe would be lost: a window of
        // microseconds, accepted.)
        if (rc == 0 && c.ptr) {
            struct gw_live_key lk = {};
            lk.pid = pid;
            lk.kind = op == GW_OP_RELEASE ? GW_KIND_HANDLE : GW_KIND_DPTR;
            lk.ptr = c.ptr;
            struct gw_live *old = live.lookup(&lk);
            if (old) {
                bytes = old->size;
                live.delete(&lk);
                gw_add_live(pid, -(s64)bytes);
            }
        }
    }

    struct gw_api_key sk = {};
    sk.pid = pid;
    sk.api = api;
    struct gw_api_stats zero = {};
    struct gw_api_stats *s = stats.lookup_or_try_init(&sk, &zero);
    if (s) {
        __sync_fetch_and_add(&s->calls, 1);
        if (rc != 0)
            __sync_fetch_and_add(&s->errors, 1);
        __sync_fetch_and_add(&s->ns, ns);
        __sync_fetch_and_add(&s->bytes, bytes);
    } else {
        gw_drop(0);
    }

    struct gw_hist_key hk = {};
    hk.pid = pid;
    hk.api = api;
    hk.slot = bpf_log2l(ns);
    hist.atomic_increment(hk);
    return 0;
}

GW_PROGRAMS
