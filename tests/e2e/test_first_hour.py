"""Issue 21: what a new user trips over in the first hour, played against real agents and the real
CLI: a file that is not a recording, a default install without its extras, the no-GPU demo, an
agent run as an ordinary user after root's, an ordinary user with no agent, the conventions of
the tools people know (-p, -o, -i, typed options, a watch mode, the GPU index)."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURE, free_port, series, wait_http

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: plays an ordinary user")


def gpuwatch(*args, timeout=60, env=None, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def test_a_file_that_is_not_a_recording_is_one_line_in_the_cli_and_once_in_the_agent_log(agent_factory, tmp_path):
    readme = Path(__file__).resolve().parents[2] / "README.md"
    for bad, why in ((readme, "it is not JSON"), (tmp_path / "empty.json", "format None")):
        if bad.name == "empty.json":
            bad.write_text("{}")
        out = gpuwatch("gpus", "--nvml-replay", str(bad))
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"Error: {bad} is not a gpuwatch NVML recording") and why in out.stderr
    # Was: a traceback every tick, 484 lines in 25 s. Now one line, retried with backoff.
    agent = agent_factory("--nvml-replay", str(readme), "--no-ebpf", "--no-baseline")
    text = agent.metrics()
    assert series(text, "gpuwatch_probe_state")['{probe="nvml",state="unavailable"}'] == 1.0
    time.sleep(6)  # retries at 1, 2 (and 4) s
    log = agent.output()
    assert "Traceback" not in log, log[-3000:]
    said = [line for line in log.splitlines() if "probe nvml" in line]
    assert len(said) == 1 and said[0].endswith(f"probe nvml unavailable: {readme} is not a gpuwatch NVML recording "
                                               "(`gpuwatch debug record-nvml` writes them): it is not JSON "
                                               "(Expecting value: line 1 column 1 (char 0)) (retrying in 1 s)"), said
    assert len(log.splitlines()) < 40, log


def test_a_probe_whose_extra_is_absent_is_disabled_not_down(agent_factory):
    """The default install has no gpuwatch[cupti] (nor [baseline]), and the sampler is on by
    default: it is disabled (no GpuwatchProbeDown: the rule's test plays that), said once at INFO.
    (The sampler is not started while NVML is replayed, so this agent has no NVML.)"""
    if importlib.util.find_spec("cupti") is not None:
        pytest.skip("cupti-python is installed in this environment: the sampler is not disabled here")
    agent = agent_factory("--no-nvml", "--no-ebpf", "--no-baseline")
    deadline = time.time() + 20
    while True:
        text = agent.metrics()
        if series(text, "gpuwatch_probe_state").get('{probe="cupti_sampler",state="disabled"}') == 1.0:
            break
        assert time.time() < deadline, text
        time.sleep(0.3)
    sampler = {k: v for k, v in series(text, "gpuwatch_probe_state").items() if 'probe="cupti_sampler"' in k}
    assert sampler['{probe="cupti_sampler",state="disabled"}'] == 1.0 and sum(sampler.values()) == 1.0, sampler
    assert series(text, "gpuwatch_probe_up")['{probe="cupti_sampler"}'] == 0.0
    status = json.loads(gpuwatch("status", "--socket", str(agent.socket), "--json").stdout)
    assert status["probes"]["cupti_sampler"]["state"] == "disabled"
    assert "pip install 'gpuwatch[cupti]'" in status["probes"]["cupti_sampler"]["reason"]
    text_status = gpuwatch("status", "--socket", str(agent.socket)).stdout
    assert re.search(r"cupti_sampler\s+disabled", text_status) and "'gpuwatch[cupti]'" in text_status
    log = agent.output()
    assert log.count("probe cupti_sampler disabled: ") == 1 and "probe cupti_sampler unavailable" not in log


def test_the_demo_is_one_command_agent_cli_and_baseline_runs_on_the_replay(tmp_path):
    port = free_port()
    demo_dir = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "demo", "--dir", str(demo_dir), "--gpus", "2",
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        lines = []
        deadline = time.time() + 90
        while time.time() < deadline and not any(line.startswith("  state:") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
        sock = str(demo_dir / "control.sock")
        assert f"  CLI:      export GPUWATCH_SOCKET={sock}" in lines, lines
        text = wait_http(f"http://127.0.0.1:{port}/metrics").decode()
        info = series(text, "gpuwatch_gpu_info")
        assert len(info) == 2 and all('gpu_index="' in k for k in info)
        uuids = sorted(re.search(r'gpu="([^"]+)"', k).group(1) for k in info)
        env = {"GPUWATCH_SOCKET": sock}
        st = json.loads(gpuwatch("status", "--json", env=env).stdout)
        assert sorted(g["uuid"] for g in st["gpus"]) == uuids
        if os.geteuid() == 0:
            # The seeded runs are kept under the replayed GPUs' own UUIDs: show by index and by UUID agree.
            by_index = json.loads(gpuwatch("baseline", "show", "--gpu", "1", "--json", env=env).stdout)
            by_uuid = json.loads(gpuwatch("baseline", "show", "--gpu", st["gpus"][1]["uuid"], "--json", env=env).stdout)
            assert len(by_index) == 3 and by_index == by_uuid
            want = sorted(f'{{gpu="{u}",result="ok"}}' for u in uuids)
            deadline = time.time() + 10  # counted by the next snapshot
            while sorted(runs := series(wait_http(f"http://127.0.0.1:{port}/metrics").decode(),
                                        "gpuwatch_baseline_runs_total")) != want and time.time() < deadline:
                time.sleep(0.2)
            assert sorted(runs) == want and set(runs.values()) == {3.0}, runs
        # No uprobes on the host's libcuda: eBPF is off in the demo.
        assert series(text, "gpuwatch_probe_up").get('{probe="ebpf"}') is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert not (demo_dir / "control.sock").exists()  # the agent stopped with it


@root_only
def test_an_ordinary_user_after_root_gets_one_line_not_a_traceback_and_is_told_whether_an_agent_runs():
    top = Path(tempfile.mkdtemp(prefix="gw-first-"))
    top.chmod(0o755)
    run = top / "run"
    try:
        port = free_port()
        root = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--no-nvml",
                                 "--no-ebpf", "--no-baseline", "--listen", f"127.0.0.1:{port}",
                                 "--state-dir", str(top / "state"), "--runtime-dir", str(run)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/metrics", proc=root)
            assert (run.stat().st_mode & 0o777) == 0o750
            out = gpuwatch("status", "--socket", str(run / "control.sock"), prefix=NOBODY)
            assert out.returncode == 1
            err = out.stderr.strip()
            assert err.startswith(f"Error: permission denied on {run}/control.sock ({run} is mode 750, owned by "
                                  "root:root, and not open to nobody); a gpuwatch agent runs (pid "), err
            assert f"pid {root.pid} as root" in err and err.endswith("run as root, or as a member of its control.group")
        finally:
            root.terminate()
            root.wait(10)
        # Root's agent is gone; its directory stays. Nobody's agent on it: one line, before serving.
        out = gpuwatch("agent", "--config", "", "--no-nvml", "--no-ebpf", "--no-baseline", "--listen",
                       f"127.0.0.1:{free_port()}", "--state-dir", str(top / "nobody-state"),
                       "--runtime-dir", str(run), prefix=NOBODY, timeout=30)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "serving Prometheus metrics" not in out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"Error: cannot use the control socket {run}/control.sock: {run} is mode 750, owned by root:root, and "
            "not open to nobody; run as its owner, or give this agent a directory of its own (--runtime-dir DIR, "
            "or control.socket)")
        out = gpuwatch("status", "--socket", str(run / "control.sock"), prefix=NOBODY)
        assert out.returncode == 1
        # (where another agent runs on this host, as beside a CI run, it says so instead)
        assert out.stderr.startswith(("Error: no gpuwatch agent is running here", "Error: permission denied")), out.stderr
        assert f"pid {root.pid} " not in out.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_cli_names_where_a_running_agent_listens(agent_factory, tmp_path):
    agent = agent_factory("--no-nvml", "--no-ebpf", "--no-baseline")
    agent.metrics()
    out = gpuwatch("status", "--socket", str(tmp_path / "elsewhere.sock"))
    assert out.returncode == 1
    # (Other agents on this host, if any, are listed beside it.)
    alone = (f"the agent pid {agent.proc.pid} listens on {agent.socket}: pass --socket {agent.socket}, or export "
             f"GPUWATCH_SOCKET={agent.socket}")
    assert alone in out.stderr or f"{agent.socket} (pid {agent.proc.pid})" in out.stderr, out.stderr


def test_conventions_short_flags_typed_options_a_watch_mode_and_the_gpu_index():
    trace = gpuwatch("trace", "--help").stdout
    for flag in ("-p, --pid PID", "-d, --duration SECONDS", "-o, --output FILE", "-i, --interval SECONDS"):
        assert flag in trace, trace
    agent = gpuwatch("agent", "--help").stdout
    assert re.search(r"--nvml-interval SECONDS\s", agent) and re.search(r"--nvml-max-processes-per-gpu INTEGER", agent)
    assert re.search(r"--state-dir PATH\s", agent) and "--nvml-interval TEXT" not in agent
    out = subprocess.Popen([sys.executable, "-m", "gpuwatch.agent.cli", "gpus", "-i", "0.3", "--json",
                            "--nvml-replay", str(FIXTURE)], stdout=subprocess.PIPE, text=True)
    try:
        frames = [json.loads(out.stdout.readline()) for _ in range(3)]
    finally:
        out.send_signal(signal.SIGINT)
        assert out.wait(10) == 0
    assert all(f[0]["uuid"] == "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110" for f in frames)
