"""Attacks an ordinary user can play with `cupti.report`, against a real agent (NVML replayed).

A member of control.group may report about their own process. The report is the client's word:
the agent must take time, name and GPUs from what it knows (receipt, /proc, NVML) and bound what
such a user can make it hold. Each test plays an attack that worked against the agent before
(probes/cupti/reports.py) with real processes of ordinary users.
"""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpuwatch.agent import control
from gpuwatch.probes.cupti import reports as R
from tests.conftest import FIXTURE, Agent, nvml_recording as recording, series

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
GIB, MIB = 1 << 30, 1 << 20
UUID = next(iter(json.loads(FIXTURE.read_text())["gpus"][0]["uuid"]))["value"]
COMM = os.path.basename(sys.executable)[:15]  # what the kernel names a process exec'd from it


def report(memory=(), **over) -> dict:
    base = {"version": 1, "pid": 1, "process": "python3", "started": 0, "ts": 0,
            "cupti": {"state": "on", "mode": "continuous"}, "kernels": [], "memory": list(memory)}
    base.update(over)
    return base


# An ordinary user's process: waits for a line on stdin, then sends argv[2] (a report, JSON) every
# argv[3] seconds for argv[4] seconds; white and grey grow by argv[5] bytes a second from the
# report's values. Prints its pid first, so NVML's recording can list it.
REPORTER = r"""
import json, os, sys, time
from gpuwatch.agent import control
sock, rep, every, seconds, rate = sys.argv[1], json.loads(sys.argv[2]), *map(float, sys.argv[3:6])
print(os.getpid(), flush=True)
sys.stdin.readline()
t0 = time.time()
while True:
    for m in rep["memory"]:
        m.setdefault("base", m["allocated"])
        m["allocated"] = m["reserved"] = int(m["base"] + rate * (time.time() - t0))
    sent = dict(rep, memory=[{k: v for k, v in m.items() if k != "base"} for m in rep["memory"]])
    try:
        control.call(sock, "cupti.report", sent)
    except control.ControlError as e:
        print(e, flush=True)
    if time.time() - t0 > seconds:
        break
    time.sleep(every)
sys.stdin.readline()
"""


