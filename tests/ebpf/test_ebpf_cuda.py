"""The eBPF CUDA probe against real uprobes on a fake libcuda.so.1 (see conftest.py, driver.c).

Every count here is what driver.c does, exactly; the probe must report it exactly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.agent.metrics import REGISTRY
from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import API_IDS, HOOKS, timed
from .conftest import count_drops

pytestmark = pytest.mark.root

KIB4 = 4096
# api -> (calls, errors, bytes): mirrors driver.c
EXPECTED = {
    # kernel names: A, C and one failing lookup; B and D through CUkernels
    "cuModuleGetFunction": (3, 1, 0),
    "cuLibraryGetKernel": (2, 0, 0),
    "cuKernelGetFunction": (2, 0, 0),
    "cuLaunchKernel": (1009, 0, 0),
    "cuLaunchKernel_ptsz": (4 * 101, 0, 0),  # from 4 threads
    "cuLaunchKernelEx": (53, 0, 0),
    "cuLaunchCooperativeKernel": (11, 0, 0),
    "cuGraphLaunch": (13 + 4, 0, 0),  # 4 of them fail: launches are entry-only, errors unseen
    # 307 allocations of (i+1)*4 KiB, then 5 failing 1 GiB ones (bytes asked for still count)
    "cuMemAlloc_v2": (307 + 5, 5, sum((i + 1) * KIB4 for i in range(307)) + 5 * (1 << 30)),
    # 211 frees (bytes: the sizes released), then 3 failing frees (release nothing)
    "cuMemFree_v2": (211 + 3, 3, sum((i + 1) * KIB4 for i in range(211))),
    "cuMemAllocPitch_v2": (3, 0, 3 * 1024 * 17),  # pitch 1024 (width 1000 rounded) x height 17
    "cuMemAllocManaged": (2, 0, 2 << 20),
    "cuMemAllocAsync": (4, 0, 4 * 8192),
    "cuMemFreeAsync": (4, 0, 4 * 8192),
    "cuMemCreate": (2, 0, 2 * (2 << 20)),
    "cuMemRelease": (1, 0, 2 << 20),
    "cuMemcpyHtoD_v2": (101, 0, 101 * 65536),
    "cuMemcpyDtoH_v2": (103, 0, 103 * 4096),
    "cuMemcpyDtoD_v2": (17, 0, 17 * 1000),
    "cuMemcpyAsync": (19, 0, 19 * 333),
    "cuMemcpyHtoDAsync_v2": (23, 0, 23 * 128),
    "cuMemsetD8_v2": (29, 0, 29 * 100),
    "cuMemsetD32_v2": (31, 0, 31 * 100 * 4),
    "cuMemsetD32Async": (37, 0, 37 * 10 * 4),
    "cuMemsetD2D8_v2": (7, 0, 7 * 100 * 9),
    "cuMemcpy2D_v2": (13, 0, 13 * 300 * 7),  # WidthInBytes x Height from the descriptor
    "cuMemcpy3D_v2": (5, 0, 5 * 64 * 8 * 3),  # WidthInBytes x Height x Depth
    "cuStreamSynchronize": (41, 0, 0),
    "cuCtxSynchronize": (43, 0, 0),
    "cuEventSynchronize": (47, 0, 0),
}
# errors by return code (driver.c injects CUDA_ERROR_INVALID_VALUE = 1 and CUDA_ERROR_OUT_OF_MEMORY = 2)
ERRORS_BY_CODE = {"cuModuleGetFunction": {"CUDA_ERROR_INVALID_VALUE": 1},
                  "cuMemAlloc_v2": {"CUDA_ERROR_OUT_OF_MEMORY": 5},
                  "cuMemFree_v2": {"CUDA_ERROR_INVALID_VALUE": 3}}
# live after the run: allocations 212..307, 3 pitched, 2 managed, 1 of 2 cuMemCreate handles
LIVE_BYTES = sum((i + 1) * KIB4 for i in range(211, 307)) + 3 * 1024 * 17 + 2 * (1 << 20) + (2 << 20)
LIVE_ALLOCATIONS = 96 + 3 + 2 + 1
# driver.c's kernel D: longer than the probe keeps (127 bytes), so truncated and marked "…"
NAME_D = ("_ZN5flash3fwd24flash_fwd_splitkv_kernelIN7cutlass10bfloat16_tELi128ELi64ELi128ELi4ELb0ELb0ELb1ELb1ELb0ELb0ELb1"
          "ELb0ELb0ELb1ELb1ELb0ELb1EEEvNS0_16Flash_fwd_paramsE")
# fakecuda.c's function and kernel objects live at fixed addresses: handle(0xa000) is kernel A's
OBJECTS = 0x10000000


def handle(offset: int) -> str:
    return hex(OBJECTS + offset)


# Per kernel handle (driver.c): name (demangled) and symbol, where the name came from (the
# naming hooks; D's name is longer than they keep, so read whole from the driver's memory),
# launches, last grid, last block, last shared memory, last stream, degenerate launches (grid of
# one block)
NAME_D_DEMANGLED = ("void flash::fwd::flash_fwd_splitkv_kernel<cutlass::bfloat16_t, 128, 64, 128, 4, false, false, "
                    "true, true, false, false, true, false, false, true, true, false, true>(flash::fwd::Flash_fwd_params)")
KERNELS = [
    {"handle": handle(0xa000), "name": "add_kernel(float*, int)", "symbol": "_Z10add_kernelPfi",
     "name_source": "hook", "launches": 1009, "direct_launches": 1009, "graph_launches": 0, "grid": [1056, 1, 1], "block": [256, 1, 1],
     "shared_mem_bytes": 0, "degenerate_launches": 1, "stream": "0x5001"},
    {"handle": handle(0xd000), "name": NAME_D_DEMANGLED, "symbol": NAME_D, "name_source": "driver",
     "launches": 4 * 101, "direct_launches": 4 * 101, "graph_launches": 0, "grid": [3, 5, 7], "block": [32, 4, 2],
     "shared_mem_bytes": 1024, "degenerate_launches": 0, "stream": "0x5004"},
    {"handle": handle(0xb000), "name": "gemm_bf16", "symbol": "gemm_bf16", "name_source": "hook",
     "launches": 53, "direct_launches": 53, "graph_launches": 0, "grid": [7, 3, 2], "block": [128, 2, 1],
     "shared_mem_bytes": 4096, "degenerate_launches": 0, "stream": "0x5002"},
    {"handle": handle(0xc000), "name": "coop_reduce", "symbol": "coop_reduce", "name_source": "hook",
     "launches": 11, "direct_launches": 11, "graph_launches": 0, "grid": [1, 1, 1], "block": [64, 1, 1],
     "shared_mem_bytes": 48, "degenerate_launches": 11, "stream": "0x5003"},
]


def unstacked(kernels: list[dict]) -> list[dict]:
    """Kernels without their sampled launch stacks (test_ebpf_stacks.py checks those)."""
    return [{k: v for k, v in e.items() if k != "stacks"} for e in kernels]
UNNAMED = {"name": None, "symbol": None, "name_source": None}
LAUNCH_APIS = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
               "cuGraphLaunch")
NOT_IN_FAKE = ("cuGraphLaunch_ptsz", "cuMemcpy3DAsync_v2_ptsz", "cuLaunchCooperativeKernel_ptsz")


@pytest.fixture(scope="module")
def probe(fake_cuda):
    """One system-wide probe on the fake library, shared by the module: one compile."""
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], rescan_interval=3600)
    t0 = time.perf_counter()
    p.start()
    p.start_seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
    yield p
    p.shutdown()


def _calls(samples, pid: str, api: str, metric: str = "gpuwatch.cuda.calls") -> float | None:
    for s in samples:
        if s.metric == metric and s.labels.get("pid") == pid and s.labels.get("api") == api:
            return s.value
    return None


def _probe_fds(kind: str = "bpf_link") -> int:
    """This process's open fds of one kind: bpf_link (links, and the fallback's perf-event links),
    [perf_event] (the fallback's uprobes) — what holds uprobes in place."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"anon_inode:{kind}":
                n += 1
        except OSError:
            pass
    return n


def test_exact_counts_errors_and_bytes_per_api(probe, drivers):
    d = drivers()
    d.go()
    snap = probe.snapshot(d.pid)
    got = {api: (a["calls"], a["errors"], a["bytes"]) for api, a in snap["apis"].items()}
    assert got == EXPECTED
    assert {api: a["errors_by_code"] for api, a in snap["apis"].items() if a["errors_by_code"]} == ERRORS_BY_CODE
    assert count_drops(snap) == {}
    # launches are counted at entry only: no latency, no errors
    for api in LAUNCH_APIS:
        a = snap["apis"][api]
        assert (a["timed"], a["seconds"], a["mean_latency_s"], a["histogram"]) == (False, 0.0, 0.0, {}), api
    alloc = snap["apis"]["cuMemAlloc_v2"]
    assert alloc["timed"] and alloc["mean_latency_s"] > 0
    assert sum(alloc["histogram"].values()) == 312
    # Slot s (bcc's bpf_log2l) holds calls of 2^(s-1) <= ns < 2^s (slot 0: 0 ns), so the summed time
    # of every timed API lies between the histogram's lower and upper edges: a slot off by one breaks it.
    for api, a in snap["apis"].items():
        if a["timed"]:
            ns = round(a["seconds"] * 1e9)
            low = sum(c * (2 ** (int(s) - 1) if int(s) else 0) for s, c in a["histogram"].items())
            high = sum(c * 2 ** int(s) for s, c in a["histogram"].items())
            assert low <= ns < high or ns == high == 0, (api, low, ns, high)


def test_live_allocations_by_stack(probe, drivers):
    d = drivers()
    d.go()
    stacks = probe.snapshot(d.pid)["stacks"]
    assert [s["bytes"] for s in stacks] == sorted((s["bytes"] for s in stacks), reverse=True)
    # per allocating API (the compiler may unroll a short loop into several call sites): the 96
    # cuMemAlloc_v2 allocations left live, 1 of 2 cuMemCreate, 2 managed of 1 MiB, 3 pitched
    per_api: dict[str, list[int]] = {}
    for s in stacks:
        api = s["frames"][0].split("+")[0]
        assert s["frames"][0].endswith("[libcuda.so.1]"), s["frames"]
        assert s["frames"][1].startswith(("work+", "main+")), s["frames"]  # the caller (work() may be inlined)
        acc = per_api.setdefault(api, [0, 0])
        acc[0] += s["bytes"]
        acc[1] += s["allocations"]
    assert per_api == {"cuMemAlloc_v2": [sum((i + 1) * KIB4 for i in range(211, 307)), 96],
                       "cuMemCreate": [2 << 20, 1], "cuMemAllocManaged": [2 << 20, 2],
                       "cuMemAllocPitch_v2": [3 * 1024 * 17, 3]}
    # What a leak finding shows: the three stacks holding the most.
    assert probe.live_stacks(d.pid) == stacks[:3]


def test_per_kernel_launch_configuration(probe, drivers):
    d = drivers()
    d.go()
    snap = probe.snapshot(d.pid)
    assert unstacked(snap["kernels"]) == KERNELS
    assert count_drops(snap) == {}
    everyone = probe.snapshot()["kernels"]
    assert [dict(k, pid=d.pid) for k in KERNELS] == [k for k in everyone if k["pid"] == d.pid]


@pytest.mark.parametrize("driver_names", [False, True])
def test_kernel_names_from_handles_fetched_after_attach(fake_cuda, drivers, driver_names):
    # "early": kernel C's handle is fetched before the probe attaches, the others after
    d = drivers(None, "early")
    apis = ("cuModuleGetFunction", "cuLibraryGetKernel", "cuKernelGetFunction", "cuLaunchKernel",
            "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, apis=apis, driver_names=driver_names)
    p.start()
    try:
        d.go()
        snap = p.snapshot(d.pid)
        got = {api: (a["calls"], a["errors"]) for api, a in snap["apis"].items()}
        assert got == {"cuModuleGetFunction": (2, 1), "cuLibraryGetKernel": (2, 0), "cuKernelGetFunction": (2, 0),
                       "cuLaunchKernel": (1009, 0), "cuLaunchKernel_ptsz": (404, 0), "cuLaunchKernelEx": (53, 0),
                       "cuLaunchCooperativeKernel": (11, 0)}
        if driver_names:
            # C fetched before attach: named from the driver's memory (the calibration found the
            # fake driver's layout: object +16 -> info, info +24 -> name)
            want = [dict(k, name_source="driver") if k["handle"] == handle(0xc000) else k for k in KERNELS]
        else:
            # C fetched before attach: unnamed, its launches still counted; D only as far as kept
            want = [dict(k, **UNNAMED) if k["handle"] == handle(0xc000) else k for k in KERNELS]
            want[1] = dict(want[1], name=NAME_D[:127] + "…", symbol=NAME_D[:127] + "…", name_source="hook")
        assert unstacked(snap["kernels"]) == want
        assert count_drops(snap) == {}
        from gpuwatch.probes.ebpf.symbols import NAME_FUNCTION, NAME_KERNEL
        names = p.loader.names(d.pid)
        assert names == {
            (d.pid, NAME_FUNCTION, OBJECTS + 0xa000): (b"_Z10add_kernelPfi", False),
            (d.pid, NAME_KERNEL, OBJECTS + 0xb100): (b"gemm_bf16", False),
            (d.pid, NAME_FUNCTION, OBJECTS + 0xb000): (b"gemm_bf16", False),
            (d.pid, NAME_KERNEL, OBJECTS + 0xd100): (NAME_D[:127].encode(), True),
            (d.pid, NAME_FUNCTION, OBJECTS + 0xd000): (NAME_D[:127].encode(), True),
        }  # nothing for the failing lookup (0xe000 stays in the caller's variable)
        assert d.finish() == 0
        p.collect()  # prunes the exited process: its names too
        assert p.loader.names() == {} and d.pid not in p.loader.pids()
    finally:
        p.shutdown(wait=False)
    assert p.wait_detached(60)


def test_kernel_name_text():
    from gpuwatch.probes.ebpf.probe import _name_text
    assert _name_text(b"gemm_bf16", False) == "gemm_bf16"
    assert _name_text(b"x" * 127, True) == "x" * 127 + "…"
    assert _name_text(b"a\x1b[2Jb\xff", False) == "a?[2Jb\ufffd"


def test_live_bytes_after_allocs_and_frees(probe, drivers):
    d = drivers()
    d.go()
    mem = probe.snapshot(d.pid)["memory"]
    assert mem["live_bytes"] == LIVE_BYTES
    assert mem["live_allocations"] == LIVE_ALLOCATIONS
    assert mem["allocations"] == 307 + 3 + 2 + 4 + 2
    assert mem["frees"] == 211 + 4 + 1
    live = {s.labels["pid"]: s.value for s in probe.collect() if s.metric == "gpuwatch.process.cuda.memory.live"}
    assert live[str(d.pid)] == LIVE_BYTES


# driver.c edge(): kernels E (grid 1,1,2), F (grid 1,3,1) and G (grid 1,1,1) at fakecuda's fresh objects
EDGE_KERNELS = [
    {"handle": handle(0x20000), "name": "grid_z_only", "launches": 5, "grid": [1, 1, 2], "block": [32, 1, 1],
     "degenerate_launches": 0},
    {"handle": handle(0x20400), "name": "grid_y_only", "launches": 3, "grid": [1, 3, 1], "block": [64, 1, 1],
     "degenerate_launches": 0},
    {"handle": handle(0x20800), "name": "one_block", "launches": 2, "grid": [1, 1, 1], "block": [64, 1, 1],
     "degenerate_launches": 2},
]


def test_a_grid_of_one_block_in_two_dimensions_is_not_degenerate(probe, drivers):
    d = drivers(None, "edge")
    d.go()
    got = [{k: kern[k] for k in EDGE_KERNELS[0]} for kern in probe.snapshot(d.pid)["kernels"]]
    assert got == EDGE_KERNELS


def test_live_bytes_when_the_allocator_hands_an_address_out_again(probe, drivers):
    d = drivers(None, "edge")
    d.go()
    # a 4096 kept; b 12288 freed; c 8192 at b's address; d 20480 at it again with no free seen:
    # d's size replaces c's (the probe missed a free), so live is a + d
    mem = probe.snapshot(d.pid)["memory"]
    assert (mem["live_bytes"], mem["live_allocations"]) == (4096 + 20480, 2)
    assert (mem["allocations"], mem["frees"]) == (4, 1)
    assert probe.loader.live_bytes()[d.pid] == 4096 + 20480
    apis = probe.snapshot(d.pid)["apis"]
    assert (apis["cuMemAlloc_v2"]["bytes"], apis["cuMemFree_v2"]["bytes"]) == (4096 + 12288 + 8192 + 20480, 12288)

def test_missing_symbols_are_skipped_not_fatal(probe):
    (lib,) = probe.attached()
    for name in NOT_IN_FAKE:
        assert name in lib["skipped"] and name not in lib["attached"]
    assert {"cuLaunchKernel", "cuLaunchKernelEx", "cuMemAlloc_v2", "cuMemFree_v2"} <= set(lib["attached"])
    launches = [name for name in lib["attached"] if name.startswith(("cuLaunch", "cuGraphLaunch"))]
    assert sorted(launches) == sorted(LAUNCH_APIS + ("cuLaunchKernelEx_ptsz",))
    entry_only = [name for name in lib["attached"] if not timed(HOOKS[API_IDS[name]], False)]
    assert set(launches) <= set(entry_only)
    assert {n for n in entry_only if n not in launches} == {"cuEventRecord", "cuEventRecordWithFlags", "cuStreamWaitEvent"}
    assert lib["uprobes"] == 2 * len(lib["attached"]) - len(entry_only)  # launches and capture hooks: entry only


def test_samples_use_registered_metrics_with_exact_labels(probe, drivers):
    d = drivers()
    d.go()
    samples = probe.collect()
    assert samples
    for s in samples:
        m = REGISTRY[s.metric]
        assert s.metric in {"gpuwatch.cuda.calls", "gpuwatch.cuda.errors", "gpuwatch.cuda.call.duration",
                            "gpuwatch.cuda.bytes", "gpuwatch.process.cuda.memory.live", "gpuwatch.ebpf.attached",
                            "gpuwatch.ebpf.launch.sampled", "gpuwatch.cuda.graph.launches",
                            "gpuwatch.cuda.graph.kernel.launches"}
        assert s.resource == ""
        assert tuple(sorted(s.labels)) == tuple(sorted(m.labels)), s
    pid = str(d.pid)
    assert _calls(samples, pid, "cuLaunchKernel") == 1009
    assert _calls(samples, pid, "cuMemAlloc_v2", "gpuwatch.cuda.errors") == 5
    assert _calls(samples, pid, "cuMemcpyHtoD_v2", "gpuwatch.cuda.bytes") == 101 * 65536
    assert _calls(samples, pid, "cuMemAlloc_v2", "gpuwatch.cuda.call.duration") > 0
    # entry-only launches: no time or errors measured, so none reported
    for api in LAUNCH_APIS:
        assert _calls(samples, pid, api) is not None
        assert _calls(samples, pid, api, "gpuwatch.cuda.call.duration") is None
        assert _calls(samples, pid, api, "gpuwatch.cuda.errors") is None
    assert {s.labels["process"] for s in samples if s.labels.get("pid") == pid} == {"driver"}
    attached = {s.labels["what"]: s.value for s in samples if s.metric == "gpuwatch.ebpf.attached"}
    assert attached == {"libraries": 1, "uprobes": probe.attached()[0]["uprobes"]}


def test_top_processes_kept_rest_folded_into_other(probe, drivers):
    a, b = drivers(), drivers()
    a.go()
    b.go()
    probe.max_processes = 1
    try:
        samples = probe.collect()
    finally:
        probe.max_processes = 32
    pids = {s.labels["pid"] for s in samples if s.metric == "gpuwatch.cuda.calls"}
    assert "other" in pids and len(pids - {"other"}) == 1
    kept = (pids - {"other"}).pop()
    assert kept in (str(a.pid), str(b.pid))
    # both drivers ran the same workload; "other" holds the other one (and any exited earlier)
    assert _calls(samples, "other", "cuLaunchKernel") >= 1009


def test_exited_process_entries_removed_and_folded(probe, drivers):
    d = drivers()
    before = _calls(probe.collect(), "other", "cuLaunchKernel") or 0  # also prunes earlier drivers
    d.go()
    assert d.pid in probe.loader.pids()
    assert d.finish() == 0
    samples = probe.collect()
    assert d.pid not in probe.loader.pids()
    assert probe.loader.live_allocations(d.pid) == 0
    assert d.pid not in probe.loader.live_bytes()
    assert all(s.labels.get("pid") != str(d.pid) for s in samples)
    # its final counts are folded into pid="other", exactly
    assert _calls(samples, "other", "cuLaunchKernel") == before + 1009
    assert probe.snapshot(d.pid)["apis"] == {}
    assert probe.snapshot(d.pid)["kernels"] == []
    assert all(k["pid"] != d.pid for k in probe.snapshot()["kernels"])
    assert all(key[0] != d.pid for key in probe.loader.names())


@pytest.mark.parametrize("attach", ["links", "perf_events"])
def test_pid_filter_and_shutdown_detaches_everything(fake_cuda, drivers, attach):
    links_before, perf_before = _probe_fds(), _probe_fds("[perf_event]")
    a, b = drivers(), drivers()
    # few hooks: each perf-event uprobe takes ~0.1 s to detach (the kernel waits for an RCU grace period)
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=a.pid, apis=("cuLaunchKernel", "cuMemAlloc_v2"),
                      attach=attach)
    p.start()
    try:
        uprobes = p.attached()[0]["uprobes"]
        assert uprobes == 3  # cuLaunchKernel at entry, cuMemAlloc_v2 at entry and return
        if attach == "links":  # one link each: the return probes, the entries, the launch entries
            assert (_probe_fds() - links_before, _probe_fds("[perf_event]") - perf_before) == (3, 0)
        else:  # a perf event and its link per probe
            assert (_probe_fds() - links_before, _probe_fds("[perf_event]") - perf_before) == (uprobes, uprobes)
        a.go()
        b.go()
        assert p.attached()[0]["attached"] == ["cuLaunchKernel", "cuMemAlloc_v2"]
        snap = p.snapshot(a.pid)
        assert {api: a["calls"] for api, a in snap["apis"].items()} == {"cuLaunchKernel": 1009, "cuMemAlloc_v2": 312}
        assert p.snapshot(b.pid)["apis"] == {}
    finally:
        p.shutdown()
    assert (_probe_fds(), _probe_fds("[perf_event]")) == (links_before, perf_before)
    assert p.loader is None and p.attached() == []
    with open("/sys/kernel/tracing/uprobe_events") as f:
        assert fake_cuda["lib"] not in f.read()
    p.shutdown()  # idempotent
    with pytest.raises(ProbeUnavailable, match="not started"):
        p.collect()


def test_launch_latency_option_times_launches_and_counts_errors(fake_cuda, drivers):
    d = drivers()
    apis = ("cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch", "cuMemFree_v2")
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, apis=apis, launch_latency=True)
    p.start()
    try:
        assert p.attached()[0]["uprobes"] == 2 * len(apis)
        d.go()
        snap = p.snapshot(d.pid)
        got = {api: (a["calls"], a["errors"], a["bytes"]) for api, a in snap["apis"].items()}
        assert got == {"cuLaunchKernel": (1009, 0, 0), "cuLaunchKernelEx": (53, 0, 0),
                       "cuGraphLaunch": (17, 4, 0), "cuMemFree_v2": EXPECTED["cuMemFree_v2"][:2] + (0,)}
        for api in apis:
            a = snap["apis"][api]
            assert a["timed"] and a["mean_latency_s"] > 0
            assert sum(a["histogram"].values()) == a["calls"]
        # per-kernel aggregation is the same with or without the return probes (no naming API is
        # hooked here: every name read from the driver's memory)
        assert unstacked(snap["kernels"]) == [dict(k, name_source="driver") for k in KERNELS
                                   if k["handle"] in (handle(0xa000), handle(0xb000))]
        assert snap["apis"]["cuGraphLaunch"]["errors_by_code"] == {"CUDA_ERROR_INVALID_VALUE": 4}
        samples = p.collect()
        assert _calls(samples, str(d.pid), "cuGraphLaunch", "gpuwatch.cuda.errors") == 4
        assert _calls(samples, str(d.pid), "cuLaunchKernel", "gpuwatch.cuda.call.duration") > 0
    finally:
        p.shutdown(wait=False)
    assert p.wait_detached(60)


