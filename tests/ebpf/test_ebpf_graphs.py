"""CUDA graphs through the real eBPF probe: tests/ebpf/driver.c "graphs" builds graphs every way
the probe follows (stream capture on one stream and forked across two, explicit kernel nodes by
CUfunction and by CUkernel, a node changed in an executable graph, an executable graph updated,
destroyed and its address handed out again, a failed capture) and launches them a known number of
times; one graph is captured and instantiated before "ready", so before a probe attached after it.
The counts below are driver.c's graphs_work(), computed there in its comments.
"""
from __future__ import annotations

import time

import pytest

from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

from .conftest import count_drops
from .test_ebpf_cuda import handle

pytestmark = pytest.mark.root

A, B, C, D, B_KERNEL = (handle(0xa000), handle(0xb000), handle(0xc000), handle(0xd000), handle(0xb100))
# kernel handle -> (direct launches, launches through graphs, launches with a grid of one block)
GRAPH_KERNELS = {A: (1, 68, 0), B: (0, 22, 0), C: (0, 29, 29), D: (2, 52, 0), B_KERNEL: (0, 16, 0)}
REPLAYS = 62  # cuGraphLaunch calls
UNKNOWN_REPLAYS = 17  # of the graph instantiated before the probe attached
BEFORE_READY_NODES = 3  # that graph's kernel nodes: A x3
# every call is counted as a call, captured or not: the API was called
LAUNCH_CALLS = {"cuLaunchKernel": 7, "cuLaunchKernelEx": 2, "cuLaunchCooperativeKernel": 1, "cuLaunchKernel_ptsz": 7,
                "cuGraphLaunch": REPLAYS}


def traced(lib: str, d) -> dict:
    """The workload of driver d run once under a trace of it (pid-filtered probe): its snapshot."""
    probe = EbpfCudaProbe(libraries=[lib], pid=d.pid, driver_names=False)
    probe.start()
    try:
        d.go()
        return probe.snapshot(d.pid)
    finally:
        probe.shutdown()


def _by_handle(snapshot: dict) -> dict:
    return {k["handle"]: (k["direct_launches"], k["graph_launches"], k["degenerate_launches"])
            for k in snapshot["kernels"]}


def test_kernels_in_graphs_are_counted_and_named_direct_vs_graph(fake_cuda, drivers):
    d = drivers(None, "graphs")
    snap = traced(fake_cuda["lib"], d)
    assert _by_handle(snap) == GRAPH_KERNELS
    for k in snap["kernels"]:
        assert k["launches"] == k["direct_launches"] + k["graph_launches"]
    names = {k["handle"]: k["name"] for k in snap["kernels"]}
    assert names[A] == "add_kernel(float*, int)" and names[B] == names[B_KERNEL] == "gemm_bf16"
    assert names[C] == "coop_reduce"
    # a kernel's configuration is a node's when it ran only in graphs
    by = {k["handle"]: k for k in snap["kernels"]}
    assert by[B_KERNEL]["grid"] == [9, 1, 1] and by[B_KERNEL]["block"] == [64, 1, 1]
    assert by[C]["grid"] == [1, 1, 1] and by[C]["shared_mem_bytes"] == 48
    assert snap["graphs"] == {"launches": REPLAYS, "kernel_launches": sum(g for _, g, _ in GRAPH_KERNELS.values()),
                              "unknown_content_launches": UNKNOWN_REPLAYS, "partial_content_launches": 0,
                              "graphs": 3, "executable_graphs": 3, "captures_in_progress": 0}
    assert {a: snap["apis"][a]["calls"] for a in LAUNCH_CALLS} == LAUNCH_CALLS
    assert count_drops(snap) == {}


