"""`gpuwatch trace --pid` end to end: the CLI as a subprocess, real uprobes on the fake libcuda.so.1,
tests/ebpf/driver.c as the traced process (see conftest.py). Counts must be exactly driver.c's.

Each full trace costs ~2 s to compile and ~7-9 s to detach (the kernel waits for an RCU grace
period per uprobe), so there are three, one per way a trace ends (duration, process exit, Ctrl-C);
the validation errors come before any compiling and are fast.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.trace.pids import alive, pid_max, validate, wait_for_cuda
from gpuwatch.agent.trace.render import render_line, render_summary
from gpuwatch.agent.trace.summary import percentile, summarize
from gpuwatch.probes.process import identity
from gpuwatch.agent.trace.output import read_summary
from . import test_ebpf_cuda as _base
from .conftest import count_drops
from .test_ebpf_cuda import ERRORS_BY_CODE, EXPECTED, EXPECTED_WITH_LAUNCH_ERRORS, LIVE_ALLOCATIONS, LIVE_BYTES

KERNELS = getattr(_base, "KERNELS", None)  # per kernel handle, busiest first, where the probe has kernels

pytestmark = pytest.mark.root

KERNEL_LAUNCHES = 1009 + 4 * 101 + 53 + 11  # cuLaunchKernel, _ptsz, Ex, Cooperative (graphs are no kernel)
ALLOCATIONS = 307 + 3 + 2 + 4 + 2
FREES = 211 + 4 + 1


class Collected:
    """A command run as a subprocess, its stdout and stderr collected line by line as they come."""

    def __init__(self, cmd: list[str], **popen) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait(self, timeout: float = 60) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for t in self._threads:
            t.join(5)
        return rc

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Trace(Collected):
    """`python -m gpuwatch.agent.cli trace ARGS`."""

    def __init__(self, *args: str) -> None:
        self.attached = threading.Event()
        super().__init__([sys.executable, "-m", "gpuwatch.agent.cli", "trace", *args])

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)
            if line.startswith("tracing PID"):
                self.attached.set()

    def wait_attached(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.attached.wait(0.05):
            assert self.proc.poll() is None, self.stderr
            assert time.monotonic() < deadline, self.stderr


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "trace", *args], capture_output=True,
                          text=True, timeout=timeout)


def _assert_exact(summary: dict, pid: int) -> None:
    assert summary["pid"] == pid and summary["process"] == "driver"
    got = {api: (a["calls"], a["errors"], a["bytes"]) for api, a in summary["apis"].items()}
    assert got == EXPECTED
    assert {api: a["errors_by_code"] for api, a in summary["apis"].items() if a["errors_by_code"]} == ERRORS_BY_CODE
    assert summary["memory"] == {"live_bytes": LIVE_BYTES, "live_allocations": LIVE_ALLOCATIONS,
                                 "allocations": ALLOCATIONS, "frees": FREES}
    assert count_drops(summary) == {}
    for a in summary["apis"].values():
        assert set(a) >= {"calls", "errors", "bytes", "mean_latency_s"}
        if a["p50_latency_s"] is not None:  # the upper edge of a power-of-two bucket of ns
            assert a["p50_latency_s"] <= a["p99_latency_s"]
            assert round(a["p99_latency_s"] * 1e9) & (round(a["p99_latency_s"] * 1e9) - 1) == 0
    assert summary["apis"]["cuMemAlloc_v2"]["mean_latency_s"] > 0
    if KERNELS is not None:
        # D's whole name is read from the driver's memory while the process lives: one that
        # exited before the trace's next refresh keeps the part the naming hook saw
        truncated = dict(KERNELS[1], name=_base.NAME_D[:127] + "…", symbol=_base.NAME_D[:127] + "…",
                         name_source="hook")
        assert _base.unstacked(summary["kernels"]) in (KERNELS, [KERNELS[0], truncated, *KERNELS[2:]])
    if summary["kernels"]:
        assert sum(k["launches"] for k in summary["kernels"]) == KERNEL_LAUNCHES


def test_duration_summary_counts_exact(fake_cuda, drivers, tmp_path):
    d = drivers()
    out = tmp_path / "summary.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(out),
              "--duration", "3", "--interval", "0.5")
    t.wait_attached()
    assert "loading the eBPF probe…" in t.stderr
    d.go()
    assert t.wait() == 0, t.stderr
    summary = read_summary(str(out))
    assert summary["ended"] == "duration"
    assert 2.9 <= summary["duration_seconds"] < 4.5
    _assert_exact(summary, d.pid)
    # stdout is a pipe: one plain line per refresh, then the summary
    lines = [line for line in t.out if line.startswith("[")]
    assert len(lines) >= 4 and f"calls {sum(c for c, _, _ in EXPECTED.values())} " in lines[-1]
    assert f"ended after {summary['duration_seconds']:.1f} s (--duration)" in t.stdout and "cuMemAlloc_v2" in t.stdout and "power-of-two" in t.stdout
    assert "Traceback" not in t.stderr and f"summary written to {out}" in t.stderr
    assert d.finish() == 0  # the traced process was not disturbed


def test_process_exit_ends_trace_with_summary(fake_cuda, drivers, tmp_path):
    d = drivers()
    out = tmp_path / "summary.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(out),
              "--interval", "0.5", "--duration", "60")
    t.wait_attached()
    d.go()
    assert d.finish() == 0
    t0 = time.monotonic()
    assert t.wait() == 0, t.stderr
    summary = read_summary(str(out))
    assert summary["ended"] == "process exited"
    assert summary["duration_seconds"] < 30
    _assert_exact(summary, d.pid)
    assert f"ended: process {d.pid} exited, after " in t.stdout and "Traceback" not in t.stderr
    print(f"exit to end of trace (incl. detaching): {time.monotonic() - t0:.1f} s")


def test_ctrl_c_ends_trace_with_summary(fake_cuda, drivers, tmp_path):
    d = drivers()
    out = tmp_path / "summary.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(out), "--interval", "0.2")
    t.wait_attached()
    d.go()
    total = f"calls {sum(c for c, _, _ in EXPECTED.values())} "
    deadline = time.monotonic() + 10
    while not any(total in line for line in t.out):  # the live view has seen the whole workload
        assert time.monotonic() < deadline and t.proc.poll() is None, t.stdout + t.stderr
        time.sleep(0.05)
    t.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    t.proc.send_signal(signal.SIGINT)  # a second Ctrl-C costs neither the summary nor the detach
    assert t.wait() == 0, t.stderr
    summary = read_summary(str(out))
    assert summary["ended"] == "interrupted"
    _assert_exact(summary, d.pid)
    assert "ended: interrupted (Ctrl-C or SIGTERM) after " in t.stdout and "Traceback" not in t.stderr and "Aborted" not in t.stderr
    with open("/sys/kernel/tracing/uprobe_events") as f:
        assert fake_cuda["lib"] not in f.read()


def _free_pid() -> int:
    pid = pid_max() - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def _is_kthreadd() -> bool:
    try:
        with open("/proc/2/status") as f:
            return f.readline().split()[1:] == ["kthreadd"]
    except OSError:
        return False


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("pid, message", [
    ("0", "PID must be a positive integer"),
    ("-1", "PID must be a positive integer"),
    ("pid_max+1", "is above this system's largest PID"),
    ("free", "no such process"),
    ("2", "PID 2 is a kernel thread: it runs no CUDA"),
    ("sleep", "process {pid} (sleep) does not use CUDA: no libcuda.so is mapped"),
])
def test_invalid_pid_exits_1_with_message(pid, message, sleeper):
    if pid == "2" and not _is_kthreadd():
        pytest.skip("PID 2 is not kthreadd here")
    value = {"pid_max+1": str(pid_max() + 1), "free": str(_free_pid()),
             "sleep": str(sleeper.pid)}.get(pid, pid)
    r = _run("--pid", value)
    assert r.returncode == 1, r
    assert r.stderr.startswith("Error: ") and message.format(pid=value) in r.stderr
    assert "Traceback" not in r.stderr and "compiling" not in r.stderr


def test_library_not_mapped(fake_cuda, sleeper):
    r = _run("--pid", str(sleeper.pid), "--library", fake_cuda["lib"])
    assert r.returncode == 1
    assert f"process {sleeper.pid} (sleep) does not map {fake_cuda['lib']} (--library)" in r.stderr
    r = _run("--pid", str(sleeper.pid), "--library", "/nonexistent/libcuda.so.1")
    assert r.returncode == 1 and "--library /nonexistent/libcuda.so.1: no such file" in r.stderr


def test_usage_errors_exit_2():
    assert _run("--pid", "abc").returncode == 2
    assert _run().returncode == 2
    assert _run("--pid", "1", "--duration", "0").returncode == 2


def test_wait_gives_up_when_the_process_exits():
    p = subprocess.Popen(["sleep", "0.7"])
    try:
        r = _run("--pid", str(p.pid), "--wait")
    finally:
        p.wait()
    assert r.returncode == 1
    assert "waiting for process" in r.stderr
    assert f"process {p.pid} (sleep) exited before it loaded CUDA" in r.stderr and "Traceback" not in r.stderr


def test_wait_returns_once_libcuda_is_mapped(fake_cuda):
    code = f"import ctypes, time; time.sleep(0.5); ctypes.CDLL({fake_cuda['lib']!r}); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.1)
        target = validate(p.pid, None, wait=True)
        assert target.libraries == []
        with pytest.raises(TraceError, match="does not use CUDA"):
            validate(p.pid, None)
        t0 = time.monotonic()
        wait_for_cuda(target, None, poll=0.05)
        assert time.monotonic() - t0 < 10
        assert len(target.libraries) == 1 and target.libraries[0].endswith(fake_cuda["lib"])
        assert target.libraries[0].startswith(f"/proc/{p.pid}/root/")
        assert validate(p.pid, fake_cuda["lib"]).libraries == [fake_cuda["lib"]]
    finally:
        p.kill()
        p.wait()


def test_pid_reuse_or_exit_is_told_by_start_time(sleeper):
    st = identity.read_stat(sleeper.pid)
    assert alive(sleeper.pid, st.start_time)
    assert not alive(sleeper.pid, st.start_time + 1)  # same PID, another process
    sleeper.kill()
    sleeper.wait()
    assert not alive(sleeper.pid, st.start_time)


def test_not_root_checks_the_process_before_asking_the_agent(sleeper):
    # tracing through the agent, and what is said without one: test_trace_daemon.py
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    mine = subprocess.Popen(["sleep", "30"], preexec_fn=drop)
    try:
        for pid, text in ((mine.pid, f"process {mine.pid} (sleep) does not use CUDA"),
                          (sleeper.pid, f"process {sleeper.pid} belongs to user root: you can trace only your "
                                        f"own processes")):
            r = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "trace", "--pid", str(pid)],
                               capture_output=True, text=True, cwd="/", preexec_fn=drop, timeout=30)
            assert r.returncode == 1, r
            assert text in r.stderr
            assert "Traceback" not in r.stderr
    finally:
        mine.kill()
        mine.wait()


def test_percentiles_from_log2_histogram():
    # slot s holds [2**(s-1), 2**s) ns: the answer is the slot's upper edge
    hist = {10: 50, 11: 49, 20: 1}
    assert percentile(hist, 0.5) == 2 ** 10 * 1e-9
    assert percentile(hist, 0.99) == 2 ** 11 * 1e-9
    assert percentile(hist, 1.0) == 2 ** 20 * 1e-9
    assert percentile({}, 0.5) is None
    assert percentile({0: 3}, 0.99) == 0.0


def test_summary_from_snapshot_without_kernels():
    snap = {"pid": 7, "apis": {"cuMemAlloc_v2": {"calls": 3, "errors": 1, "bytes": 30, "seconds": 3e-6,
                                                 "mean_latency_s": 1e-6, "histogram": {10: 3}},
                               "cuLaunchKernel": {"calls": 5, "errors": 0, "bytes": 0, "seconds": 0.0,
                                                  "mean_latency_s": 0.0, "histogram": {}}},
            "memory": {"live_bytes": 20, "live_allocations": 2, "allocations": 2, "frees": 0},
            "dropped_events": 4}
    s = summarize(snap, pid=7, process="x", duration=1.23456, ended="interrupted")
    assert s["kernels"] == [] and s["dropped_events"] == 4 and s["duration_seconds"] == 1.235
    assert s["apis"]["cuLaunchKernel"]["mean_latency_s"] is None  # entry-only: no latency measured
    assert s["apis"]["cuMemAlloc_v2"] == {"calls": 3, "errors": 1, "errors_by_code": {}, "bytes": 30, "mean_latency_s": 1e-6,
                                          "p50_latency_s": 2 ** 10 * 1e-9, "p99_latency_s": 2 ** 10 * 1e-9}
    line = render_line(snap, None, 1.0, 1.0)
    assert "calls 8" in line and "errors 1" in line and "dropped 4" in line
    import io

    from rich.console import Console
    c = Console(width=200, record=True, file=io.StringIO())
    c.print(render_summary(s))
    text = c.export_text()
    assert "ended: interrupted (Ctrl-C or SIGTERM) after 1.2 s" in text and "cuMemAlloc_v2" in text and "≤1.02 µs" in text


def test_output_writes_a_perfetto_trace_with_every_call(fake_cuda, drivers, tmp_path):
    d = drivers()
    summary_path, trace_path = tmp_path / "summary.json", tmp_path / "trace.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(summary_path),
              "--output", str(trace_path), "--interval", "0.5")
    t.wait_attached()
    d.go()
    time.sleep(1.0)
    t.proc.send_signal(signal.SIGINT)
    assert t.wait() == 0, t.stderr
    summary = read_summary(str(summary_path))
    total = sum(c for c, _e, _b in EXPECTED.values())
    assert summary["events"] == {"recorded": total, "not_written": 0, "error": None}
    # Every call is in the ring buffer. (A map can drop under load, e.g. a user stack that cannot be
    # read: counted by kind, and no call missing from the trace.)
    assert summary["dropped_by_kind"].get("events", 0) == 0, summary["dropped_by_kind"]
    doc = json.loads(trace_path.read_text())
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    per_api: dict[str, int] = {}
    for e in calls:
        per_api[e["name"]] = per_api.get(e["name"], 0) + 1
    assert per_api == {api: c for api, (c, _e, _b) in EXPECTED.items()}
    assert {e["args"].get("kernel") for e in calls if e["name"] == "cuLaunchKernelEx"} == {"gemm_bf16"}
    assert not (tmp_path / "trace.json.events").exists()  # the raw records are gone
    assert f"trace written to {trace_path}: {total} calls" in t.stderr
    # the live view and summary show the stacks holding live bytes
    assert "live bytes by allocating call stack:" in t.stdout


def test_otlp_sends_every_call_as_a_span(fake_cuda, drivers, tmp_path):
    from tests.otlp_receiver import GrpcReceiver

    receiver = GrpcReceiver()
    config = tmp_path / "gpuwatch.toml"
    config.write_text(f'[otlp]\nendpoint = "{receiver.endpoint}"\nprotocol = "grpc"\n')
    try:
        d = drivers()
        t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--otlp", "--config", str(config),
                  "--interval", "0.5")
        t.wait_attached()
        d.go()
        time.sleep(1.0)
        t.proc.send_signal(signal.SIGINT)
        assert t.wait() == 0, t.stderr
        total = sum(c for c, _e, _b in EXPECTED.values())
        assert f"spans: {total + 1} exported (the calls and one for the trace)" in t.stderr
        roots = [s for s in receiver.spans if not s["parent"]]
        calls = [s for s in receiver.spans if s["parent"]]
        assert len(roots) == 1 and roots[0]["attributes"]["process.pid"] == d.pid
        per_api: dict[str, int] = {}
        for s in calls:
            per_api[s["name"]] = per_api.get(s["name"], 0) + 1
        assert per_api == {api: c for api, (c, _e, _b) in EXPECTED.items()}
        assert {s["trace_id"] for s in calls} == {roots[0]["trace_id"]}
        assert {s["attributes"].get("gpuwatch.kernel") for s in calls if s["name"] == "cuLaunchKernelEx"} == {"gemm_bf16"}
        errors: dict[str, int] = {}
        for s in calls:
            if s["status"] == 2:  # STATUS_CODE_ERROR, with the CUresult as error.type
                errors[s["attributes"]["error.type"]] = errors.get(s["attributes"]["error.type"], 0) + 1
        expected_errors = {api: e for api, (_c, e, _b) in EXPECTED.items() if e}
        expected_errors.update(EXPECTED_WITH_LAUNCH_ERRORS)  # with every call recorded, launches are timed too
        assert sum(errors.values()) == sum(expected_errors.values())
        assert errors.get("CUDA_ERROR_OUT_OF_MEMORY") == ERRORS_BY_CODE["cuMemAlloc_v2"]["CUDA_ERROR_OUT_OF_MEMORY"]
        assert all(roots[0]["start"] <= s["start"] <= s["end"] <= roots[0]["end"] for s in calls)
        assert abs(roots[0]["start"] / 1e9 - time.time()) < 120  # wall clock, not the monotonic one
    finally:
        receiver.stop()


def test_output_in_a_missing_directory_is_refused_by_name(drivers, tmp_path):
    d = drivers()
    r = _run("--pid", str(d.pid), "--output", str(tmp_path / "nope" / "trace.json"))
    assert r.returncode == 1
    assert f"--output {tmp_path / 'nope' / 'trace.json'}: the directory {tmp_path / 'nope'} does not exist" in r.stderr


# driver.c's "loop": each iteration cuMemAlloc_v2 (4096 B, freed), cuMemAlloc_v2 (8192 B, kept),
# cuLaunchKernel (A), cuMemFree_v2 (the 4096 B), cuStreamSynchronize: in this order, one thread.
LOOP = ("alloc_a", "alloc_b", "launch", "free", "sync")


def _loop_prefix(k: int) -> dict:
    """The counts of the first k calls of the loop."""
    n, r = divmod(k, len(LOOP))
    done = {c: n + (i < r) for i, c in enumerate(LOOP)}
    return {"cuMemAlloc_v2": done["alloc_a"] + done["alloc_b"], "cuLaunchKernel": done["launch"],
            "cuMemFree_v2": done["free"], "cuStreamSynchronize": done["sync"],
            "live_allocations": done["alloc_a"] - done["free"] + done["alloc_b"],
            "live_bytes": 4096 * (done["alloc_a"] - done["free"]) + 8192 * done["alloc_b"]}


def _row(text: str, first: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first]]
    assert len(rows) == 1, (first, text)
    return rows[0]


def test_summary_of_a_process_still_calling_is_one_instant(fake_cuda, drivers, tmp_path):
    # The trace ends while the process calls as fast as it can: every table (and the JSON) must
    # be the same prefix of its calls, not each map read a little later than the one before.
    d = drivers(None, "loop")
    out = tmp_path / "summary.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(out),
              "--duration", "2", "--interval", "0.5")
    try:
        t.wait_attached()
        d.go()
        assert t.wait() == 0, t.stderr
        assert d.proc.poll() is None  # still calling when the trace ended
    finally:
        d.proc.kill()
    s = read_summary(str(out))
    calls = {api: a["calls"] for api, a in s["apis"].items()}
    assert calls.pop("cuModuleGetFunction") == 1
    k = sum(calls.values())
    assert k > 1000, calls  # it did run meanwhile
    want = _loop_prefix(k)
    assert calls == {api: want[api] for api in calls} and set(calls) == set(LOOP_APIS), (k, calls)
    assert s["memory"] == {"live_bytes": want["live_bytes"], "live_allocations": want["live_allocations"],
                           "allocations": want["cuMemAlloc_v2"], "frees": want["cuMemFree_v2"]}
    assert sum(k["launches"] for k in s["kernels"]) == want["cuLaunchKernel"]
    assert sum(st["allocations"] for st in s["stacks"]) == want["live_allocations"]
    assert sum(st["bytes"] for st in s["stacks"]) == want["live_bytes"]
    assert count_drops(s) == {}
    # the printed tables are the same numbers
    text = t.stdout[t.stdout.index("ended"):]
    for api in LOOP_APIS:
        assert _row(text, api)[1] == str(want[api])
    kernel = next(line for line in text.splitlines() if line.startswith("add_kernel"))
    assert str(want["cuLaunchKernel"]) == kernel.split(")")[1].split()[0]
    assert (f"in {want['live_allocations']} allocations · {want['cuMemAlloc_v2']} allocations, "
            f"{want['cuMemFree_v2']} frees") in text


LOOP_APIS = ("cuLaunchKernel", "cuMemAlloc_v2", "cuMemFree_v2", "cuStreamSynchronize")


def test_otlp_with_no_receiver_fails_in_one_line_saying_where(fake_cuda, drivers, tmp_path):
    from tests.conftest import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = tmp_path / "gpuwatch.toml"
    config.write_text(f'[otlp]\nendpoint = "{endpoint}"\nprotocol = "grpc"\ntimeout = 1\n')
    d = drivers()
    out = tmp_path / "summary.json"
    t = Trace("--pid", str(d.pid), "--library", fake_cuda["lib"], "--otlp", "--config", str(config),
              "--summary-json", str(out), "--interval", "0.5", "--duration", "2")
    t.wait_attached()
    d.go()
    assert t.wait(90) == 1, t.output
    total = sum(c for c, _e, _b in EXPECTED.values())
    errors = [line for line in t.err if line.startswith("Error: ")]
    assert len(errors) == 1, t.stderr
    assert errors[0].startswith(f"Error: --otlp: none of the {total + 1} spans reached the OTLP receiver at "
                                f"{endpoint} (grpc, the config's [otlp] section): "), errors
    # why, in gRPC's words (a loaded machine may hit the 1 s deadline before the refusal)
    assert "StatusCode.UNAVAILABLE" in errors[0] or "StatusCode.DEADLINE_EXCEEDED" in errors[0], errors
    # nothing from the OpenTelemetry library itself, however many batches failed
    assert "opentelemetry" not in t.stderr and "Transient error" not in t.stderr, t.stderr
    assert "Traceback" not in t.stderr
    summary = read_summary(str(out))  # the summary is there all the same
    assert sum(a["calls"] for a in summary["apis"].values()) == total and summary["events"]["recorded"] == total
