"""The hooked libcuda symbols and the structs shared by cuda.bpf.c and Python: one place for both.

Every hooked symbol gets an entry uprobe and a return uprobe, except the launch APIs (group
"launch"), which by default get an entry uprobe only (see `timed()`). The entry program stashes,
per thread and API, the entry time and what the arguments say (a byte count, the pointer argument
through which the driver returns a device pointer or handle); the return program counts the call,
the error when the CUresult is not CUDA_SUCCESS (0), the time spent inside, the bytes, a log2
latency bucket and, for allocations and frees that succeeded, the live-allocation table. An
entry-only launch program counts the call at entry.

Every launch program (entry-only or not) also decodes the launch configuration at entry and
updates the per-kernel map (key: process, CUfunction handle): launches, grid, block, shared memory
and stream of the last launch, launches with a grid of one block ("degenerate").

Kernel names come from the calls that hand out handles (group "module"): at return, when the call
succeeded, the handle written through the pointer argument is stored with the name string
(cuModuleGetFunction -> CUfunction, cuLibraryGetKernel -> CUkernel), and cuKernelGetFunction
copies a known CUkernel's name to the CUfunction it returns. Python joins them to the per-kernel
map by (process, handle). Handles fetched before the probe attached stay unnamed.

CUDA graphs (group "graph", and the entry-only group "capture"): a graph replay (cuGraphLaunch)
runs its kernel nodes with no launch call, so the graph calls are followed instead. A stream
capture's begin puts the stream in capture_streams (capture id: when it began) and captures; a
launch into a captured stream is sent as a node (GE_NODE) instead of counted as a launch;
cuEventRecord in a captured stream and cuStreamWaitEvent on that event carry the capture to a
second stream; the end sends the graph with the nodes counted (GE_END). Explicit nodes,
instantiation, updates, clones and destroys are sent as they return (GE_*), and cuGraphLaunch
counts launches per executable graph (execs, serial = when it was instantiated, 0 before the
probe). graphs.py follows the events and multiplies. cuGraphLaunch is always probed (a replay runs
many kernels): it is not among the duty cycle's SAMPLED_APIS.

Arguments are read by the x86-64 System V calling convention: the first six integer arguments in
rdi, rsi, rdx, rcx, r8, r9 (PT_REGS_PARMn, n = 1..6), the rest on the user stack; at a uprobe on
the first instruction of a function, sp points at the return address, so argument 7 is at sp+8,
argument 8 at sp+16, ... (each in its own 8-byte slot; 32-bit values in the low half). 32-bit
arguments are truncated to 32 bits: the upper halves of their registers and slots are undefined.

`render_c()` (struct layouts, op and kind constants, the hash maps) and `render_programs()` (the
two programs, gw_entry and gw_return, attached at every hooked symbol and told which one by the
attach cookie: the API's index and the flags COOKIE_TIMED and COOKIE_EVENTS) produce the C text
that compiler.py puts in place of the markers `GW_DEFINITIONS` and `GW_PROGRAMS` in cuda.bpf.c;
the Python side reads the maps through ctypes types built from the same STRUCTS (`ctype()`), so
a field exists once, here. Whether a launch is timed and whether calls are recorded as events are
attach-time choices (the cookie), so one compiled object serves the daemon and every trace.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
from dataclasses import dataclass

# What the return program does beyond counting. Keep in step with gw_return() in cuda.bpf.c.
OP_COUNT = 0        # calls, errors, time, bytes given at entry
OP_ALLOC = 1        # *ARG(ptr) is the new device pointer; size from entry; live[(pid, dptr)] = size
OP_ALLOC_PITCH = 2  # as OP_ALLOC, but size = *ARG(aux) (the pitch) * bytes-at-entry (the height)
OP_FREE = 3         # ARG(ptr) is the device pointer being freed; live entry removed, size subtracted
OP_CREATE = 4       # *ARG(ptr) is a CUmemGenericAllocationHandle; tracked like OP_ALLOC, other kind
OP_RELEASE = 5      # ARG(ptr) is a CUmemGenericAllocationHandle being released
OP_NAME_FUNCTION = 6   # *ARG(ptr) is a new CUfunction, ARG(aux) its name: names[(pid, function, h)] = name
OP_NAME_KERNEL = 7     # *ARG(ptr) is a new CUkernel, ARG(aux) its name: names[(pid, kernel, h)] = name
OP_KERNEL_FUNCTION = 8  # *ARG(ptr) is the CUfunction of the CUkernel ARG(aux): its name, if known, copied
# CUDA graphs (graph_events, see "CUDA graphs" below): what each call does to the graphs we follow
OP_CAPTURE_BEGIN = 9    # ARG(ptr) is the stream now captured (into the graph ARG(aux), or a new one)
OP_CAPTURE_END = 10     # ARG(ptr) is the stream; *ARG(aux) the captured graph
OP_GRAPH_ADD_KERNEL = 11  # *ARG(ptr) is the new node of graph ARG(aux2); ARG(aux) its CUDA_KERNEL_NODE_PARAMS
OP_GRAPH_ADD_NODE = 12  # the same with ARG(aux) a CUgraphNodeParams (a kernel node when its type is 0)
OP_GRAPH_SET_KERNEL = 13  # ARG(ptr) is a node (of a graph, or of the executable graph ARG(aux2)), ARG(aux) its new params
OP_GRAPH_INSTANTIATE = 14  # *ARG(ptr) is a new executable graph of the graph ARG(aux)
OP_EXEC_UPDATE = 15     # the executable graph ARG(ptr) now runs the graph ARG(aux)
OP_GRAPH_DESTROY = 16   # ARG(ptr) is a graph destroyed
OP_EXEC_DESTROY = 17    # ARG(ptr) is an executable graph destroyed: its launch count goes out with it
OP_GRAPH_CLONE = 18     # *ARG(ptr) is a copy of the graph ARG(aux)
OP_GRAPH_CREATE = 19    # *ARG(ptr) is a new, empty graph (to which nodes are added)
# NCCL (libnccl, see "NCCL" below): what makes, splits and ends a communicator
OP_NCCL_INIT = 20       # *ARG(ptr) is a new ncclComm_t; aux: nranks | rank << 32; aux2: its unique id's hash
OP_NCCL_INIT_ALL = 21   # ARG(ptr) is an array of aux (ndev) new ncclComm_t, ranks 0..ndev-1, of one process
OP_NCCL_SPLIT = 22      # *ARG(ptr) is a new ncclComm_t split from ARG(aux) with color aux2
OP_NCCL_DESTROY = 23    # ARG(ptr) is a communicator destroyed or aborted

# graph_events kinds (gw_graph_event.kind), one per thing the Python side follows (graphs.py)
GE_BEGIN, GE_NODE, GE_END, GE_ADD, GE_SET, GE_INSTANTIATE, GE_UPDATE, GE_DESTROY, GE_EXEC_DESTROY, \
    GE_CLONE, GE_CREATE, GE_PROCESS, GE_FIRST = range(1, 14)
# GE_PROCESS: a process's first sampled launch; GE_FIRST: its first timed CUDA call the probe saw
# (the daemon counts every launch of a new process from then on, see probe.py "Launch sampling")

# Live-allocation key kinds: device pointers and physical allocation handles are different spaces.
KIND_DPTR = 0
KIND_HANDLE = 1

# Kernel-name key kinds: CUfunction and CUkernel handles are different spaces.
NAME_FUNCTION = 0
NAME_KERNEL = 1
NAME_LEN = 128  # bytes kept of a kernel name, the terminating NUL included (longer: truncated, marked)

# How a launch program finds the launch configuration (Hook.decode).
DECODE_NONE = 0    # no kernel (cuGraphLaunch): counted, no per-kernel entry
DECODE_REGS = 1    # (CUfunction f, gx, gy, gz, bx, by | stack: bz, sharedMem, hStream, ...)
DECODE_CONFIG = 2  # (const CUlaunchConfig *config, CUfunction f, ...): the struct read from user memory
DECODE_GRAPH = 3   # (CUgraphExec exec, CUstream): launches of that executable graph counted (execs map)

# What the entry of a "capture" hook does (Hook.capture): follow a capture across streams
CAPTURE_RECORD = 1  # (CUevent, CUstream): an event recorded in a captured stream carries the capture
CAPTURE_JOIN = 2    # (CUstream, CUevent): a stream waiting on such an event joins the capture

# What the entry of an NCCL hook does (Hook.nccl)
NCCL_CALL = 1        # a collective (ARG(ptr) is its comm): counted on the communicator, sequence number and entry time kept
NCCL_P2P = 2         # ncclSend / ncclRecv: counted on the communicator, no sequence number (ranks differ)
NCCL_INIT = 3        # ncclCommInitRank[Config](comm*, nranks, ncclUniqueId id (by value: on the stack), rank, ...)
NCCL_INIT_IDS = 4    # ncclCommInitRankScalable(comm*, nranks, rank, nId, ncclUniqueId *ids, config)
NCCL_INIT_ALL = 5    # ncclCommInitAll(comm *comms, ndev, devlist)
NCCL_SPLIT = 6       # ncclCommSplit(comm, color, key, comm *newcomm, config)
NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking call that goes on (not an error)
NCCL_RING = 64       # entry times kept per communicator (a power of two): the last NCCL_RING collectives
NCCL_INIT_ALL_MAX = 16  # communicators of one ncclCommInitAll followed (one per GPU of the node)

OPS = {"OP_COUNT": OP_COUNT, "OP_ALLOC": OP_ALLOC, "OP_ALLOC_PITCH": OP_ALLOC_PITCH, "OP_FREE": OP_FREE,
       "OP_CREATE": OP_CREATE, "OP_RELEASE": OP_RELEASE, "KIND_DPTR": KIND_DPTR, "KIND_HANDLE": KIND_HANDLE,
       "OP_NAME_FUNCTION": OP_NAME_FUNCTION, "OP_NAME_KERNEL": OP_NAME_KERNEL,
       "OP_KERNEL_FUNCTION": OP_KERNEL_FUNCTION, "NAME_FUNCTION": NAME_FUNCTION, "NAME_KERNEL": NAME_KERNEL,
       "NAME_LEN": NAME_LEN,
       "DECODE_NONE": DECODE_NONE, "DECODE_REGS": DECODE_REGS, "DECODE_CONFIG": DECODE_CONFIG,
       "DECODE_GRAPH": DECODE_GRAPH, "NCCL_IN_PROGRESS": NCCL_IN_PROGRESS, "NCCL_RING": NCCL_RING,
       "NCCL_INIT_ALL_MAX": NCCL_INIT_ALL_MAX,
       **{k: v for k, v in globals().items() if k.startswith(("OP_GRAPH", "OP_CAPTURE", "OP_EXEC", "OP_NCCL", "GE_"))}}

HIST_SLOTS = 64  # log2 buckets of nanoseconds



# Where the extent (size_t WidthInBytes, Height[, Depth]) is in cuda.h's copy descriptors, x86-64:
# CUDA_MEMCPY2D has 7 fields of 8 bytes per side (srcXInBytes, srcY, srcMemoryType + padding,
# srcHost, srcDevice, srcArray, srcPitch; the same for dst) before it: 14 * 8 = 112.
# CUDA_MEMCPY3D has 11 per side (srcXInBytes, srcY, srcZ, srcLOD, srcMemoryType + padding, srcHost,
# srcDevice, srcArray, reserved0, srcPitch, srcHeight): 22 * 8 = 176.
MEMCPY2D_EXTENT = 112
MEMCPY3D_EXTENT = 176

# CUresult names (cuda.h) for errors by return code; others are shown as their number.
CURESULT_NAMES = {
    1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
    200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
    214: "CUDA_ERROR_ECC_UNCORRECTABLE", 218: "CUDA_ERROR_INVALID_PTX", 400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 702: "CUDA_ERROR_LAUNCH_TIMEOUT", 719: "CUDA_ERROR_LAUNCH_FAILED",
    720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY", 999: "CUDA_ERROR_UNKNOWN",
}


def curesult_name(code: int) -> str:
    return CURESULT_NAMES.get(code, f"CUresult {code}")


@dataclass(frozen=True)
class Hook:
    """One exported libcuda function.

    bytes: C expression over ARG(n) (1-based argument n as u64) for the byte count known at entry
           ("" for none). For OP_ALLOC_PITCH it is the height, multiplied by the pitch at return.
    ptr:   argument number of the pointer argument (OP_ALLOC/OP_CREATE: where the result is
           written; OP_FREE/OP_RELEASE: the pointer or handle itself), 0 for none.
    aux:   argument number of a second argument used at return (OP_ALLOC_PITCH: pPitch;
           OP_NAME_*: the name string; OP_KERNEL_FUNCTION: the CUkernel handle).
    aux2:  argument number of a third one (graph ops: the graph or executable graph it changes).
    decode: launches only: where the kernel handle and launch configuration are (DECODE_*).
    capture: "capture" hooks only: what the entry does for stream capture (CAPTURE_*).
    """

    name: str
    group: str  # launch | alloc | free | copy | set | sync | vmm | module
    op: int = OP_COUNT
    bytes: str = ""
    ptr: int = 0
    aux: int = 0
    decode: int = DECODE_NONE
    aux2: int = 0
    capture: int = 0
    nccl: int = 0  # "nccl" hooks only: what the entry does (NCCL_*)


def _variants(base: Hook, *suffixes: str) -> list[Hook]:
    """The hook and its other forms (`_ptsz`, `_ptds`, `_v2`), same signature."""
    return [base] + [dataclasses.replace(base, name=base.name + s) for s in suffixes]


HOOKS: tuple[Hook, ...] = tuple([
    # --- launches. cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra);
    # cuLaunchCooperativeKernel: the same first nine; cuLaunchKernelEx(const CUlaunchConfig *config,
    # f, params, extra); cuGraphLaunch(exec, stream).
    *_variants(Hook("cuLaunchKernel", "launch", decode=DECODE_REGS), "_ptsz"),
    *_variants(Hook("cuLaunchKernelEx", "launch", decode=DECODE_CONFIG), "_ptsz"),
    *_variants(Hook("cuLaunchCooperativeKernel", "launch", decode=DECODE_REGS), "_ptsz"),
    *_variants(Hook("cuGraphLaunch", "launch", decode=DECODE_GRAPH), "_ptsz"),
    # --- allocations: (CUdeviceptr *dptr, size_t bytesize, ...)
    Hook("cuMemAlloc_v2", "alloc", OP_ALLOC, "ARG(2)", ptr=1),
    Hook("cuMemAllocManaged", "alloc", OP_ALLOC, "ARG(2)", ptr=1),
    # cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned elt)
    Hook("cuMemAllocPitch_v2", "alloc", OP_ALLOC_PITCH, "ARG(4)", ptr=1, aux=2),
    *_variants(Hook("cuMemAllocAsync", "alloc", OP_ALLOC, "ARG(2)", ptr=1), "_ptsz"),
    *_variants(Hook("cuMemAllocFromPoolAsync", "alloc", OP_ALLOC, "ARG(2)", ptr=1), "_ptsz"),
    # frees: (CUdeviceptr dptr, ...); their bytes are the sizes of the allocations they released
    Hook("cuMemFree_v2", "free", OP_FREE, ptr=1),
    *_variants(Hook("cuMemFreeAsync", "free", OP_FREE, ptr=1), "_ptsz"),
    # --- virtual memory management (PyTorch expandable segments).
    # cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, flags)
    Hook("cuMemCreate", "vmm", OP_CREATE, "ARG(2)", ptr=1),
    Hook("cuMemRelease", "vmm", OP_RELEASE, ptr=1),
    Hook("cuMemMap", "vmm", bytes="ARG(2)"),             # (CUdeviceptr ptr, size_t size, offset, handle, flags)
    Hook("cuMemUnmap", "vmm", bytes="ARG(2)"),           # (CUdeviceptr ptr, size_t size)
    Hook("cuMemAddressReserve", "vmm", bytes="ARG(2)"),  # (CUdeviceptr *ptr, size_t size, align, addr, flags)
    Hook("cuMemAddressFree", "vmm", bytes="ARG(2)"),     # (CUdeviceptr ptr, size_t size)
    # --- copies: (dst, src, size_t ByteCount[, stream])
    *_variants(Hook("cuMemcpy", "copy", bytes="ARG(3)"), "_ptds"),
    *_variants(Hook("cuMemcpyAsync", "copy", bytes="ARG(3)"), "_ptsz"),
    *_variants(Hook("cuMemcpyHtoD_v2", "copy", bytes="ARG(3)"), "_ptds"),
    *_variants(Hook("cuMemcpyDtoH_v2", "copy", bytes="ARG(3)"), "_ptds"),
    *_variants(Hook("cuMemcpyDtoD_v2", "copy", bytes="ARG(3)"), "_ptds"),
    *_variants(Hook("cuMemcpyHtoDAsync_v2", "copy", bytes="ARG(3)"), "_ptsz"),
    *_variants(Hook("cuMemcpyDtoHAsync_v2", "copy", bytes="ARG(3)"), "_ptsz"),
    *_variants(Hook("cuMemcpyDtoDAsync_v2", "copy", bytes="ARG(3)"), "_ptsz"),
    # cuMemcpyPeer(dst, dstCtx, src, srcCtx, size_t ByteCount[, stream])
    *_variants(Hook("cuMemcpyPeer", "copy", bytes="ARG(5)"), "_ptds"),
    *_variants(Hook("cuMemcpyPeerAsync", "copy", bytes="ARG(5)"), "_ptsz"),
    # 2D/3D copies: (const CUDA_MEMCPY2D *pCopy[, stream]); bytes = the extent's product, read from
    # the descriptor in user memory at entry (0 when it cannot be read)
    *_variants(Hook("cuMemcpy2D_v2", "copy", bytes=f"gw_extent_bytes(ARG(1), {MEMCPY2D_EXTENT}, 2)"), "_ptds"),
    *_variants(Hook("cuMemcpy2DAsync_v2", "copy", bytes=f"gw_extent_bytes(ARG(1), {MEMCPY2D_EXTENT}, 2)"), "_ptsz"),
    *_variants(Hook("cuMemcpy3D_v2", "copy", bytes=f"gw_extent_bytes(ARG(1), {MEMCPY3D_EXTENT}, 3)"), "_ptds"),
    *_variants(Hook("cuMemcpy3DAsync_v2", "copy", bytes=f"gw_extent_bytes(ARG(1), {MEMCPY3D_EXTENT}, 3)"), "_ptsz"),
    # --- sets: (CUdeviceptr dst, value, size_t N[, stream]); N elements of 1, 2 or 4 bytes
    *_variants(Hook("cuMemsetD8_v2", "set", bytes="ARG(3)"), "_ptds"),
    *_variants(Hook("cuMemsetD16_v2", "set", bytes="ARG(3) * 2"), "_ptds"),
    *_variants(Hook("cuMemsetD32_v2", "set", bytes="ARG(3) * 4"), "_ptds"),
    *_variants(Hook("cuMemsetD8Async", "set", bytes="ARG(3)"), "_ptsz"),
    *_variants(Hook("cuMemsetD16Async", "set", bytes="ARG(3) * 2"), "_ptsz"),
    *_variants(Hook("cuMemsetD32Async", "set", bytes="ARG(3) * 4"), "_ptsz"),
    # cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, value, size_t Width, size_t Height[, stream])
    *_variants(Hook("cuMemsetD2D8_v2", "set", bytes="ARG(4) * ARG(5)"), "_ptds"),
    *_variants(Hook("cuMemsetD2D32_v2", "set", bytes="ARG(4) * ARG(5) * 4"), "_ptds"),
    # --- synchronisation
    *_variants(Hook("cuStreamSynchronize", "sync"), "_ptsz"),
    Hook("cuCtxSynchronize", "sync"),
    Hook("cuEventSynchronize", "sync"),
    # --- what names kernels: the name of each handle the driver hands out, kept per process.
    # cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
    Hook("cuModuleGetFunction", "module", OP_NAME_FUNCTION, ptr=1, aux=3),
    # cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
    Hook("cuLibraryGetKernel", "module", OP_NAME_KERNEL, ptr=1, aux=3),
    # cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel): with lazy loading (the default since
    # CUDA 12) the runtime calls it when a kernel is first launched
    Hook("cuKernelGetFunction", "module", OP_KERNEL_FUNCTION, ptr=1, aux=2),
    # --- CUDA graphs: how they are built, instantiated, changed and destroyed (see "CUDA graphs").
    # Stream capture across streams: cuEventRecord[WithFlags](CUevent, CUstream[, flags]) and
    # cuStreamWaitEvent(CUstream, CUevent, flags), entry only (counted at entry, like launches)
    *_variants(Hook("cuEventRecord", "capture", capture=CAPTURE_RECORD), "_ptsz"),
    *_variants(Hook("cuEventRecordWithFlags", "capture", capture=CAPTURE_RECORD), "_ptsz"),
    *_variants(Hook("cuStreamWaitEvent", "capture", capture=CAPTURE_JOIN), "_ptsz"),
    # cuStreamBeginCapture[_v2](CUstream, mode); cuStreamBeginCaptureToGraph(CUstream, CUgraph, ...)
    *_variants(Hook("cuStreamBeginCapture", "graph", OP_CAPTURE_BEGIN, ptr=1), "_ptsz", "_v2", "_v2_ptsz"),
    *_variants(Hook("cuStreamBeginCaptureToGraph", "graph", OP_CAPTURE_BEGIN, ptr=1, aux=2), "_ptsz"),
    # cuStreamEndCapture(CUstream, CUgraph *phGraph)
    *_variants(Hook("cuStreamEndCapture", "graph", OP_CAPTURE_END, ptr=1, aux=2), "_ptsz"),
    Hook("cuGraphCreate", "graph", OP_GRAPH_CREATE, ptr=1),  # (CUgraph *phGraph, flags)
    # cuGraphAddKernelNode[_v2](CUgraphNode *phNode, CUgraph, const CUgraphNode *deps, size_t n,
    # const CUDA_KERNEL_NODE_PARAMS *); cuGraphAddNode(phNode, CUgraph, deps, n, CUgraphNodeParams *);
    # cuGraphAddNode_v2(phNode, CUgraph, deps, const CUgraphEdgeData *, n, CUgraphNodeParams *)
    *_variants(Hook("cuGraphAddKernelNode", "graph", OP_GRAPH_ADD_KERNEL, ptr=1, aux=5, aux2=2), "_v2"),
    Hook("cuGraphAddNode", "graph", OP_GRAPH_ADD_NODE, ptr=1, aux=5, aux2=2),
    Hook("cuGraphAddNode_v2", "graph", OP_GRAPH_ADD_NODE, ptr=1, aux=6, aux2=2),
    # cuGraphKernelNodeSetParams[_v2](CUgraphNode, params); cuGraphExecKernelNodeSetParams[_v2](
    # CUgraphExec, CUgraphNode, params)
    *_variants(Hook("cuGraphKernelNodeSetParams", "graph", OP_GRAPH_SET_KERNEL, ptr=1, aux=2), "_v2"),
    *_variants(Hook("cuGraphExecKernelNodeSetParams", "graph", OP_GRAPH_SET_KERNEL, ptr=2, aux=3, aux2=1), "_v2"),
    # cuGraphInstantiate[_v2](CUgraphExec *, CUgraph, ...), ...WithFlags(CUgraphExec *, CUgraph, flags),
    # ...WithParams(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *)
    *_variants(Hook("cuGraphInstantiate", "graph", OP_GRAPH_INSTANTIATE, ptr=1, aux=2), "_v2"),
    Hook("cuGraphInstantiateWithFlags", "graph", OP_GRAPH_INSTANTIATE, ptr=1, aux=2),
    *_variants(Hook("cuGraphInstantiateWithParams", "graph", OP_GRAPH_INSTANTIATE, ptr=1, aux=2), "_ptsz"),
    # cuGraphExecUpdate[_v2](CUgraphExec, CUgraph, ...)
    *_variants(Hook("cuGraphExecUpdate", "graph", OP_EXEC_UPDATE, ptr=1, aux=2), "_v2"),
    Hook("cuGraphClone", "graph", OP_GRAPH_CLONE, ptr=1, aux=2),  # (CUgraph *phClone, CUgraph original)
    Hook("cuGraphDestroy", "graph", OP_GRAPH_DESTROY, ptr=1),
    Hook("cuGraphExecDestroy", "graph", OP_EXEC_DESTROY, ptr=1),
    # --- NCCL (libnccl.so*, see "NCCL" in the module doc). ncclResult_t is 0 on success.
    # bytes = count x the datatype's size (gw_nccl_size); ptr = the argument that is the communicator.
    # ncclAllReduce(sendbuff, recvbuff, size_t count, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)
    Hook("ncclAllReduce", "nccl", bytes="ARG(3) * gw_nccl_size(ARG(4))", ptr=6, nccl=NCCL_CALL),
    # ncclAllGather(sendbuff, recvbuff, size_t sendcount, ncclDataType_t, ncclComm_t, cudaStream_t)
    Hook("ncclAllGather", "nccl", bytes="ARG(3) * gw_nccl_size(ARG(4))", ptr=5, nccl=NCCL_CALL),
    # ncclReduceScatter(sendbuff, recvbuff, size_t recvcount, ncclDataType_t, ncclRedOp_t, ncclComm_t, stream)
    Hook("ncclReduceScatter", "nccl", bytes="ARG(3) * gw_nccl_size(ARG(4))", ptr=6, nccl=NCCL_CALL),
    # ncclBroadcast(sendbuff, recvbuff, size_t count, ncclDataType_t, int root, ncclComm_t, cudaStream_t)
    Hook("ncclBroadcast", "nccl", bytes="ARG(3) * gw_nccl_size(ARG(4))", ptr=6, nccl=NCCL_CALL),
    # ncclReduce(sendbuff, recvbuff, size_t count, ncclDataType_t, ncclRedOp_t, int root, ncclComm_t, stream):
    # the communicator is argument 7, on the stack
    Hook("ncclReduce", "nccl", bytes="ARG(3) * gw_nccl_size(ARG(4))", ptr=7, nccl=NCCL_CALL),
    # ncclSend(sendbuff, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t); ncclRecv alike
    Hook("ncclSend", "nccl", bytes="ARG(2) * gw_nccl_size(ARG(3))", ptr=5, nccl=NCCL_P2P),
    Hook("ncclRecv", "nccl", bytes="ARG(2) * gw_nccl_size(ARG(3))", ptr=5, nccl=NCCL_P2P),
    Hook("ncclGroupStart", "nccl"),
    Hook("ncclGroupEnd", "nccl"),
    # communicators: ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank): the
    # 128-byte id is passed by value, in memory (the stack), so rank is the third register argument;
    # ncclCommInitRankConfig adds ncclConfig_t *config after rank
    Hook("ncclCommInitRank", "nccl", OP_NCCL_INIT, ptr=1, nccl=NCCL_INIT),
    Hook("ncclCommInitRankConfig", "nccl", OP_NCCL_INIT, ptr=1, nccl=NCCL_INIT),
    Hook("ncclCommInitRankScalable", "nccl", OP_NCCL_INIT, ptr=1, nccl=NCCL_INIT_IDS),
    Hook("ncclCommInitAll", "nccl", OP_NCCL_INIT_ALL, ptr=1, aux=2, nccl=NCCL_INIT_ALL),
    Hook("ncclCommSplit", "nccl", OP_NCCL_SPLIT, ptr=4, aux=1, nccl=NCCL_SPLIT),
    Hook("ncclCommDestroy", "nccl", OP_NCCL_DESTROY, ptr=1),
    Hook("ncclCommAbort", "nccl", OP_NCCL_DESTROY, ptr=1),
])

LAUNCH_APIS = frozenset(h.name for h in HOOKS if h.group == "launch")
# The kernel launches: the probes the daemon's launch duty cycle takes away and brings back.
# cuGraphLaunch is not among them: each replay runs many kernels, so it is counted always.
SAMPLED_APIS = frozenset(h.name for h in HOOKS if h.group == "launch" and h.decode != DECODE_GRAPH)
UNTIMED_GROUPS = ("launch", "capture")


def timed(hook: Hook, launch_latency: bool) -> bool:
    """Whether the hook gets a return probe (latency, errors, results): every API but launches and
    the capture hooks (cuEventRecord, cuStreamWaitEvent), and those too with launch_latency."""
    return launch_latency or hook.group not in UNTIMED_GROUPS


API_IDS: dict[str, int] = {h.name: i for i, h in enumerate(HOOKS)}
API_NAMES: tuple[str, ...] = tuple(h.name for h in HOOKS)
assert len(API_IDS) == len(HOOKS), "duplicate hook names"
NCCL_APIS = frozenset(h.name for h in HOOKS if h.group == "nccl")
FIRST_NCCL_API = min(API_IDS[a] for a in NCCL_APIS)
assert all(API_IDS[a] >= FIRST_NCCL_API for a in NCCL_APIS) and len(HOOKS) - FIRST_NCCL_API == len(NCCL_APIS), \
    "the NCCL hooks come last (the BPF side tells them by FIRST_NCCL_API)"
COLLECTIVE_APIS = frozenset(h.name for h in HOOKS if h.nccl == NCCL_CALL)
# ncclResult_t names (nccl.h) for errors by return code of the NCCL hooks
NCCL_RESULT_NAMES = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                     4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}


def result_name(api: str, code: int) -> str:
    """The name of a hooked call's return code: a CUresult, or an ncclResult_t for NCCL's."""
    if api in NCCL_APIS:
        return NCCL_RESULT_NAMES.get(code, f"ncclResult_t {code}")
    return curesult_name(code)

PY_DEPTH = 16  # Python frames kept per sampled launch (pyframes.PY_DEPTH)
PY_THREADS = 64  # thread states looked through for the launching thread's
PY_NONE = 0xFFFFFFFF
# A kernel's launch stack is sampled at its launches 1, 2, 4, ... 512, then one in LAUNCH_SAMPLE_EVERY
# (a power of two), and at every capture of it into a graph.
LAUNCH_SAMPLE_EVERY = 1024
USTACK_BYTES = 8192  # user stack copied per allocating chain (unwind.STACK_BYTES), in USTACK_CHUNK reads
USTACK_CHUNK = 1024  # (a read that would cross the stack's top fails whole: the copy ends a chunk before)
USTACKS_PER_PID = 256  # stack copies a process may make over its life (then: frame-pointer stacks only)

# Struct layouts shared with cuda.bpf.c: (C type, field) in declaration order.
STRUCTS: dict[str, tuple[tuple[str, str], ...]] = {
    # a launch's grid and block (the head of CUlaunchConfig), carried whole from the launch
    # configuration to the per-kernel map, the call record and the event
    "gw_dims": (("u32", "grid_x"), ("u32", "grid_y"), ("u32", "grid_z"),
                ("u32", "block_x"), ("u32", "block_y"), ("u32", "block_z")),
    # per (process, API) counters
    "gw_api_key": (("u32", "pid"), ("u32", "api")),
    "gw_api_stats": (("u64", "calls"), ("u64", "errors"), ("u64", "ns"), ("u64", "bytes")),
    # entry -> return scratch, per thread and API (a hooked function may call another)
    "gw_call_key": (("u64", "pid_tgid"), ("u32", "api"), ("u32", "pad")),
    # (launches: ptr = the kernel handle, and the grid and block, for the per-call events)
    "gw_call": (("u64", "ts"), ("u64", "bytes"), ("u64", "ptr"), ("u64", "aux"), ("struct gw_dims", "dims"),
                # allocations: the user stack id (else -1) and the return address, which a
                # frame-pointer walk from a function's first instruction skips
                ("s32", "stack"), ("u32", "pad"), ("u64", "caller"),
                ("u64", "aux2"),  # graph ops: the graph or executable graph the call changes
                ("u64", "sp")),  # allocations: the user stack pointer at entry (the key of its stack copy)
    # one call, in the ring buffer (events on): entry time and duration in ns, bytes, the pointer
    # or handle the call produced or took (allocations: the device pointer; launches: the kernel)
    "gw_event": (("u64", "ts"), ("u64", "ns"), ("u64", "bytes"), ("u64", "ptr"),
                 ("u32", "pid"), ("u32", "tid"), ("u32", "api"), ("s32", "rc"), ("struct gw_dims", "dims")),
    # live allocations: (process, kind, device pointer or handle) -> size
    "gw_live_key": (("u32", "pid"), ("u32", "kind"), ("u64", "ptr")),
    "gw_live": (("u64", "size"), ("u64", "ts"), ("u32", "api"), ("s32", "stack"), ("u64", "caller"), ("u64", "sp")),
    # --- allocation stacks without frame pointers (unwind.py): one copy of the top USTACK_BYTES of
    # the user stack, with rip, rsp and rbp at the hooked function's first instruction, per (process,
    # frame-pointer stack id, return address, rsp): the same chain from the same thread and depth
    # is copied once; len: the bytes read (less near the top of a stack)
    "gw_ustack_key": (("u32", "pid"), ("s32", "stack"), ("u64", "caller"), ("u64", "sp")),
    "gw_ustack": (("u64", "ip"), ("u64", "sp"), ("u64", "bp"), ("u32", "len"), ("u32", "pad"),
                  ("u64", f"data[{USTACK_BYTES // 8}]")),
    # errors by return code: (process, API, CUresult) -> count
    "gw_error_key": (("u32", "pid"), ("u32", "api"), ("s32", "code"), ("u32", "pad")),
    # log2 latency histogram key
    "gw_hist_key": (("u32", "pid"), ("u32", "api"), ("u64", "slot")),
    # per kernel: (process, CUfunction handle) -> launches and the configuration of the last launch
    "gw_kernel_key": (("u32", "pid"), ("u32", "pad"), ("u64", "handle")),
    "gw_kernel": (("u64", "launches"), ("u64", "degenerate"), ("u64", "stream"), ("struct gw_dims", "dims"),
                  ("u32", "shared_mem"), ("u32", "pad")),
    # kernel names: (process, NAME_FUNCTION or NAME_KERNEL, handle) -> the first len bytes of name,
    # truncated = 1 when the name was longer than NAME_LEN - 1 bytes
    "gw_name_key": (("u32", "pid"), ("u32", "kind"), ("u64", "handle")),
    "gw_name": (("u32", "len"), ("u32", "truncated"), ("char", f"name[{NAME_LEN}]")),
    # the head of CUlaunchConfig (cuda.h), read from user memory at cuLaunchKernelEx entry
    "gw_launch_config": (("struct gw_dims", "dims"), ("u32", "shared_mem"), ("u32", "pad"), ("u64", "stream")),
    # --- launch call stacks (sampled: gw_launch_sample). Where a process's CPython keeps what the
    # walk needs (pyframes.Offsets; cframe = PY_NONE: current_frame is in the thread state)
    "gw_py": (("u64", "interp_ptr"), ("u32", "threads_head"), ("u32", "next"), ("u32", "native_thread_id"),
              ("u32", "cframe"), ("u32", "current_frame"), ("u32", "code"), ("u32", "previous"), ("u32", "instr")),
    # one launch stack: the kernel, the native user stack (id in stacks, and the return address),
    # and the Python frames (code object, byte offset of the instruction in it), innermost first
    "gw_launch_stack_key": (("u32", "pid"), ("s32", "stack"), ("u64", "handle"), ("u64", "caller"),
                            ("u64", f"code[{PY_DEPTH}]"), ("u32", f"instr[{PY_DEPTH}]")),
    # --- CUDA graphs. A handle of a process (stream, event, capture, executable graph)
    "gw_handle_key": (("u32", "pid"), ("u32", "pad"), ("u64", "handle")),
    # a capture in progress: the stream it began on and the kernel nodes it has added so far
    "gw_capture": (("u64", "stream"), ("u64", "nodes")),
    # an executable graph: when it was instantiated (0: before the probe attached) and its launches
    "gw_exec": (("u64", "serial"), ("u64", "launches")),
    # the head of CUDA_KERNEL_NODE_PARAMS (v1, v2 and v3 alike): func, grid, block, shared memory;
    # v2/v3 have a CUkernel at byte 56 used when func is NULL
    "gw_kernel_params": (("u64", "func"), ("struct gw_dims", "dims"), ("u32", "shared_mem"), ("u32", "pad")),
    # one change to a graph, in the ring buffer graph_events (GE_* kinds; graphs.py reads them)
    # (capture: the capture's id, its begin time; graph: the graph made or changed; source: the
    # graph a clone copies; exec/serial: an executable graph and when it was instantiated; node and
    # function, dims, shared_mem: a kernel node; count: nodes captured (END), the executable graph's
    # launches until then (EXEC_DESTROY, and UPDATE and SET of an executable graph: the launches
    # before a change ran what it held before))
    "gw_graph_event": (("u64", "ts"), ("u32", "pid"), ("u32", "kind"), ("u64", "capture"), ("u64", "graph"),
                       ("u64", "source"), ("u64", "exec"), ("u64", "serial"), ("u64", "node"),
                       ("u64", "function"), ("u64", "count"), ("struct gw_dims", "dims"), ("u32", "shared_mem"),
                       ("s32", "rc")),
    # --- NCCL. A communicator of a process: (pid, ncclComm_t) in gw_handle_key -> what its init said
    # (id: a hash of its ncclUniqueId, the same in every rank's process, 0 when the init was not
    # seen; rank -1 and nranks 0 when unknown), calls and bytes on it, and the collectives so far
    # (seq) with the entry time, API and seq + 1 of the last NCCL_RING of them (slot seq % NCCL_RING)
    "gw_comm": (("u64", "id"), ("s32", "rank"), ("u32", "nranks"), ("u64", "seq"), ("u64", "calls"),
                ("u64", "bytes"), ("u64", "init_ts"), ("u32", "destroyed"), ("u32", "pad"),
                ("u64", f"ts[{NCCL_RING}]"), ("u32", f"slot_seq[{NCCL_RING}]"), ("u32", f"slot_api[{NCCL_RING}]")),
}

# Map sizes. Hash maps are created without preallocation (BPF_F_NO_PREALLOC), so these are caps,
# not memory taken up front.
# What dropped[] counts, by index (cuda.bpf.c's gw_drop calls)
DROPPED_KINDS = ("stats", "in_flight_calls", "live_allocations", "kernels", "kernel_names", "errors_by_code",
                 "events", "allocation_stacks", "graph_events", "captures", "graph_launches", "launch_stacks",
                 "nccl_communicators", "stack_copies")
RINGBUF_PAGES = 4096  # the per-call event ring buffer (events on): 16 MiB, ~230k events of 72 bytes
# graph construction (graph_events): 1 MiB, ~9,000 events of 112 bytes between two reads; captures
# come in bursts at a server's start (a node per kernel of each graph), drained as they come
GRAPH_RINGBUF_PAGES = 256
MAP_SIZES = {"STATS_MAX": 16384, "CALLS_MAX": 16384, "LIVE_MAX": 1 << 20, "LIVE_PIDS_MAX": 4096,
             "HIST_MAX": 65536, "ERRORS_MAX": 16384,
             # powers of two: the stack maps have that many buckets, and stack ids index stack_used
             # (the overflow map's offset by STACKS_MAX; its stacks are those whose bucket in the first
             # was taken: ~n/16,384 of new stacks with n in the map)
             "STACKS_MAX": 16384, "STACKS_OVERFLOW_MAX": 4096, "KERNELS_MAX": 65536, "NAMES_MAX": 1 << 18,
             "CAPTURES_MAX": 4096, "CAPTURE_HANDLES_MAX": 16384, "EXECS_MAX": 65536,
             "LAUNCH_STACKS_MAX": 16384, "PY_PROCS_MAX": 4096, "COMMS_MAX": 4096,
             # stack copies: keys copied (kept until the process exits), copies not unwound yet (Python
             # unwinds and deletes them each collection: 1024 x 8 KiB = 8 MiB at most, in the kernel)
             "USTACK_KEYS_MAX": 65536, "USTACK_COPIES_MAX": 1024}


# The hash maps: name -> (key struct, value struct, size cap). Their C declarations are rendered
# from here (render_c) and Python reads them through ctypes types built from the same STRUCTS, so
# a map's layout exists once. The other maps (stacks, events, name_buf, dropped) are declared in
# cuda.bpf.c; MAP_TYPES gives Python their key and value types too.
HASH_MAPS: dict[str, tuple[str, str, str]] = {
    "stats": ("gw_api_key", "gw_api_stats", "STATS_MAX"),
    "inflight": ("gw_call_key", "gw_call", "CALLS_MAX"),
    "live": ("gw_live_key", "gw_live", "LIVE_MAX"),
    "live_bytes": ("u32", "s64", "LIVE_PIDS_MAX"),
    "hist": ("gw_hist_key", "u64", "HIST_MAX"),
    "errors": ("gw_error_key", "u64", "ERRORS_MAX"),
    "kernels": ("gw_kernel_key", "gw_kernel", "KERNELS_MAX"),
    "names": ("gw_name_key", "gw_name", "NAMES_MAX"),
    # CUDA graphs: streams being captured and events recorded in them -> capture id; captures in
    # progress; executable graphs and their launches
    "capture_streams": ("gw_handle_key", "u64", "CAPTURE_HANDLES_MAX"),
    "capture_events": ("gw_handle_key", "u64", "CAPTURE_HANDLES_MAX"),
    "captures": ("gw_handle_key", "gw_capture", "CAPTURES_MAX"),
    "execs": ("gw_handle_key", "gw_exec", "EXECS_MAX"),
    # launch stacks: sampled launches by stack; the CPython processes whose frames are read
    "launch_stacks": ("gw_launch_stack_key", "u64", "LAUNCH_STACKS_MAX"),
    "py_procs": ("u32", "gw_py", "PY_PROCS_MAX"),
    "py_seen": ("u32", "u32", "PY_PROCS_MAX"),  # processes said once (GE_PROCESS) to be read for Python
    "comms": ("gw_handle_key", "gw_comm", "COMMS_MAX"),  # NCCL communicators
    "procs": ("u32", "u64", "LIVE_PIDS_MAX"),  # process -> its first timed call seen (said once: GE_FIRST)
    # allocation stack copies (gw_copy_stack): the keys copied, the copies, copies per process
    "ustack_seen": ("gw_ustack_key", "u32", "USTACK_KEYS_MAX"),
    "ustack_copies": ("gw_ustack_key", "gw_ustack", "USTACK_COPIES_MAX"),
    "ustack_count": ("u32", "u32", "LIVE_PIDS_MAX"),
}
STACK_DEPTH = 127  # PERF_MAX_STACK_DEPTH: a stack map's value is this many u64 addresses
MAP_TYPES: dict[str, tuple[str, str]] = {**{k: (v[0], v[1]) for k, v in HASH_MAPS.items()},
                                         "dropped": ("u32", "u64"), "frozen": ("u32", "u32"),
                                         "stacks": ("u32", f"u64[{STACK_DEPTH}]"),
                                         "stacks_overflow": ("u32", f"u64[{STACK_DEPTH}]"), "stack_used": ("u32", "u64"),
                                         "lstack_buf": ("u32", "gw_launch_stack_key"), "comm_zero": ("u32", "gw_comm"),
                                         "ustack_buf": ("u32", "gw_ustack")}

# The attach cookie of every probe (bpf_get_attach_cookie): the API's index in HOOKS, and flags.
COOKIE_API = 0xFFFF
COOKIE_TIMED = 1 << 16   # entry: keep the call for the return probe (else: count it at entry)
COOKIE_EVENTS = 1 << 17  # return: write one gw_event per call to the ring buffer "events"
PROGRAMS = ("gw_entry", "gw_return")


def entry_cookie(hook: Hook, launch_latency: bool) -> int:
    return API_IDS[hook.name] | (COOKIE_TIMED if timed(hook, launch_latency) else 0)


def return_cookie(hook: Hook, events: bool) -> int:
    return API_IDS[hook.name] | (COOKIE_EVENTS if events else 0)


def render_c() -> str:
    """The generated part of cuda.bpf.c: constants, structs and the hash maps."""
    lines = ["/* generated by gpuwatch.probes.ebpf.symbols.render_c(): do not edit here */"]
    defines = [*OPS.items(), *MAP_SIZES.items(), ("HIST_SLOTS", HIST_SLOTS), ("RINGBUF_PAGES", RINGBUF_PAGES),
               ("GRAPH_RINGBUF_PAGES", GRAPH_RINGBUF_PAGES), ("PY_DEPTH", PY_DEPTH), ("PY_THREADS", PY_THREADS),
               ("PY_NONE", f"{PY_NONE:#x}"), ("LAUNCH_SAMPLE_EVERY", LAUNCH_SAMPLE_EVERY), ("USTACK_CHUNK", USTACK_CHUNK),
               ("USTACK_CHUNKS", USTACK_BYTES // USTACK_CHUNK), ("USTACKS_PER_PID", USTACKS_PER_PID),
               ("DROPPED_KINDS", len(DROPPED_KINDS)), ("FIRST_NCCL_API", FIRST_NCCL_API),
               ("COOKIE_API", f"{COOKIE_API:#x}"), ("COOKIE_TIMED", f"{COOKIE_TIMED:#x}"),
               ("COOKIE_EVENTS", f"{COOKIE_EVENTS:#x}")]
    lines += [f"#define GW_{k} {v}" for k, v in defines]
    for name, fields in STRUCTS.items():
        lines.append(f"struct {name} {{")
        lines += [f"    {ctype} {field};" for ctype, field in fields]
        lines.append("};")
    lines.append("// Hash maps are not preallocated: their sizes are caps, memory follows use.")
    for name, (key, value, cap) in HASH_MAPS.items():
        c = lambda t: t if t in ("u32", "u64", "s32", "s64") else f"struct {t}"  # noqa: E731
        lines.append(f'BPF_F_TABLE("hash", {c(key)}, {c(value)}, {name}, GW_{cap}, BPF_F_NO_PREALLOC);')
    return "\n".join(lines) + "\n"


def _arg(n: int) -> str:
    """Argument n (1-based) at a function's first instruction: a register, or from 7 on the stack."""
    return f"ARG({n})" if n <= 6 else f"gw_stack_arg(ctx, {n})"


