// gpuwatch eBPF probe on libcuda: per (process, API) counters, latency histograms, live
// allocations, per-kernel launch configurations and kernel names, aggregated in the kernel. Compiled by bcc
// (in a child process, see compiler.py); the loader replaces the two markers below with the text from
// symbols.py (struct layouts, constants and hash maps, then the two programs gw_entry and gw_return,
// which learn the hooked symbol from the attach cookie), so layouts and the symbol table are defined
// in one place.
#include <uapi/linux/ptrace.h>

GW_DEFINITIONS

// 1-based argument n of the hooked function, x86-64 System V (rdi, rsi, rdx, rcx, r8, r9).
#define ARG(n) ((u64)PT_REGS_PARM##n(ctx))

// The user stacks that allocated (ids kept in live allocations) or launched (sampled): few distinct
// ones a process (an allocator has a handful of call sites). An id is the stack's hash modulo the
// map's size, and a stack whose bucket holds another one is refused (-EEXIST; it goes to
// stacks_overflow below): stacks no map entry holds any more are deleted by Python
// (Loader.reclaim_stacks), or a node that ran thousands of processes would fill both with dead ones.
BPF_STACK_TRACE(stacks, GW_STACKS_MAX);
// Where a stack goes when its bucket in `stacks` holds another (a new stack meets one of the n in
// the map n / 16,384 of the time): a second map holding only those, ids GW_STACKS_MAX + its own.
// A stack is then lost only when both buckets are taken.
BPF_STACK_TRACE(stacks_overflow, GW_STACKS_OVERFLOW_MAX);
// When each stack id (of both maps) was last taken (bpf_ktime_get_ns): a stack taken since Python
// read the entries that hold ids is not reclaimed (a call between that read and the delete).
BPF_ARRAY(stack_used, u64, GW_STACKS_MAX + GW_STACKS_OVERFLOW_MAX);
// One record per call (gw_event), for `gpuwatch trace --output`: written by return probes whose
// cookie has GW_COOKIE_EVENTS. The loader creates it with one page unless events are recorded.
BPF_RINGBUF_OUTPUT(events, GW_RINGBUF_PAGES);
// Scratch for one name (too big for the 512-byte BPF stack next to the rest of gw_return).
BPF_PERCPU_ARRAY(name_buf, struct gw_name, 1);
// What could not be recorded because a map was full: 0 stats, 1 in-flight calls, 2 live
// allocations, 3 kernels, 4 kernel names, 5 errors by return code, 6 per-call events (the ring
// buffer was full: the reader fell behind), 7 call stacks (allocations' and sampled launches'), 8 graph events, 9 captures
// (streams and events of captures too), 10 executable graphs' launches, 11 launch stacks, 12 NCCL communicators,
// 13 allocation stack copies (a process's USTACKS_PER_PID, or a map, full). (A full histogram map loses
// buckets silently.) Python sizes its reads from the map: keep GW_DROPPED_KINDS in step.
BPF_ARRAY(dropped, u64, GW_DROPPED_KINDS);
// frozen[0] != 0: every program returns at once, so the maps stop changing in one step (one map
// write) and a reader sees every count as of that instant, never one map ahead of another (the
// end of `gpuwatch trace`). Never set by the agent.
BPF_ARRAY(frozen, u32, 1);

static __always_inline int gw_frozen(void) {
    u32 zero = 0;
    u32 *f = frozen.lookup(&zero);
    return f && *f;
}

static __always_inline void gw_drop(int what) {
    dropped.atomic_increment(what);
}

// ---- CUDA graphs (see symbols.py, "CUDA graphs"). What a graph holds is followed in Python
// (graphs.py) from these events; the kernel side keeps only what a hot path must decide: which
// streams are being captured (a launch there adds a node and does not run) and how many times
// each executable graph was launched.
BPF_RINGBUF_OUTPUT(graph_events, GW_GRAPH_RINGBUF_PAGES);  // 8: dropped when full

static __always_inline struct gw_graph_event *gw_graph_event(u32 pid, u32 kind) {
    struct gw_graph_event *e = graph_events.ringbuf_reserve(sizeof(struct gw_graph_event));
    if (!e) {
        gw_drop(8);
        return 0;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->pid = pid;
    e->kind = kind;
    return e;
}

// The capture a stream is part of, 0 for none (an entry left by a capture that ended is removed).
static __always_inline u64 gw_capture_of(u32 pid, u64 stream) {
    struct gw_handle_key k = {};
    k.pid = pid;
    k.handle = stream;
    u64 *cid = capture_streams.lookup(&k);
    if (!cid)
        return 0;
    struct gw_handle_key ck = {};
    ck.pid = pid;
    ck.handle = *cid;
    if (!captures.lookup(&ck)) {
        capture_streams.delete(&k);
        return 0;
    }
    return ck.handle;
}

// cuEventRecord(event, stream) entry: an event recorded in a captured stream carries the capture
// to the streams that wait on it (the fork of a multi-stream capture); recorded elsewhere, not.
static __always_inline void gw_capture_record(u64 event, u64 stream) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct gw_handle_key k = {};
    k.pid = pid;
    k.handle = event;
    u64 cid = gw_capture_of(pid, stream);
    if (cid) {
        if (capture_events.update(&k, &cid) != 0)
            gw_drop(9);
    } else {
        capture_events.delete(&k);
    }
}