def test_the_daemon_probe_exports_graph_replays_and_their_kernels(fake_cuda, drivers):
    probe = EbpfCudaProbe(libraries=[fake_cuda["lib"]], driver_names=False)  # every process, exact launches
    probe.start()
    d = drivers(None, "graphs")  # started after the probe: the graph made before "ready" is known
    try:
        d.go()
        samples = probe.collect()
    finally:
        probe.shutdown()
    mine = [s for s in samples if s.labels.get("pid") == str(d.pid)]
    kernels = [s.value for s in mine if s.metric == "gpuwatch.cuda.graph.kernel.launches"]
    assert kernels == [sum(g for _, g, _ in GRAPH_KERNELS.values()) + UNKNOWN_REPLAYS * BEFORE_READY_NODES]
    replays = {s.labels["content"]: s.value for s in mine if s.metric == "gpuwatch.cuda.graph.launches"}
    assert replays == {"known": REPLAYS, "partial": 0, "unknown": 0}
    assert all(s.labels["process"] == "driver" for s in mine)


def test_a_capture_while_launches_are_off_is_partial_and_turns_them_on(fake_cuda, drivers):
    probe = EbpfCudaProbe(libraries=[fake_cuda["lib"]], driver_names=False, launch_sampling=0.1,
                          sampling_period=3600, exact_launch_rate=0, young_seconds=0)
    probe.start()
    try:
        probe.collect()  # the duty cycle starts with its window open
        ld = probe.loader
        ld.set_launches(False)  # as in the 90 % of the time it is closed
        d = drivers(None, "graphs")
        d.go()
        deadline = time.monotonic() + 5
        while not ld.launches_on:  # the first capture's begin turned them on, without a collection
            assert time.monotonic() < deadline, "a capture did not turn the launch probes on"
            time.sleep(0.01)
        snap = probe.snapshot(d.pid)
    finally:
        probe.shutdown()
    g = snap["graphs"]
    # x1's first 7 replays at least ran a graph captured while launches were off; the explicit
    # graph (16 replays) needs no launch probe; nothing is counted as known that is not
    assert g["partial_content_launches"] >= 7
    assert g["launches"] == REPLAYS
    assert g["unknown_content_launches"] == 0  # the probe saw the graph made before "ready" being made
    assert _by_handle(snap)[B_KERNEL] == (0, 16, 0)
    assert all(k["graph_launches"] <= GRAPH_KERNELS.get(k["handle"], (0, 0, 0))[1] + UNKNOWN_REPLAYS * BEFORE_READY_NODES
               for k in snap["kernels"])


def _summary_kernels(summary: dict) -> dict:
    return {k["handle"]: (k["direct_launches"], k["graph_launches"], k["degenerate_launches"])
            for k in summary["kernels"]}


def test_trace_standalone_reports_graph_kernels_and_the_graph_it_could_not_see(fake_cuda, drivers, tmp_path):
    from gpuwatch.agent.trace.output import read_summary
    from .test_trace_cli import Trace
    d = drivers(None, "graphs")  # one graph made before the trace attached
    out = tmp_path / "summary.json"
    t = Trace("-p", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(out), "--interval", "0.2")
    t.wait_attached()
    d.go()
    deadline = time.monotonic() + 30
    while not any(f"graphs {REPLAYS} replays" in line for line in t.out):  # a refresh has seen it all
        assert time.monotonic() < deadline, t.stdout
        time.sleep(0.05)
    assert d.finish() == 0
    assert t.wait() == 0, t.stderr
    summary = read_summary(str(out))
    assert _summary_kernels(summary) == GRAPH_KERNELS
    assert summary["graphs"]["launches"] == REPLAYS
    assert summary["graphs"]["unknown_content_launches"] == UNKNOWN_REPLAYS
    assert summary["graphs"]["kernel_launches"] == sum(g for _, g, _ in GRAPH_KERNELS.values())
    # said, not hidden: the replays whose kernels are not counted
    assert f"CUDA graphs: {REPLAYS} replays ran {summary['graphs']['kernel_launches']} kernels" in t.stdout
    assert f"{UNKNOWN_REPLAYS} replays of graphs made before the probe attached" in t.stdout
    assert "in graphs" in t.stdout and "Traceback" not in t.stderr