def _entry_body(h: Hook) -> str:
    """What the entry program does for one hook before gw_enter/gw_count, the API aside."""
    if h.nccl in (NCCL_CALL, NCCL_P2P):
        return (f"c.bytes = {h.bytes}; c.ptr = {_arg(h.ptr)}; "
                f"gw_nccl_call(c.ptr, api, c.bytes, {1 if h.nccl == NCCL_CALL else 0});")
    if h.nccl == NCCL_INIT:  # nranks | rank << 32, and the id (by value, at sp + 8)
        return "c.ptr = ARG(1); c.aux = (ARG(2) & 0xFFFFFFFF) | (ARG(3) & 0xFFFFFFFF) << 32; c.aux2 = gw_nccl_id(PT_REGS_SP(ctx) + 8);"
    if h.nccl == NCCL_INIT_IDS:  # the first of the ids, through the pointer
        return "c.ptr = ARG(1); c.aux = (ARG(2) & 0xFFFFFFFF) | (ARG(3) & 0xFFFFFFFF) << 32; c.aux2 = gw_nccl_id(ARG(5));"
    if h.nccl == NCCL_SPLIT:
        return "c.ptr = ARG(4); c.aux = ARG(1); c.aux2 = ARG(2) & 0xFFFFFFFF;"
    if h.decode == DECODE_GRAPH:
        body = "c.ptr = ARG(1); gw_graph_launch(ARG(1));"
    elif h.decode != DECODE_NONE:
        body = f"gw_launch(ctx, GW_DECODE_{'REGS' if h.decode == DECODE_REGS else 'CONFIG'}, &c);"
    elif h.capture == CAPTURE_RECORD:
        body = "gw_capture_record(ARG(1), ARG(2));"
    elif h.capture == CAPTURE_JOIN:
        body = "gw_capture_join(ARG(1), ARG(2));"
    else:
        parts = [f"c.bytes = {h.bytes};" if h.bytes else "", f"c.ptr = ARG({h.ptr});" if h.ptr else "",
                 f"c.aux = ARG({h.aux});" if h.aux else "", f"c.aux2 = ARG({h.aux2});" if h.aux2 else ""]
        body = " ".join(p for p in parts if p)
    # allocations remember who asked: the user stack (its id in the stack map) and the caller
    if h.op in (OP_ALLOC, OP_ALLOC_PITCH, OP_CREATE):
        body += " c.stack = gw_stack(ctx); c.caller = gw_caller(ctx); gw_copy_stack(ctx, &c);"
    return body.strip()