// cuStreamWaitEvent(stream, event) entry: waiting on an event of a capture joins the capture.
static __always_inline void gw_capture_join(u64 stream, u64 event) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct gw_handle_key k = {};
    k.pid = pid;
    k.handle = event;
    u64 *cid = capture_events.lookup(&k);
    if (!cid)
        return;
    u64 id = *cid;
    struct gw_handle_key ck = {};
    ck.pid = pid;
    ck.handle = id;
    if (!captures.lookup(&ck))
        return;
    struct gw_handle_key sk = {};
    sk.pid = pid;
    sk.handle = stream;
    if (capture_streams.update(&sk, &id) != 0)
        gw_drop(9);
}

// A launch into a captured stream: a kernel node of the graph being built, not a kernel that runs.
static __always_inline void gw_capture_node(u32 pid, u64 cid, u64 f, struct gw_launch_config *lc) {
    struct gw_handle_key ck = {};
    ck.pid = pid;
    ck.handle = cid;
    struct gw_capture *cap = captures.lookup(&ck);
    if (cap)
        __sync_fetch_and_add(&cap->nodes, 1);
    struct gw_graph_event *e = gw_graph_event(pid, GW_GE_NODE);
    if (!e)
        return;
    e->capture = cid;
    e->function = f;
    e->dims = lc->dims;
    e->shared_mem = lc->shared_mem;
    graph_events.ringbuf_submit(e, 0);
}

// cuGraphLaunch(exec, stream) entry: one more launch of that executable graph (an entry of its
// own when it was instantiated before the probe attached: serial 0, content unknown).
static __always_inline void gw_graph_launch(u64 exec) {
    struct gw_handle_key k = {};
    k.pid = bpf_get_current_pid_tgid() >> 32;
    k.handle = exec;
    struct gw_exec zero = {};
    struct gw_exec *x = execs.lookup_or_try_init(&k, &zero);
    if (!x) {
        gw_drop(10);
        return;
    }
    __sync_fetch_and_add(&x->launches, 1);
}

// A kernel node's function (a CUfunction, or the CUkernel at byte 56 of the v2/v3 params when
// func is NULL), grid, block and shared memory, from CUDA_KERNEL_NODE_PARAMS in user memory.
static __always_inline void gw_kernel_params(struct gw_graph_event *e, u64 params) {
    struct gw_kernel_params kp = {};
    if (bpf_probe_read_user(&kp, sizeof(kp), (void *)params) != 0)
        return;
    u64 f = kp.func;
    if (!f)
        bpf_probe_read_user(&f, sizeof(f), (void *)(params + 56));
    e->function = f;
    e->dims = kp.dims;
    e->shared_mem = kp.shared_mem;
}

// The serial and launches so far of the executable graph e->exec, into the event of a change to
// it: the launches before the change ran what it held before.
static __always_inline void gw_exec_launches(u32 pid, struct gw_graph_event *e) {
    if (!e->exec)
        return;
    struct gw_handle_key xk = {};
    xk.pid = pid;
    xk.handle = e->exec;
    struct gw_exec *x = execs.lookup(&xk);
    if (x) {
        e->serial = x->serial;
        e->count = x->launches;
    }
}