class Reporter:
    def __init__(self, sock: Path, rep: dict, every: float = 0.5, seconds: float = 0.0, rate: float = 0.0,
                 env: dict | None = None):
        self.proc = subprocess.Popen([*NOBODY, sys.executable, "-c", REPORTER, str(sock), json.dumps(rep),
                                      str(every), str(seconds), str(rate)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/",
                                     env=None if env is None else dict(os.environ, **env))
        self.pid = int(self.proc.stdout.readline())

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def top():
    d = Path(tempfile.mkdtemp(prefix="gw-attack-"))
    d.chmod(0o755)  # pytest's own tmp_path is private to root
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_agent(top: Path, nvml: Path) -> Agent:
    a = Agent(top / "agent", "--nvml-replay", str(nvml), "--no-ebpf", "--socket-group", "65534")
    # Reports are checked against NVML's view: wait for it (a loaded machine may serve first without).
    assert wait_for(lambda: "gpuwatch_gpu_up{" in a.metrics(), 20, 0.1)
    return a




def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for(fn, timeout: float, step: float = 0.5):
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(step)


def test_a_forged_timestamp_neither_blinds_the_leak_detector_nor_moves_the_runners_clock(top):
    # Both on the GPU as NVML says: the forger's bytes are verified, its clock is not.
    honest = Reporter(top / "agent" / "run" / "control.sock",
                      report([{"device": 0, "uuid": UUID, "allocated": GIB, "reserved": GIB}]),
                      every=0.5, seconds=120, rate=20 * MIB)
    forger = Reporter(top / "agent" / "run" / "control.sock",
                      report([{"device": 0, "uuid": UUID, "allocated": 5 * GIB, "reserved": 5 * GIB, "ts": 4e9}],
                             ts=4e9, started=4e9), every=1.0, seconds=120)
    agent = start_agent(top, recording(top, [honest.pid, forger.pid]))
    try:
        forger.go()
        time.sleep(1.5)  # the forged report is in before the honest one starts
        honest.go()

        def leak():
            found = control.call(str(agent.socket), "findings", {"kind": "memory_leak"})["open"]
            return [f for f in found if f["pid"] == str(honest.pid)]

        (found,) = wait_for(leak, 75)  # a 60 s window is the shortest the detector judges
        assert found["color"] == "white" and 15 * MIB < found["rate_bytes_per_second"] < 25 * MIB
        assert abs(found["ts"] - time.time()) < 30  # judged at the agent's time, not at 4e9
        text = agent.metrics()
        forged = series(text, "gpuwatch_process_gpu_memory_allocated_bytes")
        assert forged[f'{{gpu="{UUID}",pid="{forger.pid}",process="{COMM}"}}'] == 5 * GIB  # shown, at receipt time
        assert series(text, "gpuwatch_history_points_future_total")['{probe="cupti"}'] == 0
    finally:
        honest.stop()
        forger.stop()
        agent.stop()


def test_fake_gpus_chosen_names_and_huge_counts_change_nothing_for_others(top):
    sock = top / "agent" / "run" / "control.sock"
    honest = Reporter(sock, report([{"device": 0, "uuid": UUID, "allocated": GIB, "reserved": 2 * GIB}]),
                      every=0.5, seconds=60)
    fakes = [{"device": i, "uuid": f"GPU-{i:08d}-fake", "allocated": 100 * GIB, "reserved": 100 * GIB}
             for i in range(63)]
    kernel = {"name": "k", "launches": 2**63 - 1, "gpu_seconds": 1e9}
    liar = Reporter(sock, report([{"device": 0, "uuid": UUID, "allocated": 130 * GIB, "reserved": 130 * GIB}, *fakes],
                                 process="nvidia-smi", kernels=[kernel, dict(kernel, name="k2")]), every=0.5,
                    seconds=60)
    agent = start_agent(top, recording(top, [honest.pid]))  # NVML lists the honest process only
    try:
        honest.go()
        liar.go()
        # Two kernels of 10**308 launches overflowed float() in collect every second; the wire type
        # refuses them now, and int64 counts at their bound sum without harm.
        huge = report(kernels=[dict(kernel, launches=10**308), dict(kernel, name="k2", launches=10**308)])
        p = subprocess.run([*NOBODY, sys.executable, "-c", "import json, sys; from gpuwatch.agent import control\n"
                            f"try: control.call({str(sock)!r}, 'cupti.report', json.loads(sys.argv[1]))\n"
                            "except control.ControlError as e: print(e)", json.dumps(huge)],
                           capture_output=True, text=True, cwd="/", timeout=30)
        assert "kernels[0].launches: must be an integer from 0 to 9223372036854775807" in p.stdout, p.stderr

        def settled():
            text = agent.metrics()
            return text if f'pid="{liar.pid}"' in text and f'pid="{honest.pid}"' in text else ""

        text = wait_for(settled, 20)
        time.sleep(3)  # a few collections with the liar's report in
        text = agent.metrics()
        assert series(text, "gpuwatch_probe_up")['{probe="cupti"}'] == 1.0
        white = series(text, "gpuwatch_process_gpu_memory_allocated_bytes")
        assert white == {f'{{gpu="{UUID}",pid="{honest.pid}",process="{COMM}"}}': GIB}  # the liar: nowhere
        assert not [k for k in series(text, "gpuwatch_process_gpu_memory_allocated_self_reported_bytes")
                    if str(liar.pid) in k]
        assert "fake" not in text and "nvidia-smi" not in text  # no fake GPU, no borrowed name
        assert series(text, "gpuwatch_cupti_state")[f'{{pid="{liar.pid}",process="{COMM}",state="on"}}'] == 1.0
        refused = series(text, "gpuwatch_cupti_memory_refused_total")
        reports = refused['{reason="unknown_gpu"}'] / 63
        assert reports >= 1 and refused['{reason="not_on_gpu"}'] == reports
        assert control.call(str(agent.socket), "findings", {})["open"] == []
        # Once per cause in the log, however many reports.
        log = agent.output()
        assert log.count("a GPU NVML does not know") == 1 and log.count("does not list it on") == 1
    finally:
        honest.stop()
        liar.stop()
        agent.stop()


# Forks `n` processes, n / users in a row of each user 60000 + k (group 65534, the socket's), each
# sending one report (100 distinct kernels, 64 GPUs of which one is real, a borrowed name), one after
# the other; all stay alive until told, then exit. Prints how many were kept and refused.
FLOOD = r"""
import json, os, sys
from gpuwatch.agent import control
sock, uuid, n, users = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r, w = os.pipe()
children, answers = [], []
for i in range(n):
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(60000 + i * users // n)
        rep = {"version": 1, "cupti": {"state": "on"}, "process": "nvidia-smi",
               "kernels": [{"name": f"kernel_{i}_{k}", "launches": k + 1, "gpu_seconds": 0.001 * (k + 1)}
                           for k in range(100)],
               "memory": [{"device": g, "uuid": uuid if g == 0 else f"GPU-fake-{g}", "allocated": (g + 1) << 30,
                           "reserved": (g + 1) << 30} for g in range(64)]}
        try:
            control.call(sock, "cupti.report", rep, timeout=30)
            answer = b"k"
        except control.ControlError as e:
            answer = b"r" if "report refused" in str(e) else b"e"
        os.write(out_w, answer)
        os.read(r, 1)  # stay alive until the parent closes the pipe
        os._exit(0)
    os.close(out_w)
    children.append(pid)
    answers.append(os.read(out_r, 1))
    os.close(out_r)
print(answers.count(b"k"), answers.count(b"r"), answers.count(b"e"), flush=True)
sys.stdin.readline()
os.close(w)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_a_flood_of_processes_is_bounded(top):
    # The recording's own process (pid 425) is no process here: NVML cannot vouch for anyone, so
    # the real GPU's bytes are self-reported.
    agent = start_agent(top, FIXTURE)
    try:
        idle = agent.metrics()
        rss0 = rss_bytes(agent.proc.pid)
        log0 = len(agent.output().splitlines())
        t0 = time.monotonic()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(agent.socket), UUID, "600", "20"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        kept, refused, failed = map(int, flood.stdout.readline().split())
        took = time.monotonic() - t0
        # 20 users x 16 processes is more than the 256 kept in all.
        assert (kept, refused, failed) == (R.MAX_REPORTERS, 600 - R.MAX_REPORTERS, 0), took
        time.sleep(3)  # collections, a judgement
        text = agent.metrics()
        rss = rss_bytes(agent.proc.pid)
        lines = [x for x in text.splitlines() if x and not x.startswith("#")]
        st = control.call(str(agent.socket), "status")
        numbers = {"seconds": round(took, 1), "metrics_bytes": len(text), "series": len(lines),
                   "idle_series": len([x for x in idle.splitlines() if x and not x.startswith("#")]),
                   "rss_mib": rss >> 20, "rss0_mib": rss0 >> 20,
                   "history_series": series(text, "gpuwatch_history_series").get("{}")
                   or float(next(x for x in lines if x.startswith("gpuwatch_history_series ")).split()[1]),
                   "log_lines": len(agent.output().splitlines()) - log0}
        print("flood:", numbers)
        assert len(st["inprocess_agents"]) == R.MAX_REPORTERS
        assert len(text) <= 2_000_000 and rss <= 100 * MIB, numbers
        pids = {x.split('pid="')[1].split('"')[0] for x in lines if 'pid="' in x}
        assert len(pids) <= R.MAX_PROCESSES + 2, numbers  # 32 own, "other", NVML's recorded process
        assert "nvidia-smi" not in text and "fake" not in text
        assert series(text, "gpuwatch_process_gpu_memory_allocated_bytes") == {}  # none verified: none judged
        refusals = series(text, "gpuwatch_cupti_reports_refused_total")
        # 30 processes of each user in turn: 16 kept of each of 16 users, the other 14 of 15 of them
        # refused for the user's limit, then the total's.
        assert refusals['{reason="user_limit"}'] == 15 * 14 and refusals['{reason="total_limit"}'] == 14 + 4 * 30
        assert series(text, "gpuwatch_cupti_memory_refused_total")['{reason="unknown_gpu"}'] == 63 * R.MAX_REPORTERS
        assert numbers["log_lines"] <= 10, agent.output()  # once per cause
        assert control.call(str(agent.socket), "findings", {})["open"] == []
        # They exit: their reports go within STALE seconds, and their series with them.
        flood.stdin.write("\n")
        flood.stdin.flush()
        flood.wait(30)
        after = wait_for(lambda: "gpuwatch_cupti_state{" not in agent.metrics(), R.STALE + 10)
        assert after, "reports of exited processes still exported"
        assert control.call(str(agent.socket), "status")["inprocess_agents"] == []
        events = sqlite3.connect(agent.state / "gpuwatch.db").execute("select count(*) from events").fetchone()[0]
        assert events < 50
    finally:
        agent.stop()


def test_a_device_without_a_uuid_is_named_from_the_processs_own_cuda_visible_devices(top):
    """An entry that came with its CUDA ordinal only is named from the CUDA_VISIBLE_DEVICES the
    process was started with (/proc/PID/environ, the process's own text): a UUID prefix names the
    replayed GPU, "-1" (no GPU visible to it) names none, and a hostile value is read to its bound
    and resolved as CUDA would (the entries before the first invalid one)."""
    sock = top / "agent" / "run" / "control.sock"
    entry = [{"device": 0, "uuid": "", "allocated": GIB, "reserved": 2 * GIB}]
    by_prefix = Reporter(sock, report(entry), env={"CUDA_VISIBLE_DEVICES": UUID[:8]})
    hidden = Reporter(sock, report(entry), env={"CUDA_VISIBLE_DEVICES": "-1"})
    hostile = Reporter(sock, report(entry), env={"CUDA_VISIBLE_DEVICES": "0," + "9" * 100_000 + ",\u00e9"})
    reporters = (by_prefix, hidden, hostile)
    agent = start_agent(top, recording(top, [r.pid for r in reporters]))
    try:
        for r in reporters:
            r.go()

        def settled():
            text = agent.metrics()
            return text if all(f'pid="{r.pid}"' in text for r in reporters) else ""

        assert wait_for(settled, 20)
        time.sleep(2)  # a few reports each
        text = agent.metrics()
        white = series(text, "gpuwatch_process_gpu_memory_allocated_bytes")
        assert white == {f'{{gpu="{UUID}",pid="{r.pid}",process="{COMM}"}}': GIB for r in (by_prefix, hostile)}
        assert not [k for k in series(text, "gpuwatch_process_gpu_memory_allocated_self_reported_bytes")
                    if str(hidden.pid) in k]
        assert series(text, "gpuwatch_cupti_memory_refused_total")['{reason="unknown_gpu"}'] >= 1
    finally:
        for r in reporters:
            r.stop()
        agent.stop()
