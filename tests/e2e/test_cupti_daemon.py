"""In-process agents and the daemon, as they meet on a node: real agent, real control socket.

On this CPU-only machine the in-process agent of a `gpuwatch run` program reports CUPTI
unavailable to the daemon, which exports it. The GPU side of the protocol is exercised with
records recorded on the H200 (tests/fixtures/cupti-h200.json, from tests/gpu/cupti_check.py),
folded by the same code the agent runs and sent over the socket as the agent sends them.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from gpuwatch.agent import control
from gpuwatch.probes.cupti.records import ActivityTables
from gpuwatch.probes.cupti.reports import MIN_REPORT_INTERVAL
from gpuwatch.probes.process.identity import identify
from tests.conftest import ROOT, group_agent, series

FIXTURE = ROOT / "tests" / "fixtures" / "cupti-h200.json"
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def h200_report(pid: int) -> dict:
    """A report as the in-process agent built it on the H200 from these records."""
    rec = json.loads(FIXTURE.read_text())
    tables = ActivityTables()
    tables.add_all(rec["records"])
    kernels, other = tables.kernel_rows(occupancy=lambda *a: (0.5, "registers"))
    for k in kernels:
        k["uuid"] = rec["uuid"]
    return {"version": 1, "pid": pid, "process": "python3", "started": time.time() - 5, "ts": time.time(),
            "cupti": {"state": "on", "reason": "", "mode": "continuous", "observed_seconds": 5.0,
                      "records": tables.records, "dropped": 0, "decode_seconds": 0.01},
            "kernels": kernels, "kernels_other": other,
            "copies": [dict(c, uuid=rec["uuid"]) for c in tables.copy_rows()],
            "memory": [dict(m) for m in rec["memory"]]}




def wait_for(fn, timeout=15.0):
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.2)


@pytest.fixture
def agent():
    """An agent whose control socket nobody reaches through its group, as a job's user would."""
    with group_agent("--no-nvml", "--no-ebpf", prefix="gw-cupti-") as a:
        yield a


def test_gpuwatch_run_program_reports_cupti_unavailable_to_the_daemon(agent):
    prog = "import sys, time; print('job output'); time.sleep(1.5); sys.exit(4)"
    p = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "run", "--socket", str(agent.socket),
                          "--interval", "0.2", "--", sys.executable, "-c", prog],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, out) == (4, "job output\n"), err
    assert f"reporting to the gpuwatch agent on {agent.socket}" in err
    # `gpuwatch run` execs the program: the pid the daemon saw is the one we started.
    states = wait_for(lambda: {k: v for k, v in series(agent.metrics(), "gpuwatch_cupti_state").items()
                               if v == 1.0 and f'pid="{p.pid}"' in k})
    assert len(states) == 1 and 'state="unavailable"' in next(iter(states))


@pytest.mark.skipif(not FIXTURE.exists(), reason="tests/fixtures/cupti-h200.json is recorded on the H200 "
                    "by tests/gpu/cupti_check.sh")
def test_h200_records_through_the_socket_become_metrics_and_trace_data(agent):
    me = os.getpid()
    reply = control.call(str(agent.socket), "cupti.report", h200_report(me))
    assert reply == {"detail_seconds": 0}
    def with_kernels() -> str:
        text = agent.metrics()
        return text if "gpuwatch_process_kernel_launches_total{" in text else ""
    text = wait_for(with_kernels)
    launches = series(text, "gpuwatch_process_kernel_launches_total")
    rec = json.loads(FIXTURE.read_text())
    kernel_records = [r for r in rec["records"] if r["kind"] in (3, 10)]
    assert sum(launches.values()) == len(kernel_records)
    assert all(f'pid="{me}"' in k for k in launches)
    # Names are demangled for people: no "_Z" mangled names in labels.
    assert not [k for k in launches if 'kernel="_Z' in k]
    # This agent runs without NVML: it cannot check the GPU the bytes are on, so they are not
    # exported (tests/e2e/test_report_attacks.py has them through NVML), and counted.
    assert series(text, "gpuwatch_process_gpu_memory_allocated_bytes") == {}
    assert series(text, "gpuwatch_process_gpu_memory_allocated_self_reported_bytes") == {}
    assert series(text, "gpuwatch_cupti_memory_refused_total")['{reason="unknown_gpu"}'] == 1.0
    # A trace asking for the process gets the report and asks the agent for continuous kernels.
    got = control.call(str(agent.socket), "cupti.process", {"pid": me})
    assert got["pid"] == me and len(got["kernels"]) == len(h200_report(me)["kernels"])
    assert control.call(str(agent.socket), "cupti.report", h200_report(me))["detail_seconds"] > 5