// What a graph call that returned rc did (c: its entry record; ops in symbols.py).
static __always_inline void gw_graph_op(u32 pid, u32 op, int rc, struct gw_call *c) {
    struct gw_graph_event *e = 0;
    u64 h = 0;
    if (op == GW_OP_CAPTURE_BEGIN) {
        if (rc != 0)
            return;
        u64 cid = c->ts;  // the capture's id: when it began, unique within a process
        struct gw_handle_key ck = {};
        ck.pid = pid;
        ck.handle = cid;
        struct gw_capture cap = {};
        cap.stream = c->ptr;
        if (captures.update(&ck, &cap) != 0) {
            gw_drop(9);
            return;
        }
        struct gw_handle_key sk = {};
        sk.pid = pid;
        sk.handle = c->ptr;
        if (capture_streams.update(&sk, &cid) != 0) {
            captures.delete(&ck);
            gw_drop(9);
            return;
        }
        e = gw_graph_event(pid, GW_GE_BEGIN);
        if (!e)
            return;
        e->capture = cid;
        e->graph = c->aux;  // cuStreamBeginCaptureToGraph: the graph it adds to
    } else if (op == GW_OP_CAPTURE_END) {
        struct gw_handle_key sk = {};
        sk.pid = pid;
        sk.handle = c->ptr;
        u64 *cidp = capture_streams.lookup(&sk);
        if (!cidp)
            return;  // began before the probe attached
        struct gw_handle_key ck = {};
        ck.pid = pid;
        ck.handle = *cidp;
        capture_streams.delete(&sk);
        struct gw_capture *cap = captures.lookup(&ck);
        u64 nodes = cap ? cap->nodes : 0;
        captures.delete(&ck);
        if (rc == 0 && c->aux)
            bpf_probe_read_user(&h, sizeof(h), (void *)c->aux);
        e = gw_graph_event(pid, GW_GE_END);
        if (!e)
            return;
        e->capture = ck.handle;
        e->graph = h;  // 0: the capture failed (invalidated), no graph
        e->count = nodes;
    } else if (op == GW_OP_GRAPH_ADD_KERNEL || op == GW_OP_GRAPH_ADD_NODE) {
        if (rc != 0 || !c->ptr || !c->aux || bpf_probe_read_user(&h, sizeof(h), (void *)c->ptr) != 0)
            return;
        u64 params = c->aux;
        if (op == GW_OP_GRAPH_ADD_NODE) {  // CUgraphNodeParams: type, then the kernel's params at 16
            u32 type = 1;
            if (bpf_probe_read_user(&type, sizeof(type), (void *)params) != 0 || type != 0)
                return;  // not a kernel node (CU_GRAPH_NODE_TYPE_KERNEL is 0)
            params += 16;
        }
        e = gw_graph_event(pid, GW_GE_ADD);
        if (!e)
            return;
        e->graph = c->aux2;
        e->node = h;
        gw_kernel_params(e, params);
    } else if (op == GW_OP_GRAPH_SET_KERNEL) {
        if (rc != 0 || !c->aux)
            return;
        e = gw_graph_event(pid, GW_GE_SET);
        if (!e)
            return;
        e->exec = c->aux2;  // 0: a node of a graph; else of this executable graph
        e->node = c->ptr;
        gw_kernel_params(e, c->aux);
        gw_exec_launches(pid, e);
    } else if (op == GW_OP_GRAPH_INSTANTIATE) {
        if (rc != 0 || !c->ptr || bpf_probe_read_user(&h, sizeof(h), (void *)c->ptr) != 0 || !h)
            return;
        struct gw_handle_key xk = {};
        xk.pid = pid;
        xk.handle = h;
        struct gw_exec x = {};
        x.serial = c->ts;  // tells this executable graph from an earlier one at the same address
        if (execs.update(&xk, &x) != 0)
            gw_drop(10);
        e = gw_graph_event(pid, GW_GE_INSTANTIATE);
        if (!e)
            return;
        e->graph = c->aux;
        e->exec = h;
        e->serial = c->ts;
    } else if (op == GW_OP_GRAPH_CLONE || op == GW_OP_GRAPH_CREATE) {
        if (rc != 0 || !c->ptr || bpf_probe_read_user(&h, sizeof(h), (void *)c->ptr) != 0 || !h)
            return;
        e = gw_graph_event(pid, op == GW_OP_GRAPH_CLONE ? GW_GE_CLONE : GW_GE_CREATE);
        if (!e)
            return;
        e->graph = h;
        e->source = c->aux;
    } else if (op == GW_OP_EXEC_UPDATE) {
        if (rc != 0)
            return;
        e = gw_graph_event(pid, GW_GE_UPDATE);
        if (!e)
            return;
        e->exec = c->ptr;
        e->graph = c->aux;
        gw_exec_launches(pid, e);
    } else if (op == GW_OP_GRAPH_DESTROY) {
        if (rc != 0)
            return;
        e = gw_graph_event(pid, GW_GE_DESTROY);
        if (!e)
            return;
        e->graph = c->ptr;
    } else if (op == GW_OP_EXEC_DESTROY) {
        // Its final count goes with the event, so no launch is lost to the entry's removal. (A
        // thread instantiating a graph at the same address between the driver's free and this
        // probe would lose its entry: a window of microseconds, accepted.)
        struct gw_handle_key xk = {};
        xk.pid = pid;
        xk.handle = c->ptr;
        struct gw_exec *x = execs.lookup(&xk);
        if (rc != 0 || !x)
            return;
        u64 serial = x->serial, launches = x->launches;
        execs.delete(&xk);
        e = gw_graph_event(pid, GW_GE_EXEC_DESTROY);
        if (!e)
            return;
        e->exec = c->ptr;
        e->serial = serial;
        e->count = launches;
    }
    if (e) {
        e->rc = rc;
        graph_events.ringbuf_submit(e, 0);
    }
}

