"""`gpuwatch top` and `gpuwatch status` against a real agent (NVML replayed from the H200), `top` in a
real terminal (tmux) at 80x24 and 200x50, and standalone on the replay."""
import getpass
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from gpuwatch.agent import control, top, wire
from tests.conftest import FIXTURE, wait_for

CLI = [sys.executable, "-m", "gpuwatch.agent.cli"]
GIB = 1 << 30


def gpuwatch(*args, timeout=30):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _recording(tmp_path, charged: dict[int, int], hot: bool = True):
    """The H200 recording with `charged` (pid -> bytes) listed on its GPU beside its own process at
    every tick, and (hot) 85 °C with an uncorrectable ECC error more each tick: two findings open."""
    rec = json.loads(FIXTURE.read_text())
    gpu = rec["gpus"][0]
    gpu["compute_processes"] = [{"value": (a or {"value": []})["value"] + [{"pid": p, "used_memory": b}
                                                                          for p, b in charged.items()]}
                                for a in gpu["compute_processes"]]
    if hot:
        gpu["temperature"] = [{"value": 85} for _ in gpu["temperature"]]
        gpu["ecc_errors uncorrected volatile"] = [{"value": i} for i in range(len(gpu["temperature"]))]
    path = tmp_path / "nvml-top.json"
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def children():
    """Two real processes NVML will list: one idle, one keeping a core busy."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield idle.pid, busy.pid
    for p in (idle, busy):
        p.kill()
        p.wait()


def _top_json(agent):
    out = gpuwatch("top", "--socket", str(agent.socket), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _ready(agent, pids, findings=2):
    """The agent's view once NVML lists `pids`, the host probe has their CPU and `findings` are open."""
    agent.metrics()  # serving
    def view():
        v = control.call(str(agent.socket), "top", {})
        by_pid = {p["pid"]: p for p in v["processes"]}
        ok = all(p in by_pid and by_pid[p]["cpu"] is not None for p in pids) and len(v["findings"]) >= findings
        return v if ok else None

    v = wait_for(view, 40, 0.3)
    assert v, f"the agent never showed {pids} with their CPU and {findings} findings: {_top_json(agent)}"
    return v


# -- status ---------------------------------------------------------------------------------------

def test_status_shows_the_processes_on_the_gpus_and_recent_events(agent_factory, tmp_path, children):
    idle, busy = children
    agent = agent_factory("--nvml-replay", str(_recording(tmp_path, {idle: GIB, busy: 3 * GIB})), "--no-ebpf",
                          "--host-interval", "1")
    _ready(agent, children)
    st = json.loads(gpuwatch("status", "--socket", str(agent.socket), "--json").stdout)
    by_pid = {p["pid"]: p for p in st["processes"]}
    assert set(by_pid) == {425, idle, busy}  # the recording's own process, and ours
    assert by_pid[busy]["black"] == 3 * GIB and by_pid[idle]["black"] == GIB
    assert by_pid[busy]["user"] == getpass.getuser() and by_pid[busy]["rss_bytes"] > 1 << 20
    assert by_pid[busy]["cpu"] > 0.3 > by_pid[idle]["cpu"]
    assert any(e["kind"] == "finding.opened" for e in st["recent_events"])
    text = gpuwatch("status", "--socket", str(agent.socket)).stdout
    assert "No processes on the GPUs." not in text
    rows = {int(line.split()[1]): line.split() for line in text.splitlines() if re.match(r"\s+0\s+\d+\s", line)}
    assert set(rows) == {425, idle, busy}, text
    assert rows[busy][2] == getpass.getuser() and "3.0 GiB" in " ".join(rows[busy])
    assert "recent events:" in text
    assert re.search(r"finding\.opened  GPU-\S+  .*summary=GPU GPU-\S+ is at 85 °C", text), text