def test_reports_are_the_callers_own_and_bad_ones_are_refused(agent):
    # nobody's report is stored under nobody's pid, whatever pid the report claims.
    code = ("import json, sys; from gpuwatch.agent import control; "
            f"r = json.loads(sys.argv[1]); print(control.call({str(agent.socket)!r}, 'cupti.report', r)); "
            "import os; print(os.getpid())")
    fake = {"version": 1, "pid": 1, "process": "claims-to-be-init", "started": 0, "ts": 0,
            "cupti": {"state": "idle"}, "kernels": [], "memory": []}
    p = subprocess.run([*NOBODY, sys.executable, "-c", code, json.dumps(fake)], capture_output=True, text=True,
                       timeout=30, cwd="/")
    assert p.returncode == 0, p.stderr
    nobody_pid = int(p.stdout.split()[-1])
    # ... and named by its comm, whatever name the report claims.
    comm = os.path.basename(sys.executable)[:15]
    assert control.call(str(agent.socket), "cupti.process", {"pid": nobody_pid})["process"] == comm
    assert control.call(str(agent.socket), "cupti.process", {"pid": 1}) is None
    # nobody reads its own (exited) process's report, not root's.
    control.call(str(agent.socket), "cupti.report", dict(fake, process="root-job"))
    ask = ("import sys; from gpuwatch.agent.control import ControlError, call\n"
           f"for pid in ({nobody_pid}, {os.getpid()}):\n"
           f"    try: print(call({str(agent.socket)!r}, 'cupti.process', {{'pid': pid}})['process'])\n"
           "    except ControlError as e: print(e)")
    p = subprocess.run([*NOBODY, sys.executable, "-c", ask], capture_output=True, text=True, timeout=30, cwd="/")
    mine, roots = p.stdout.strip().splitlines()
    assert mine == comm
    assert roots.startswith(f"process {os.getpid()} belongs to user root")
    # A bad report: refused with the reason; the daemon goes on serving.
    with pytest.raises(control.ControlError, match=r"cupti.report refused: version: must be an integer from 1 to 1, got 7"):
        control.call(str(agent.socket), "cupti.report", dict(fake, version=7))
    with pytest.raises(control.ControlError, match=r"cupti.process refused: pid: must be an integer from 1 to 4194304, got 'me'"):
        control.call(str(agent.socket), "cupti.process", {"pid": "me"})
    assert control.call(str(agent.socket), "ping") == "pong"


@pytest.mark.skipif(not FIXTURE.exists(), reason="tests/fixtures/cupti-h200.json is recorded on the H200")
def test_trace_shows_gpu_kernel_times_counted_from_its_start(agent):
    from rich.console import Console

    from gpuwatch.agent.trace.render import render_summary
    from gpuwatch.agent.trace.session import GpuKernels
    from gpuwatch.agent.trace.summary import summarize

    me = os.getpid()
    first = h200_report(me)
    control.call(str(agent.socket), "cupti.report", first)
    gpu = GpuKernels(None, str(agent.socket))
    time.sleep(MIN_REPORT_INTERVAL)  # a report sooner than this after the last is dropped
    assert gpu.gpu(me)["kernels"] == []  # the trace counts from here
    # The agent's counts grow (cumulative): the same records again, as if the job ran them twice.
    later = h200_report(me)
    for k in later["kernels"]:
        k["launches"] *= 2
        k["gpu_seconds"] *= 2
    control.call(str(agent.socket), "cupti.report", later)
    got = gpu.gpu(me)
    assert sum(k["launches"] for k in got["kernels"]) == sum(k["launches"] for k in first["kernels"])
    by_name = {k["name"]: k for k in got["kernels"]}
    gemm = next(k for n, k in by_name.items() if n.startswith("nvjet"))
    assert gemm["gpu_seconds"] == pytest.approx(next(k["gpu_seconds"] for k in first["kernels"]
                                                     if k["name"] == gemm["name"]))
    add = next(k for k in got["kernels"] if "CUDAFunctorOnSelf_add" in k["name"])
    assert add["display_name"].startswith("void at::native::vectorized_elementwise_kernel<4, "
                                          "at::native::CUDAFunctorOnSelf_add<float>")
    # Both views render it; without a report they say how to get one.
    console = Console(width=200, record=True)
    console.print(render_summary(summarize({"gpu": got}, pid=me, process="python3", duration=1.0,
                                                        ended="duration")))
    text = console.export_text()
    assert "GPU kernel (CUPTI)" in text and "CUPTI on, kernel activity continuous" in text
    console.print(render_summary(summarize({}, pid=me, process="python3", duration=1.0,
                                                        ended="duration")))
    assert "gpuwatch run -- CMD" in console.export_text()


