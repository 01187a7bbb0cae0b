"""Who launched a kernel: sampled launch stacks through the real eBPF probe, native (driver.c,
built with frame pointers) and Python (a CPython program calling the fake libcuda through ctypes,
which releases the GIL around the call, as many extensions do)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from gpuwatch.probes.ebpf.probe import EbpfCudaProbe

from .test_ebpf_cuda import handle
from .test_ebpf_graphs import traced

pytestmark = pytest.mark.root


def samples(launches: int, every: int = 1024) -> int:
    """How many of a kernel's launches have their stack taken: 1, 2, 4, ... up to `every`, then
    one in `every`."""
    powers = sum(1 for i in range(11) if 2 ** i <= min(launches, every))
    return powers + max(0, launches // every - 1)


def _stacks(snap: dict) -> dict:
    return {k["handle"]: k.get("stacks") for k in snap["kernels"]}


def test_native_launch_stacks_name_the_launching_functions(fake_cuda, drivers):
    d = drivers()
    snap = traced(fake_cuda["lib"], d)
    by = _stacks(snap)
    launches = {k["handle"]: k["launches"] for k in snap["kernels"]}
    for h in (handle(0xa000), handle(0xb000), handle(0xc000)):  # each launched by one thread: exact
        assert sum(s["sampled_launches"] for s in by[h]) == samples(launches[h]), h
    # D's 4 threads race between the count's increment and its read (cuda.bpf.c: "a sample more or
    # less" where two launches meet at a power of two); its launch count itself stays exact
    sampled_d = sum(s["sampled_launches"] for s in by[handle(0xd000)])
    assert abs(sampled_d - samples(launches[handle(0xd000)])) <= 2 and sampled_d >= 1, (sampled_d, launches)
    for h in (handle(0xa000), handle(0xb000), handle(0xc000), handle(0xd000)):
        for s in by[h]:
            assert s["frames"][0].startswith("cuLaunch") and s["python"] == []
    # D is launched by 4 threads running launcher(); the others from the main workload
    (d_stack,) = by[handle(0xd000)]
    assert d_stack["frames"][1].startswith("launcher+") and "[driver]" in d_stack["frames"][1]
    assert any(f.startswith(("work+", "main+")) for s in by[handle(0xa000)] for f in s["frames"][1:3])
    # A's first launch (a grid of one block) is its own call site: two stacks, busiest first
    assert [s["sampled_launches"] for s in by[handle(0xa000)]] == [samples(1009) - 1, 1]


PROGRAM = textwrap.dedent('''\
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    f = ctypes.c_void_p()
    lib.cuModuleGetFunction(ctypes.byref(f), None, b"py_kernel")
    g = ctypes.c_void_p()
    lib.cuModuleGetFunction(ctypes.byref(g), None, b"py_other")


    def launch_from_python(n):
        for _ in range(n):
            lib.cuLaunchKernel(f, 7, 1, 1, 64, 1, 1, 0, None, None, None)  # line 11


    def outer():
        launch_from_python(300)  # line 15
        lib.cuLaunchKernel(g, 1, 1, 1, 32, 1, 1, 0, None, None, None)  # line 16


    print("ready", flush=True)
    sys.stdin.readline()
    outer()  # line 21
    print("done", flush=True)
    sys.stdin.readline()
    ''')


def start_launcher(tmp_path, lib: str, program: str = PROGRAM):
    """PROGRAM written to tmp_path and started on the fake libcuda, up to its "ready": (path, process)."""
    prog = tmp_path / "launcher.py"
    prog.write_text(program)
    p = subprocess.Popen([sys.executable, str(prog), lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return prog, p


def test_python_frames_of_a_launch_from_a_cpython_program(fake_cuda, tmp_path):
    prog, p = start_launcher(tmp_path, fake_cuda["lib"])
    try:
        probe = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=p.pid, driver_names=False)
        probe.start()
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            snap = probe.snapshot(p.pid)
        finally:
            probe.shutdown()
    finally:
        p.stdin.close()
        p.wait(10)
    assert snap["python_frames"] == "read"
    busiest, other = snap["kernels"]
    assert busiest["launches"] == 300 and other["launches"] == 1
    (stack,) = busiest["stacks"]
    assert stack["sampled_launches"] == samples(300)
    assert stack["python"] == [f"{prog}:11 in launch_from_python", f"{prog}:15 in outer", f"{prog}:21 in <module>"]
    assert other["stacks"][0]["python"] == [f"{prog}:16 in outer", f"{prog}:21 in <module>"]


def test_a_kernel_in_a_graph_has_the_stack_that_captured_it(fake_cuda, drivers):
    d = drivers(None, "graphs")
    snap = traced(fake_cuda["lib"], d)
    by = _stacks(snap)
    # D was only ever captured or launched from graphs_work (inlined into main at -O1) and launcher-less
    assert by[handle(0xd000)] and all(s["frames"][0].startswith("cuLaunchKernel_ptsz") for s in by[handle(0xd000)])
    # B's CUkernel was only ever an explicit node: no launch, no capture, no stack
    assert by[handle(0xb100)] == []


def test_the_live_view_and_summary_show_where_kernels_are_launched_from(fake_cuda, tmp_path):
    from gpuwatch.agent.trace.output import read_summary
    from .test_trace_cli import Trace
    prog, p = start_launcher(tmp_path, fake_cuda["lib"])
    try:
        out = tmp_path / "summary.json"
        trace_out = tmp_path / "calls.json"
        t = Trace("-p", str(p.pid), "--library", fake_cuda["lib"], "--summary-json", str(out),
                  "--output", str(trace_out), "--interval", "0.2")
        t.wait_attached()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        deadline = time.monotonic() + 30
        while not any("kernels 2" in line for line in t.out):
            assert time.monotonic() < deadline, t.stdout
            time.sleep(0.05)
        p.stdin.close()
        p.wait(10)
        assert t.wait() == 0, t.stderr
    finally:
        if p.poll() is None:
            p.kill()
    summary = read_summary(str(out))
    assert summary["kernels"][0]["stacks"][0]["python"][0] == f"{prog}:11 in launch_from_python"
    assert "kernels launched from (sampled launch stacks):" in t.stdout
    assert f"{prog}:11 in launch_from_python" in t.stdout
    events = json.loads(trace_out.read_text())["traceEvents"]
    launch = next(e for e in events if e.get("name") == "cuLaunchKernel")
    assert launch["args"]["stack"][0] == f"{prog}:11 in launch_from_python"


def test_the_agent_reads_a_new_processs_python_frames_from_its_first_launches(fake_cuda, tmp_path):
    """Every process (the agent's probe): a CPython process is looked at when its first launch is
    sampled, not at the next collection, so its later samples have their Python frames."""
    probe = EbpfCudaProbe(libraries=[fake_cuda["lib"]], driver_names=False)
    probe.start()
    try:
        _, p = start_launcher(tmp_path, fake_cuda["lib"],
                              PROGRAM.replace("launch_from_python(300)", "launch_from_python(20000)"))
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            stacks = probe.loader.launch_stacks(p.pid)  # no collection, no snapshot since the start
        finally:
            p.stdin.close()
            p.wait(10)
    finally:
        probe.shutdown()
    (busiest,) = [v for v in stacks.values() if sum(n for n, *_ in v) == samples(20000)]
    with_python = sum(n for n, _sid, _caller, py in busiest if py)
    assert with_python >= samples(20000) - 11  # all but the first ones, taken before the process was looked at