def _first_byte(pid: int, lib: str, symbol: str) -> int:
    """The first byte of a function of `lib` as the process sees it: 0xCC (int3) where a uprobe is
    installed in that process. The function's file offset is found in the mapping that holds it."""
    from gpuwatch.probes.ebpf import loader
    real = os.path.realpath(lib)
    off = loader.function_offsets(lib)[symbol]
    addr = None
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                map_off = int(parts[2], 16)
                if map_off <= off < map_off + (end - start):
                    addr = start + off - map_off
                    break
    assert addr is not None, f"{symbol} of {real} not mapped by {pid}"
    with open(f"/proc/{pid}/mem", "rb") as m:
        m.seek(addr)
        return m.read(1)[0]


INT3 = 0xCC
SHUTDOWN_APIS = ("cuLaunchKernel", "cuLaunchKernelEx", "cuMemAlloc_v2", "cuMemFree_v2")


def _uprobes_installed(pid: int, lib: str, apis=SHUTDOWN_APIS) -> list[bool]:
    """Which of these functions carry a breakpoint (a uprobe) in this process's memory."""
    return [_first_byte(pid, lib, api) == INT3 for api in apis]


def _uprobe_events_mention(lib: str) -> bool:
    """Whether tracefs' uprobe_events names the library or its directory (a named uprobe left behind)."""
    for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            with open(f"{d}/uprobe_events") as f:
                text = f.read()
        except OSError:
            continue
        if lib in text or os.path.basename(os.path.dirname(lib)) in text:
            return True
    return False