static __always_inline s32 gw_stack(struct pt_regs *ctx) {
    int id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (id == -17) {  // -EEXIST: its bucket holds another stack
        id = stacks_overflow.get_stackid(ctx, BPF_F_USER_STACK);
        if (id >= 0)
            id += GW_STACKS_MAX;
    }
    if (id < 0) {
        gw_drop(7);
        return id;
    }
    u32 slot = id;
    u64 *used = stack_used.lookup(&slot);
    if (used)
        *used = bpf_ktime_get_ns();
    return id;
}

// The return address: at a function's first instruction, at sp.
static __always_inline u64 gw_caller(struct pt_regs *ctx) {
    u64 ret = 0;
    bpf_probe_read_user(&ret, sizeof(ret), (void *)PT_REGS_SP(ctx));
    return ret;
}

// ---- allocation stacks without frame pointers (unwind.py unwinds them with the binaries' CFI).
// Scratch for one copy (8 KiB: far beyond the 512-byte BPF stack).
BPF_PERCPU_ARRAY(ustack_buf, struct gw_ustack, 1);

// The top GW_USTACK_CHUNKS x GW_USTACK_CHUNK bytes of the user stack and rip, rsp, rbp, at the
// allocating function's first instruction: once per (process, stack id, caller, rsp), at most
// GW_USTACKS_PER_PID copies per process; the copy waits in ustack_copies until Python unwinds it.
static __always_inline void gw_copy_stack(struct pt_regs *ctx, struct gw_call *c) {
    struct gw_ustack_key k = {};
    k.pid = bpf_get_current_pid_tgid() >> 32;
    k.stack = c->stack;
    k.caller = c->caller;
    k.sp = PT_REGS_SP(ctx);
    c->sp = k.sp;
    if (ustack_seen.lookup(&k))
        return;  // copied before: the same chain
    u32 zero = 0;
    u32 *n = ustack_count.lookup_or_try_init(&k.pid, &zero);
    if (!n || *n >= GW_USTACKS_PER_PID) {
        gw_drop(13);
        return;
    }
    int err = ustack_seen.insert(&k, &zero);
    if (err != 0) {
        if (err != -17)  // -EEXIST (another thread of the process is copying the same chain)
            gw_drop(13);
        return;
    }
    __sync_fetch_and_add(n, 1);
    struct gw_ustack *s = ustack_buf.lookup(&zero);
    if (!s)
        return;
    s->ip = PT_REGS_IP(ctx);
    s->sp = k.sp;
    s->bp = PT_REGS_FP(ctx);
    u32 len = 0;
    for (int i = 0; i < GW_USTACK_CHUNKS; i++) {
        if (bpf_probe_read_user((char *)s->data + i * GW_USTACK_CHUNK, GW_USTACK_CHUNK,
                                (void *)(k.sp + i * GW_USTACK_CHUNK)) != 0)
            break;
        len += GW_USTACK_CHUNK;
    }
    s->len = len;
    if (ustack_copies.update(&k, s) != 0)
        gw_drop(13);
}

// ---- launch call stacks (sampled). Scratch for one key (216 bytes: too big for the BPF stack).
BPF_PERCPU_ARRAY(lstack_buf, struct gw_launch_stack_key, 1);

// The Python frames of the launching thread, when its process is a CPython the agent can read
// (py_procs, see pyframes.py): the interpreter's thread states are walked for the one of this
// thread (the GIL may be released around the call), then its frames, innermost first.
static __always_inline void gw_py_frames(struct gw_py *py, struct gw_launch_stack_key *k) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 interp = 0, ts = 0, frame = 0;
    if (bpf_probe_read_user(&interp, sizeof(interp), (void *)py->interp_ptr) != 0 || !interp)
        return;
    if (bpf_probe_read_user(&ts, sizeof(ts), (void *)(interp + py->threads_head)) != 0)
        return;
    int found = 0;
    for (int i = 0; i < GW_PY_THREADS; i++) {
        if (!ts)
            return;
        u64 id = 0;
        bpf_probe_read_user(&id, sizeof(id), (void *)(ts + py->native_thread_id));
        if ((u32)id == tid) {
            found = 1;
            break;
        }
        if (bpf_probe_read_user(&ts, sizeof(ts), (void *)(ts + py->next)) != 0)
            return;
    }
    if (!found)
        return;
    if (py->cframe != GW_PY_NONE) {  // 3.11, 3.12: the current frame is in the _PyCFrame
        if (bpf_probe_read_user(&ts, sizeof(ts), (void *)(ts + py->cframe)) != 0 || !ts)
            return;
    }
    if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(ts + py->current_frame)) != 0)
        return;
    for (int j = 0; j < GW_PY_DEPTH; j++) {
        if (!frame)
            break;
        u64 code = 0, instr = 0;
        bpf_probe_read_user(&code, sizeof(code), (void *)(frame + py->code));
        bpf_probe_read_user(&instr, sizeof(instr), (void *)(frame + py->instr));
        k->code[j] = code;
        k->instr[j] = instr > code && instr - code < 0xFFFFFFFF ? (u32)(instr - code) : 0;
        if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(frame + py->previous)) != 0)
            break;
    }
}