def render_programs() -> str:
    """The two programs every probe runs: gw_entry at each hooked symbol's first instruction and
    gw_return at its return, told which symbol by the attach cookie (API index and flags).

    Hooks whose entry work is the same share one switch case, so the program is as long as the
    distinct kinds of work, not the number of symbols; the API stays a variable (the cookie's)."""
    entry: dict[str, list[int]] = {}
    ops: dict[int, list[int]] = {}
    for api, h in enumerate(HOOKS):
        entry.setdefault(_entry_body(h), []).append(api)
        ops.setdefault(h.op, []).append(api)
    cases = []
    for body, apis in entry.items():
        labels = " ".join(f"case {a}:" for a in apis)
        cases.append(f"    {labels}\n        {body} break;" if body else f"    {labels}\n        break;")
    op_name = {v: k for k, v in OPS.items() if k.startswith("OP_")}
    op_cases = [f"    {' '.join(f'case {a}:' for a in apis)}\n        op = GW_{op_name[op]}; break;"
                for op, apis in ops.items() if op != OP_COUNT]
    return (
        "int gw_entry(struct pt_regs *ctx) {\n"
        "    if (gw_frozen())\n        return 0;\n"
        "    u64 cookie = bpf_get_attach_cookie(ctx);\n"
        "    u32 api = cookie & GW_COOKIE_API;\n"
        "    struct gw_call c = {};\n"
        "    c.stack = -1;\n"
        "    switch (api) {\n" + "\n".join(cases) + "\n"
        "    default:\n        return 0;\n    }\n"
        "    if (cookie & GW_COOKIE_TIMED)\n        return gw_enter(ctx, api, &c);\n"
        "    return gw_count(ctx, api, c.bytes);\n}\n\n"
        "int gw_return(struct pt_regs *ctx) {\n"
        "    if (gw_frozen())\n        return 0;\n"
        "    u64 cookie = bpf_get_attach_cookie(ctx);\n"
        "    u32 api = cookie & GW_COOKIE_API;\n"
        "    u32 op = GW_OP_COUNT;\n"
        "    switch (api) {\n" + "\n".join(op_cases) + "\n"
        "    default:\n        break;\n    }\n"
        "    return gw_finish(ctx, api, op, cookie & GW_COOKIE_EVENTS);\n}\n")


# ---- the same structs as ctypes types, for reading the maps -----------------------------------
_SCALARS = {"u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "s32": ctypes.c_int32, "s64": ctypes.c_int64,
            "char": ctypes.c_char}
_TYPES: dict[str, type] = {}


def ctype(name: str) -> type:
    """The ctypes Structure of a STRUCTS entry, or of a scalar ("u32": one field named value) or
    an array of one ("u64[127]": one field named ip), as a map key or value."""
    t = _TYPES.get(name)
    if t is not None:
        return t
    if name in STRUCTS:
        fields = []
        for cty, field in STRUCTS[name]:
            base = _field_type(cty)
            m = re.fullmatch(r"(\w+)\[(\d+)\]", field)
            fields.append((m.group(1), base * int(m.group(2))) if m else (field, base))
    else:
        m = re.fullmatch(r"(\w+)\[(\d+)\]", name)
        fields = [("ip", _SCALARS[m.group(1)] * int(m.group(2)))] if m else [("value", _SCALARS[name])]
    t = _TYPES[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return t


def _field_type(cty: str) -> type:
    return ctype(cty[len("struct "):]) if cty.startswith("struct ") else _SCALARS[cty]