def test_shutdown_without_waiting_detaches_in_the_background(fake_cuda_private, drivers):
    # A library of its own: the module's probe on fake_cuda would keep its functions patched.
    lib = fake_cuda_private["lib"]
    d = drivers(fake_cuda_private["driver"])
    assert _uprobes_installed(d.pid, lib) == [False] * 4
    fds_before = _probe_fds(), _probe_fds("[perf_event]")
    p = EbpfCudaProbe(libraries=[lib], apis=SHUTDOWN_APIS, attach="perf_events")  # system-wide, slow detach
    p.start()
    try:
        assert p.attached()[0]["uprobes"] == 2 + 2 * 2  # two launches entry-only, two entry+return
        assert _uprobes_installed(d.pid, lib) == [True] * 4
        d.go()
        assert [k["launches"] for k in p.snapshot(d.pid)["kernels"]] == [1009, 53]
    finally:
        t0 = time.perf_counter()
        p.shutdown(wait=False)
        returned = time.perf_counter() - t0
    assert returned < 0.5, returned
    assert p.loader is None and p.attached() == []
    t0 = time.perf_counter()
    assert p.wait_detached(60)
    print(f"shutdown(wait=False) returned in {returned * 1e3:.1f} ms; background detach of 6 uprobes "
          f"finished {time.perf_counter() - t0:.2f} s later")
    assert (_probe_fds(), _probe_fds("[perf_event]")) == fds_before
    assert _uprobes_installed(d.pid, lib) == [False] * 4
    assert not _uprobe_events_mention(lib)
    assert p.wait_detached(0)  # nothing left: idempotent