// One sampled launch (or capture) of kernel f: counted under its native and Python stacks.
static __always_inline void gw_launch_sample(struct pt_regs *ctx, u32 pid, u64 f) {
    u32 zero = 0;
    struct gw_launch_stack_key *k = lstack_buf.lookup(&zero);
    if (!k)
        return;
    __builtin_memset(k, 0, sizeof(*k));
    k->pid = pid;
    k->handle = f;
    k->stack = gw_stack(ctx);
    k->caller = gw_caller(ctx);
    struct gw_py *py = py_procs.lookup(&pid);
    if (py) {
        gw_py_frames(py, k);
    } else {
        // a process not looked at yet: said once, so that Python registers it now, not at the
        // next collection (launches sampled before that have native frames only)
        u32 one = 1;
        if (py_seen.insert(&pid, &one) == 0) {
            struct gw_graph_event *e = gw_graph_event(pid, GW_GE_PROCESS);
            if (e)
                graph_events.ringbuf_submit(e, 0);
        }
    }
    u64 none = 0;
    u64 *n = launch_stacks.lookup_or_try_init(k, &none);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        gw_drop(11);
}

// Per-kernel aggregation at launch entry. DECODE_REGS: cuLaunchKernel / cuLaunchCooperativeKernel
// (f, gx, gy, gz, bx, by in registers; bz, sharedMem, hStream in the stack slots at sp+8, +16, +24:
// sp points at the return address at the first instruction). DECODE_CONFIG: cuLaunchKernelEx
// (config, f): grid, block, sharedMemBytes and hStream from the CUlaunchConfig in user memory.
// A configuration that cannot be read counts the launch with zeros (never "degenerate").
// The handle, grid and block also go into the call record c (for a timed launch's event).
static __always_inline void gw_launch(struct pt_regs *ctx, int decode, struct gw_call *c) {
    struct gw_launch_config lc = {};
    u64 f;
    if (decode == GW_DECODE_REGS) {
        f = ARG(1);
        lc.dims.grid_x = (u32)ARG(2);
        lc.dims.grid_y = (u32)ARG(3);
        lc.dims.grid_z = (u32)ARG(4);
        lc.dims.block_x = (u32)ARG(5);
        lc.dims.block_y = (u32)ARG(6);
        u64 slots[3] = {};  // bz, sharedMemBytes, hStream
        if (bpf_probe_read_user(slots, sizeof(slots), (void *)(PT_REGS_SP(ctx) + 8)) == 0) {
            lc.dims.block_z = (u32)slots[0];
            lc.shared_mem = (u32)slots[1];
            lc.stream = slots[2];
        } else {
            __builtin_memset(&lc.dims, 0, sizeof(lc.dims));
        }
    } else {
        f = ARG(2);
        if (bpf_probe_read_user(&lc, sizeof(lc), (void *)ARG(1)) != 0)
            __builtin_memset(&lc, 0, sizeof(lc));
    }
    c->ptr = f;
    c->dims = lc.dims;
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u64 cid = gw_capture_of(pid, lc.stream);
    if (cid) {
        gw_capture_node(pid, cid, f, &lc);
        gw_launch_sample(ctx, pid, f);  // where the graph's kernel was captured
        return;
    }
    struct gw_kernel_key kk = {};
    kk.pid = pid;
    kk.handle = f;
    struct gw_kernel zero = {};
    struct gw_kernel *kv = kernels.lookup_or_try_init(&kk, &zero);
    if (!kv) {
        gw_drop(3);
        return;
    }
    __sync_fetch_and_add(&kv->launches, 1);
    u64 n = kv->launches;  // (another thread's launch may come between: a sample more or less)
    if ((n & (n - 1)) == 0 && n <= GW_LAUNCH_SAMPLE_EVERY || (n & (GW_LAUNCH_SAMPLE_EVERY - 1)) == 0)
        gw_launch_sample(ctx, pid, f);
    if (lc.dims.grid_x == 1 && lc.dims.grid_y == 1 && lc.dims.grid_z == 1)
        __sync_fetch_and_add(&kv->degenerate, 1);
    // The last launch's configuration: plain stores (two threads launching the same kernel at the
    // same instant may leave a mix of both; each field is still one of theirs).
    kv->dims = lc.dims;
    kv->shared_mem = lc.shared_mem;
    kv->stream = lc.stream;
}