def test_status_keeps_bracketed_text(agent_factory, tmp_path):
    """Rich markup must not eat what the agent says: a reason or path with [brackets] is shown as it is."""
    odd = tmp_path / "[baseline]"
    odd.mkdir()
    (odd / "blocker").write_text("")
    (odd / "nvml.json").write_text("{}")
    agent = agent_factory("--nvml-replay", str(odd / "nvml.json"), "--state-dir", str(odd / "blocker" / "state"),
                          "--no-ebpf")

    def failing():
        st = json.loads(gpuwatch("status", "--socket", str(agent.socket), "--json").stdout or "{}")
        return st if st.get("probes", {}).get("nvml", {}).get("state") == "unavailable" else None

    st = wait_for(failing, 20, 0.2)
    assert st and "[baseline]" in st["probes"]["nvml"]["reason"], st
    text = gpuwatch("status", "--socket", str(agent.socket)).stdout
    (nvml,) = [line for line in text.splitlines() if line.startswith("nvml ")]
    assert f"{odd}/nvml.json" in nvml, text
    assert f"store unavailable, nothing is kept across restarts: cannot create the state directory {odd}/blocker" in text


# -- top: scripts -----------------------------------------------------------------------------------

def test_top_once_json_filter_and_sort(agent_factory, tmp_path, children):
    idle, busy = children
    agent = agent_factory("--nvml-replay", str(_recording(tmp_path, {idle: 3 * GIB, busy: GIB})), "--no-ebpf",
                          "--host-interval", "1")
    _ready(agent, children)
    v = _top_json(agent)
    wire.TopResult.parse(v)  # what the CLI printed is the typed result
    assert v["pid"] == agent.proc.pid
    (g,) = v["gpus"]
    assert (g["index"], g["name"], g["temperature_celsius"]) == (0, "NVIDIA H200", 85.0)
    assert g["sm_clock_hz"] > 1e9 and g["sm_clock_max_hz"] == 1.98e9 and g["power_limit_watts"] == 700.0
    assert {f["kind"] for f in v["findings"]} >= {"thermal_margin", "ecc_uncorrected"}
    assert v["findings"][0]["severity"] == "critical"  # worst first
    with pytest.raises(control.ControlError, match="top refused: sort: is not a field"):
        control.call(str(agent.socket), "top", {"sort": "pid"})  # params are checked at the socket

    def pids_of(*args):
        out = gpuwatch("top", "--socket", str(agent.socket), "--once", *args)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("gpuwatch top ") and f"agent pid {agent.proc.pid}" in lines[0]
        assert lines[2].startswith("  0 H200 ") and " 85C " in lines[2]
        return [int(line.split()[0]) for line in lines if re.match(r"\s+\d+ \S+\s+0 ", line)], out.stdout

    assert pids_of()[0] == [idle, 425, busy]  # by GPU memory: 3 GiB, 2.7 GiB, 1 GiB
    assert pids_of("--sort", "pid")[0] == sorted([idle, busy, 425])
    assert pids_of("--sort", "cpu")[0][0] == busy
    assert pids_of("-p", str(busy))[0] == [busy]
    found, text = pids_of("--filter", "no-such-command")
    assert found == [] and "no processes on the GPUs match the filter" in text
    assert "OPEN FINDINGS (2)" in text and "CRIT ecc_uncorrected GPU" in text