_CHILD = """
import os, signal, sys, time
from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import API_IDS, HOOKS, timed
p = EbpfCudaProbe(libraries=[sys.argv[1]], apis=sys.argv[3].split(","), attach=sys.argv[4])
p.start()
print("attached", p.loader.uprobe_count, flush=True)
sys.stdin.readline()
if sys.argv[2] == "background":
    t0 = time.perf_counter()
    p.shutdown(wait=False)
    print("returned %.4f" % (time.perf_counter() - t0), flush=True)
    sys.exit(0)  # the daemon thread is still detaching: the exit must not wait for it
os.kill(os.getpid(), signal.SIGKILL)  # "killed": no detach at all
"""


@pytest.mark.parametrize("how,attach", [("background", "perf_events"), ("killed", "perf_events"),
                                        ("killed", "links")])
def test_exiting_process_releases_its_uprobes(fake_cuda_private, drivers, how, attach):
    lib = fake_cuda_private["lib"]
    d = drivers(fake_cuda_private["driver"])
    child = subprocess.Popen([sys.executable, "-c", _CHILD, lib, how, ",".join(SHUTDOWN_APIS), attach],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        line = child.stdout.readline().split()
        assert line == ["attached", "6"], line
        assert _uprobes_installed(d.pid, lib) == [True] * 4
        t0 = time.perf_counter()
        child.stdin.write("go\n")
        child.stdin.flush()
        if how == "background":
            returned = float(child.stdout.readline().split()[1])
            assert returned < 0.5
        rc = child.wait(60)
        exited = time.perf_counter() - t0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert rc == (0 if how == "background" else -signal.SIGKILL)
    print(f"{how}: the attached process was gone {exited:.2f} s after being told to exit")
    assert _uprobes_installed(d.pid, lib) == [False] * 4
    assert not _uprobe_events_mention(lib)


def test_system_wide_finds_libcuda_in_running_processes(drivers):
    d = drivers()  # maps .../libcuda.so.1 before the probe starts
    p = EbpfCudaProbe(rescan_interval=3600, apis=("cuLaunchKernelEx",))
    p.start()
    try:
        paths = [lib["path"] for lib in p.attached()]
        # under the path this process sees it by: the same file, and it outlives the process
        assert any(path.endswith("/libcuda.so.1") and not path.startswith("/proc/") for path in paths), paths
        d.go()
        assert p.snapshot(d.pid)["apis"]["cuLaunchKernelEx"]["calls"] == 53
    finally:
        p.shutdown()


def test_gone_pid_is_unavailable_before_compiling():
    pid = 1 << 22  # above pid_max's default ceiling
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    with pytest.raises(ProbeUnavailable, match=f"process {pid} does not exist"):
        EbpfCudaProbe(pid=pid).start()


def test_start_and_attach_time(probe):
    # ~0.6 s on the H200; generous here for slow CI machines
    assert probe.start_seconds < 15
    print(f"compile {probe.loader.compile_seconds:.2f} s, attach {probe.loader.attach_seconds:.3f} s, "
          f"start {probe.start_seconds:.2f} s")


def _start_in_child(env_extra: dict | None = None, as_nobody: bool = False) -> str:
    """Start a default probe in a child interpreter; return what it raised."""
    import subprocess
    import sys
    code = ("from gpuwatch.probes.ebpf import EbpfCudaProbe\n"
            "try:\n    EbpfCudaProbe().start()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")

    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                       env=dict(os.environ, **(env_extra or {})), preexec_fn=drop if as_nobody else None,
                       timeout=60)
    return r.stdout + r.stderr