// The bytes a 2D/3D copy moves: the product of the `dims` size_t fields at desc + off (the
// extent of a CUDA_MEMCPY2D/3D, see symbols.py); 0 when the descriptor cannot be read.
static __always_inline u64 gw_extent_bytes(u64 desc, u32 off, u32 dims) {
    u64 e[3];  // no initialiser list: bcc would place it in global data, which it cannot load
    e[2] = 1;
    int err = dims == 3 ? bpf_probe_read_user(e, 3 * sizeof(u64), (void *)(desc + off))
                        : bpf_probe_read_user(e, 2 * sizeof(u64), (void *)(desc + off));
    return err ? 0 : e[0] * e[1] * e[2];
}



// ---- NCCL (see symbols.py, "NCCL"): communicators, and per communicator the collectives' entry
// times, which Python lines up across the ranks of one node by sequence number (nccl.py).
BPF_ARRAY(comm_zero, struct gw_comm, 1);  // never written: the zeroed value a new entry starts from

// Argument n >= 7 at a function's first instruction: in its 8-byte stack slot (sp + 8 (n - 6)).
static __always_inline u64 gw_stack_arg(struct pt_regs *ctx, int n) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}

// The bytes of one element of an ncclDataType_t (nccl.h); 0 for a type this does not know.
static __always_inline u64 gw_nccl_size(u64 t) {
    switch ((u32)t) {
    case 0: case 1: case 10: case 11:  // int8, uint8, fp8 e4m3, fp8 e5m2
        return 1;
    case 6: case 9:  // float16, bfloat16
        return 2;
    case 2: case 3: case 7:  // int32, uint32, float32
        return 4;
    case 4: case 5: case 8:  // int64, uint64, float64
        return 8;
    default:
        return 0;
    }
}

// A communicator's id: a hash of the first 16 bytes of its ncclUniqueId at addr (a random magic,
// then the root's address), the same in the process of every rank; 0 when it cannot be read.
static __always_inline u64 gw_nccl_id(u64 addr) {
    u64 w[2];
    w[0] = 0;
    w[1] = 0;
    if (bpf_probe_read_user(w, sizeof(w), (void *)addr) != 0 || (w[0] == 0 && w[1] == 0))
        return 0;
    u64 h = w[0] ^ (w[1] * 0x9E3779B97F4A7C15ULL);
    return h ? h : 1;
}

// A new, zeroed entry for (pid, comm) in comms (an init replaces an entry left at that address).
static __always_inline struct gw_comm *gw_comm_new(u32 pid, u64 comm) {
    u32 zero = 0;
    struct gw_comm *z = comm_zero.lookup(&zero);
    if (!z)
        return 0;
    struct gw_handle_key k = {};
    k.pid = pid;
    k.handle = comm;
    if (comms.update(&k, z) != 0) {
        gw_drop(12);
        return 0;
    }
    struct gw_comm *v = comms.lookup(&k);
    if (v)
        v->rank = -1;
    return v;
}

// A call on a communicator (entry): counted with its bytes; a collective (collective = 1) also
// takes the next sequence number, its entry time kept in the ring. A communicator made before the
// probe attached gets an entry of its own here: id 0, rank unknown (its ranks cannot be matched).
static __always_inline void gw_nccl_call(u64 comm, u32 api, u64 bytes, int collective) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct gw_handle_key k = {};
    k.pid = pid;
    k.handle = comm;
    struct gw_comm *v = comms.lookup(&k);
    if (!v) {
        v = gw_comm_new(pid, comm);
        if (!v)
            return;
    }
    __sync_fetch_and_add(&v->calls, 1);
    if (bytes)
        __sync_fetch_and_add(&v->bytes, bytes);
    if (!collective)
        return;
    u64 s = __sync_fetch_and_add(&v->seq, 1);
    u32 slot = s & (GW_NCCL_RING - 1);
    v->ts[slot] = bpf_ktime_get_ns();
    v->slot_api[slot] = api;
    v->slot_seq[slot] = (u32)(s + 1);  // last: a reader checks it against the seq it wants
}