def test_top_piped_prints_a_frame_each_interval_until_interrupted():
    import signal

    proc = subprocess.Popen([*CLI, "top", "--nvml-replay", str(FIXTURE), "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        frames, lines = 0, []
        for line in proc.stdout:
            lines.append(line)
            frames += line.startswith("gpuwatch top ")
            if frames == 3:
                break
        assert frames == 3, "".join(lines) + proc.stderr.read()
        assert sum(1 for x in lines if x.startswith("  0 H200 ")) == 2  # the third frame is still coming
        assert all("\x1b" not in x for x in lines)  # plain: no colors or cursor moves
        proc.send_signal(signal.SIGINT)
        assert proc.wait(5) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_top_standalone_on_the_replay():
    out = gpuwatch("top", "--nvml-replay", str(FIXTURE), "--once")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("gpuwatch top ") and f"NVML replay {FIXTURE}" in lines[0]
    assert re.match(r"  0 H200 .* \d+% .* 2\.7G/140G .*\d+C .*/700W .*\d+/1980 ", lines[2]), lines[2]
    assert any(re.match(r"\s+425 —\s+0\s+61%\s+—\s+—\s+2\.7G ", line) for line in lines), out.stdout
    view = json.loads(gpuwatch("top", "--nvml-replay", str(FIXTURE), "--json").stdout)
    assert [(p["pid"], p["name"], p["black"]) for p in view["processes"]] == [(425, "python3", 2929721344)]
    assert view["gpus"][0]["uuid"] == "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110" and view["findings"] == []
    out = gpuwatch("top", "--socket", "/nonexistent/control.sock", "--once")
    assert out.returncode == 1 and "gpuwatch top --standalone" in out.stderr and "Traceback" not in out.stderr


# -- top: a real terminal ---------------------------------------------------------------------------

class Tmux:
    """A tmux server of our own (its own socket) running one command in a WxH window."""

    def __init__(self, tmp_path, width: int, height: int, command: str) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux not found: `apt-get install tmux` (scripts/setup --test and .ci/run install it)")
        self.base = ["tmux", "-L", f"gw-top-{os.getpid()}-{width}", "-f", "/dev/null"]
        env = dict(os.environ, TERM="xterm-256color")
        subprocess.run([*self.base, "new-session", "-d", "-x", str(width), "-y", str(height), "-s", "t",
                        f"{command}; echo EXITED $?; sleep 60"], check=True, env=env)

    def lines(self, join: bool = False) -> list[str]:
        out = subprocess.run([*self.base, "capture-pane", "-p", *(["-J"] if join else []), "-t", "t"],
                             capture_output=True, text=True, check=True).stdout
        rows = [line.rstrip() for line in out.split("\n")]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "t", *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


def _screen(term: Tmux, cond) -> list[str]:
    rows = wait_for(lambda: (lambda r: r if cond(r) else None)(term.lines()), 20, 0.1)
    assert rows, "\n".join(term.lines())
    return rows


@pytest.mark.parametrize("width,height", [(80, 24), (200, 50)])
def test_top_in_a_terminal(agent_factory, tmp_path, children, width, height):
    idle, busy = children
    agent = agent_factory("--nvml-replay", str(_recording(tmp_path, {idle: 3 * GIB, busy: GIB})), "--no-ebpf",
                          "--host-interval", "1")
    _ready(agent, children)
    cmd = " ".join([*CLI, "top", "--socket", str(agent.socket)])
    # a second top after the first ends: Ctrl-C must end that one as q did
    term = Tmux(tmp_path, width, height, f"cd {os.getcwd()} && {cmd}; echo QUIT $?; {cmd}")
    try:
        rows = _screen(term, lambda r: len(r) > 4 and "OPEN FINDINGS" in "\n".join(r))
        print("\n".join(rows))
        (tmp_path / f"capture-{width}x{height}.txt").write_text("\n".join(rows) + "\n")
        assert _unwrapped(term), "a line wrapped:\n" + "\n".join(term.lines())
        assert all(len(r) <= width for r in rows)
        assert rows[0].startswith("gpuwatch top ") and f"agent pid {agent.proc.pid}" in rows[0]
        assert rows[0].endswith("  q quit · h help") and "sort memory" in rows[0]
        assert rows[1].startswith("GPU NAME") and rows[2].startswith("  0 H200 ") and " 85C " in rows[2]
        assert "sw_power_cap" in rows[2]
        procs = [int(r.split()[0]) for r in rows if re.match(r"\s+\d+ \S+\s+0 ", r)]
        assert procs == [idle, 425, busy]  # by GPU memory: 3 GiB, 2.7 GiB, 1 GiB
        user = getpass.getuser()[:7 if width < 120 else 10]
        assert re.match(rf"\s+{busy} {re.escape(user)}\s+0\s+(—\s+)?—\s+—\s+1\.0G\s+\d+%", rows[rows.index(
            next(r for r in rows if r.split()[:1] == [str(busy)]))]), rows
        # the findings at the bottom of the screen, worst first
        at = next(i for i, r in enumerate(rows) if r.startswith("OPEN FINDINGS (2)"))
        assert rows[at + 1].startswith("CRIT ecc_uncorrected GPU") and rows[at + 2].startswith("WARN thermal_margin")
        assert at + 3 == len(rows) == height  # the last rows of the screen
        if width >= 120:
            assert "TOP KERNEL" in rows[4] and "█" in rows[2]
        # h shows the keys in place of the processes; ? (or h, or Esc) closes them
        term.keys("h")
        rows = _screen(term, lambda r: any(x.startswith("  m c p n ") for x in r))
        assert not any(x.startswith("GPU NAME") for x in rows) and all(len(r) <= width for r in rows)
        term.keys("?")
        _screen(term, lambda r: len(r) > 1 and r[1].startswith("GPU NAME"))
        # keys: sort by pid, then by CPU
        term.keys("p")
        rows = _screen(term, lambda r: "sort pid" in r[0])
        assert [int(r.split()[0]) for r in rows if re.match(r"\s+\d+ \S+\s+0 ", r)] == sorted([idle, busy, 425])
        term.keys("c")
        rows = _screen(term, lambda r: "sort cpu" in r[0])
        assert [int(r.split()[0]) for r in rows if re.match(r"\s+\d+ \S+\s+0 ", r)][0] == busy
        # / filters as it is typed: the recording's own process, by its name
        # (the children are named by their comm, "python" here, since NVML's replay has no name for them)
        term.keys("/", "python3")
        rows = _screen(term, lambda r: "filter 'python3'" in r[0])
        shown = [r for r in rows if re.match(r"\s+\d+ \S+\s+0 ", r)]
        assert 425 in [int(r.split()[0]) for r in shown] and all("python3" in r for r in shown), rows
        term.keys("Enter", "q")  # Enter ends the typing: q quits again
        # q quits within a second
        t0 = time.monotonic()
        done = wait_for(lambda: any(r == "QUIT 0" for r in term.lines()), 1.0, 0.05)
        assert done, f"still running {time.monotonic() - t0:.1f} s after q:\n" + "\n".join(term.lines())
        _screen(term, lambda r: bool(r) and r[0].startswith("gpuwatch top "))
        term.keys("C-c")
        assert wait_for(lambda: any(r == "EXITED 0" for r in term.lines()), 2.0, 0.05), "\n".join(term.lines())
    finally:
        term.close()


def _unwrapped(term: Tmux) -> bool:
    """No line of the pane is the continuation of a wrapped one: joining wrapped lines changes nothing."""
    return term.lines() == term.lines(join=True)


def test_top_shows_the_three_colors_and_the_leak_forecast(agent_factory, tmp_path):
    """A job whose tensors leak 20 MiB/s, as its in-process agent reports them (tests/e2e/test_findings_cli.py's
    LEAKER): once the leak finding opens, top shows its white and grey bytes, the leaking color and the time
    to OOM, and status its Leak column."""
    from tests.e2e.test_findings_cli import LEAKER
    from tests.conftest import nvml_recording

    uuid = json.loads(FIXTURE.read_text())["gpus"][0]["uuid"][0]["value"]
    sock = tmp_path / "a0" / "run" / "control.sock"
    job = subprocess.Popen([sys.executable, "-c", LEAKER, str(sock), uuid], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        pid = int(job.stdout.readline())
        agent = agent_factory("--nvml-replay", str(nvml_recording(tmp_path, [pid])), "--no-ebpf")
        agent.metrics()
        job.stdin.write("go\n")
        job.stdin.flush()

        def leaking():
            procs = control.call(str(agent.socket), "top", {})["processes"]
            return next((p for p in procs if p["pid"] == pid and p["leak"]), None)

        p = wait_for(leaking, 90, 0.5)  # a 60 s window is the shortest the detector judges
        assert p, control.call(str(agent.socket), "top", {})
        assert p["leak"]["color"] == "white" and p["leak"]["time_to_oom_seconds"] > 0
        assert p["white"] == p["grey"] >= GIB and p["black"] == GIB  # the job reports reserved = allocated
        out = gpuwatch("top", "--socket", str(agent.socket), "--once", "-p", str(pid))
        (row,) = [line for line in out.stdout.splitlines() if line.split()[:1] == [str(pid)]]
        tto = p["leak"]["time_to_oom_seconds"]
        assert re.match(rf" +{pid} \S+ +0 +— +\d\.\dG +\d\.\dG +1\.0G +\d+[smhd]", row), row
        shown = re.search(r"G +(\S+) +\d+% ", row).group(1)
        assert shown in {top._duration(tto + d) for d in (-60, 0, 60)}, (row, tto)  # as the agent said, a minute on
        text = gpuwatch("status", "--socket", str(agent.socket)).stdout
        (line,) = [x for x in text.splitlines() if re.match(rf"\s+0\s+{pid}\s", x)]
        assert re.search(r"white \+\d+ MiB/min, OOM in \d+\.\d min$", line), line
    finally:
        job.kill()
        job.wait()