def test_unprivileged_start_says_what_to_do():
    out = _start_in_child(as_nobody=True)
    assert "ProbeUnavailable" in out and "needs root or the capabilities CAP_BPF and CAP_PERFMON" in out


def test_missing_bcc_says_how_to_install_it(tmp_path):
    fake = tmp_path / "bcc"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no bcc here')\n")
    # nothing cached: the probe must compile, in a child that finds this bcc
    out = _start_in_child({"PYTHONPATH": str(tmp_path), "GPUWATCH_BPF_CACHE": "off"})
    assert "ProbeUnavailable" in out and "apt-get install python3-bpfcc" in out and "--system-site-packages" in out


def test_per_call_events_and_chrome_trace(fake_cuda, drivers, tmp_path):
    """events_path: one ring-buffer record per call (launches timed too), none dropped at this
    rate, written as a Chrome/Perfetto trace whose events match the counts exactly."""
    import json

    from gpuwatch.probes.ebpf import events
    d = drivers()
    raw = tmp_path / "events.raw"
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, events_path=str(raw))
    p.start()
    try:
        d.go()
        counts = p.stop_events()
        snap = p.snapshot(d.pid)
    finally:
        p.shutdown(wait=False)
    total = sum(calls for calls, _e, _b in EXPECTED.values())
    assert counts == {"recorded": total, "not_written": 0, "error": None}
    assert count_drops(snap) == {} and snap["events"] == counts
    names = {int(k["handle"], 16): k["name"] for k in snap["kernels"]}
    out = tmp_path / "trace.json"
    assert events.write_chrome_trace(str(raw), str(out), kernel_names=names, processes={d.pid: "driver"}) == total
    doc = json.loads(out.read_text())
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    per_api: dict[str, list[int]] = {}
    for e in calls:
        acc = per_api.setdefault(e["name"], [0, 0, 0])
        acc[0] += 1
        acc[1] += "error" in e["args"]
        acc[2] += e["args"].get("bytes", 0)
        assert e["pid"] == d.pid and e["dur"] >= 0
    assert {api: tuple(v) for api, v in per_api.items()} == {
        api: (c, EXPECTED_WITH_LAUNCH_ERRORS.get(api, err), b) for api, (c, err, b) in EXPECTED.items()}
    a = [e for e in calls if e["name"] == "cuLaunchKernel"]
    assert {e["args"]["kernel"] for e in a} == {"add_kernel(float*, int)"}
    assert a[-1]["args"]["grid"] == [1056, 1, 1] and a[-1]["args"]["block"] == [256, 1, 1]
    oom = [e for e in calls if e["name"] == "cuMemAlloc_v2" and "error" in e["args"]]
    assert [e["args"]["error"] for e in oom] == ["CUDA_ERROR_OUT_OF_MEMORY"] * 5
    assert all(int(e["args"]["ptr"], 16) for e in calls if e["name"] == "cuMemAlloc_v2" and "error" not in e["args"])
    assert {e["name"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"} == {"process_name": "driver"}
    # the events are in time order per thread, one per call, each inside the trace's span
    assert all(x["ts"] <= y["ts"] for x, y in zip(a, a[1:]))
    assert p.wait_detached(60)


# launches timed (events on): their failures are seen too
EXPECTED_WITH_LAUNCH_ERRORS = {"cuGraphLaunch": 4}


def test_events_the_ring_buffer_cannot_hold_are_counted(fake_cuda, tmp_path, monkeypatch):
    """A reader that falls behind: every call is still counted, each as an event recorded or as
    one dropped (the ring buffer holds 16 MiB / 80 bytes = 209,715 records)."""
    from gpuwatch.probes.ebpf import events
    monkeypatch.setattr(events.EventRecorder, "_poll", lambda self: self._stop.wait())  # reads only at stop
    n = 240_007
    prog = subprocess.Popen([fake_cuda["hooked_calls"], "sync", "1", str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pid = int(prog.stdout.readline().split()[1])
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=pid, apis=["cuStreamSynchronize"], driver_names=False,
                      events_path=str(tmp_path / "events.raw"))
    p.start()
    try:
        prog.stdin.write("go\n")
        prog.stdin.flush()
        assert prog.stdout.readline().startswith("done")
        counts = p.stop_events()
        snap = p.snapshot(pid)
    finally:
        prog.stdin.close()
        prog.wait(30)
        p.shutdown(wait=False)
    assert snap["apis"]["cuStreamSynchronize"]["calls"] == n
    assert counts["recorded"] == (16 << 20) // 80 and counts["not_written"] == 0
    assert snap["dropped_by_kind"] == {"events": n - counts["recorded"]}
    assert snap["dropped_events"] == n - counts["recorded"]
    assert p.wait_detached(60)