// What an NCCL communicator call that returned rc did (c: its entry record; ops in symbols.py).
static __always_inline void gw_nccl_op(u32 pid, u32 op, int rc, struct gw_call *c) {
    if (rc != 0)
        return;  // (ncclInProgress is 0 here: a non-blocking init's communicator exists already)
    u64 comm = 0;
    if (op == GW_OP_NCCL_INIT) {
        if (!c->ptr || bpf_probe_read_user(&comm, sizeof(comm), (void *)c->ptr) != 0 || !comm)
            return;
        struct gw_comm *v = gw_comm_new(pid, comm);
        if (!v)
            return;
        v->id = c->aux2;
        v->nranks = (u32)c->aux;
        v->rank = (s32)(c->aux >> 32);
        v->init_ts = c->ts;
    } else if (op == GW_OP_NCCL_INIT_ALL) {
        // one process holds every rank: an id of its own (when and who), rank i for comms[i]
        u64 id = (c->ts ^ ((u64)pid << 40)) | 1;
        for (int i = 0; i < GW_NCCL_INIT_ALL_MAX; i++) {
            if (i >= (int)(u32)c->aux || !c->ptr)
                break;
            if (bpf_probe_read_user(&comm, sizeof(comm), (void *)(c->ptr + 8 * i)) != 0 || !comm)
                continue;
            struct gw_comm *v = gw_comm_new(pid, comm);
            if (!v)
                return;
            v->id = id;
            v->nranks = (u32)c->aux;
            v->rank = i;
            v->init_ts = c->ts;
        }
    } else if (op == GW_OP_NCCL_SPLIT) {
        // the ranks of one color of a parent get one id (rank and size are the library's to say)
        if (!c->ptr || bpf_probe_read_user(&comm, sizeof(comm), (void *)c->ptr) != 0 || !comm)
            return;
        struct gw_handle_key pk = {};
        pk.pid = pid;
        pk.handle = c->aux;
        struct gw_comm *parent = comms.lookup(&pk);
        u64 id = parent && parent->id ? ((parent->id ^ (c->aux2 + 1)) * 0x9E3779B97F4A7C15ULL) | 1 : 0;
        struct gw_comm *v = gw_comm_new(pid, comm);
        if (!v)
            return;
        v->id = id;
        v->init_ts = c->ts;
    } else if (op == GW_OP_NCCL_DESTROY) {
        struct gw_handle_key k = {};
        k.pid = pid;
        k.handle = c->ptr;
        struct gw_comm *v = comms.lookup(&k);
        if (v)
            v->destroyed = 1;  // kept (its counts) until the process exits or the address is reused
    }
}

static __always_inline struct gw_api_stats *gw_stats(u32 pid, u32 api) {
    struct gw_api_key sk = {};
    sk.pid = pid;
    sk.api = api;
    struct gw_api_stats zero = {};
    struct gw_api_stats *s = stats.lookup_or_try_init(&sk, &zero);
    if (!s)
        gw_drop(0);
    return s;
}

// Entry-only hooks (launches without launch_latency): the call is counted at entry; no time,
// no return code, no return probe.
static __always_inline int gw_count(struct pt_regs *ctx, u32 api, u64 bytes) {
    struct gw_api_stats *s = gw_stats(bpf_get_current_pid_tgid() >> 32, api);
    if (s) {
        __sync_fetch_and_add(&s->calls, 1);
        if (bytes)
            __sync_fetch_and_add(&s->bytes, bytes);
    }
    return 0;
}

static __always_inline int gw_enter(struct pt_regs *ctx, u32 api, struct gw_call *c) {
    struct gw_call_key k = {};
    k.pid_tgid = bpf_get_current_pid_tgid();
    k.api = api;
    c->ts = bpf_ktime_get_ns();
    if (inflight.update(&k, c) != 0)
        gw_drop(1);
    return 0;
}

static __always_inline void gw_add_live(u32 pid, s64 delta) {
    s64 zero = 0;
    s64 *v = live_bytes.lookup_or_try_init(&pid, &zero);
    if (v)
        __sync_fetch_and_add(v, delta);
}

static __always_inline void gw_name_put(u32 pid, u32 kind, u64 h, struct gw_name *n) {
    struct gw_name_key k = {};
    k.pid = pid;
    k.kind = kind;
    k.handle = h;
    if (names.update(&k, n) != 0)
        gw_drop(4);
}

// names[(pid, kind, h)] = the NUL-terminated user string at src, up to GW_NAME_LEN - 1 bytes;
// truncated = 1 when the string goes on past them.
static __always_inline void gw_name_store(u32 pid, u32 kind, u64 h, const char *src) {
    u32 zero = 0;
    struct gw_name *n = name_buf.lookup(&zero);
    if (!n)
        return;
    int len = bpf_probe_read_user_str(n->name, sizeof(n->name), src);
    if (len <= 0)
        return;  // unreadable: the handle stays unnamed
    n->truncated = 0;
    if (len == sizeof(n->name)) {  // the buffer is full: a name of exactly NAME_LEN - 1 bytes, or longer
        char next = 0;
        if (bpf_probe_read_user(&next, 1, src + sizeof(n->name) - 1) != 0 || next != 0)
            n->truncated = 1;
    }
    n->len = len - 1;
    gw_name_put(pid, kind, h, n);
}