def test_status_lists_the_in_process_agents(agent):
    me = os.getpid()
    fake = {"version": 1, "pid": me, "process": "trainer", "started": 0, "ts": 0,
            "cupti": {"state": "unavailable", "reason": "no NVIDIA driver on this machine"}, "kernels": [],
            "memory": []}
    control.call(str(agent.socket), "cupti.report", fake)
    st = control.call(str(agent.socket), "status")
    (a,) = st["inprocess_agents"]
    assert (a["pid"], a["process"], a["state"]) == (me, identify(me).comm, "unavailable")
    human = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "status", "--socket", str(agent.socket)],
                           capture_output=True, text=True, timeout=30)
    assert "in-process agents" in human.stdout and "unavailable: no NVIDIA driver" in human.stdout


# Programs that run out of memory, each its own way, under `gpuwatch run`: the real exception
# classes (torch's CPU build has torch.cuda.OutOfMemoryError; JAX's CPU build its runtime error).
OOM_PROGRAMS = {
    "uncaught": "import torch, time; time.sleep(0.5)\n"
                "raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
                "total capacity of 139.72 GiB of which 1.12 GiB is free.')",
    # in a thread, wrapped by the program's own error: the thread dies of it, the program goes on
    "thread": "import threading, time, torch\n"
              "def step():\n"
              "    try:\n"
              "        raise torch.cuda.OutOfMemoryError('CUDA out of memory.')\n"
              "    except torch.cuda.OutOfMemoryError as e:\n"
              "        raise RuntimeError('training step failed') from e\n"
              "t = threading.Thread(target=step); t.start(); t.join(); time.sleep(1.0); print('main goes on')",
    # the program's own excepthook replaces ours: seen at exit all the same
    "own_hook": "import sys, time, torch; time.sleep(0.5)\n"
                "sys.excepthook = lambda *a: print('their hook', file=sys.stderr)\n"
                "raise torch.cuda.OutOfMemoryError('CUDA out of memory.')",
    # caught and recovered from: the program's business (PyTorch's allocator hook sees those on a GPU)
    "caught": "import time, torch\n"
              "try:\n"
              "    raise torch.cuda.OutOfMemoryError('CUDA out of memory.')\n"
              "except torch.cuda.OutOfMemoryError:\n"
              "    print('smaller batch')\n"
              "time.sleep(1.0)",
    "jax": "import jax, time; time.sleep(0.5)\n"
           "raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes.')",
}


def test_out_of_memory_errors_seen_in_process_become_oom_events(agent):
    import importlib.util

    programs = {k: v for k, v in OOM_PROGRAMS.items() if k != "jax" or importlib.util.find_spec("jax")}
    procs = {name: subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "run", "--socket", str(agent.socket),
                                     "--interval", "0.5", "--", sys.executable, "-c", prog],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, prog in programs.items()}
    results = {name: (p.pid, *p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    assert results["thread"][1] == "main goes on\n" and results["thread"][3] == 0
    assert "their hook" in results["own_hook"][2] and results["own_hook"][3] == 1
    assert results["caught"][1] == "smaller batch\n"
    want = {str(results[n][0]): n for n in programs if n != "caught"}

    def ooms():
        got = control.call(str(agent.socket), "findings", {})["ooms"]
        return got if {e["pid"] for e in got} >= set(want) else None

    got = {e["pid"]: e for e in wait_for(ooms, 20) or control.call(str(agent.socket), "findings", {})["ooms"]}
    assert set(got) == set(want), (got, results)  # the caught one is no event
    by = {want[pid]: e for pid, e in got.items()}
    for name, e in by.items():
        assert (e["event"], e["kind"], e["cause"], e["how"]) == ("finding.oom", "oom", "out_of_memory_error",
                                                                 "uncaught"), name
        assert e["process"] == identify(os.getpid()).comm and e["resource"] == ""  # no NVML: no GPU it vouches for
    assert by["uncaught"]["framework"] == "torch" and by["uncaught"]["device"] == 1
    assert by["uncaught"]["summary"] == (f"{by['uncaught']['process']} (pid {results['uncaught'][0]}) ran out of "
                                         "GPU memory: it died of an uncaught torch.OutOfMemoryError on CUDA device 1; "
                                         "no leak was forecast for it")
    if "jax" in by:
        assert by["jax"]["framework"] == "jax" and by["jax"]["requested_bytes"] == 4096
    counted = series(agent.metrics(), "gpuwatch_oom_events_total")
    assert counted == {'{gpu="",cause="out_of_memory_error"}': float(len(want))}