// A process's first timed call (cuInit, a context, a module: before any launch) is said once
// (GE_FIRST), so that the daemon counts every launch of a new process from then on.
static __always_inline void gw_first_call(u32 pid, u64 ts) {
    if (procs.lookup(&pid))
        return;
    int r = procs.insert(&pid, &ts);
    if (r == -17)  // -EEXIST: another thread of the process got there first, and said it
        return;
    if (r != 0) {
        gw_drop(8);  // the map is full: not said (the next collection sees the process)
        return;
    }
    struct gw_graph_event *e = gw_graph_event(pid, GW_GE_FIRST);
    if (e)
        graph_events.ringbuf_submit(e, 0);
}

static __always_inline int gw_finish(struct pt_regs *ctx, u32 api, u32 op, u64 record) {
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
    gw_first_call(pid, c.ts);
    int rc = (int)PT_REGS_RC(ctx);  // CUresult (ncclResult_t for NCCL's)
    if (api >= GW_FIRST_NCCL_API && rc == GW_NCCL_IN_PROGRESS)
        rc = 0;  // a non-blocking communicator call going on is not an error
    u64 ns = now - c.ts;
    u64 bytes = c.bytes;
    u64 result = c.ptr;  // what the event reports: the pointer or handle the call took or produced

    if (op == GW_OP_ALLOC || op == GW_OP_ALLOC_PITCH || op == GW_OP_CREATE) {
        if (op == GW_OP_ALLOC_PITCH) {
            u64 pitch = 0;
            if (rc == 0 && c.aux)
                bpf_probe_read_user(&pitch, sizeof(pitch), (void *)c.aux);
            bytes = pitch * c.bytes;  // pitch * height; 0 when the call failed
        }
        u64 p = 0;
        result = 0;
        if (rc == 0 && c.ptr && bpf_probe_read_user(&p, sizeof(p), (void *)c.ptr) == 0 && p) {
            result = p;
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
            lv.stack = c.stack;
            lv.caller = c.caller;
            lv.sp = c.sp;
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
    } else if (op == GW_OP_NAME_FUNCTION || op == GW_OP_NAME_KERNEL) {
        // c.ptr: where the driver wrote the handle; c.aux: the name (still the caller's string)
        u64 h = 0;
        if (rc == 0 && c.ptr && c.aux && bpf_probe_read_user(&h, sizeof(h), (void *)c.ptr) == 0 && h)
            gw_name_store(pid, op == GW_OP_NAME_KERNEL ? GW_NAME_KERNEL : GW_NAME_FUNCTION, h,
                          (const char *)c.aux);
    } else if (op == GW_OP_KERNEL_FUNCTION) {
        // c.ptr: where the driver wrote the CUfunction; c.aux: the CUkernel whose name it takes
        u64 h = 0;
        if (rc == 0 && c.ptr && bpf_probe_read_user(&h, sizeof(h), (void *)c.ptr) == 0 && h) {
            struct gw_name_key kk = {};
            kk.pid = pid;
            kk.kind = GW_NAME_KERNEL;
            kk.handle = c.aux;
            struct gw_name *n = names.lookup(&kk);
            if (n)
                gw_name_put(pid, GW_NAME_FUNCTION, h, n);
        }
    } else if (op >= GW_OP_NCCL_INIT) {
        gw_nccl_op(pid, op, rc, &c);
    } else if (op >= GW_OP_CAPTURE_BEGIN) {
        gw_graph_op(pid, op, rc, &c);
    }

    if (rc != 0) {
        struct gw_error_key ek = {};
        ek.pid = pid;
        ek.api = api;
        ek.code = rc;
        u64 zero = 0;
        u64 *n = errors.lookup_or_try_init(&ek, &zero);
        if (n)
            __sync_fetch_and_add(n, 1);
        else
            gw_drop(5);
    }
    struct gw_api_stats *s = gw_stats(pid, api);
    if (s) {
        __sync_fetch_and_add(&s->calls, 1);
        if (rc != 0)
            __sync_fetch_and_add(&s->errors, 1);
        __sync_fetch_and_add(&s->ns, ns);
        __sync_fetch_and_add(&s->bytes, bytes);
    }

    struct gw_hist_key hk = {};
    hk.pid = pid;
    hk.api = api;
    hk.slot = bpf_log2l(ns);
    hist.atomic_increment(hk);
    if (!record)
        return 0;
    struct gw_event *ev = events.ringbuf_reserve(sizeof(struct gw_event));
    if (!ev) {
        gw_drop(6);
        return 0;
    }
    ev->ts = c.ts;
    ev->ns = ns;
    ev->bytes = bytes;
    ev->ptr = result;
    ev->pid = pid;
    ev->tid = (u32)k.pid_tgid;
    ev->api = api;
    ev->rc = rc;
    ev->dims = c.dims;
    events.ringbuf_submit(ev, 0);
    return 0;
}

GW_PROGRAMS
