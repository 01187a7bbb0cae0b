"""`gpuwatch demo`: a real agent on GPUs recorded on an H200, for a machine without one.

The agent is the real one (`gpuwatch agent` in a child process) with NVML and the reference
workload replayed from the recordings in the repository's tests/fixtures; eBPF is off, so it
attaches nothing to the host's processes. Its state and control socket live in one directory of
their own, and the CLI is pointed there with GPUWATCH_SOCKET. As root it first runs the reference
workload a few times on each GPU so that `baseline show` and the baselines dashboard have runs.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid as uuidlib
from pathlib import Path

from gpuwatch.agent import control
from gpuwatch.agent.api import GpuwatchError

# The recordings live beside the tests that use them; a wheel does not carry them.
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
NVML_RECORDING = FIXTURES / "nvml-h200.json"
BASELINE_RECORDING = FIXTURES / "baseline-h200.json"
START_TIMEOUT = 30.0
SEED_ROUNDS = 3  # reference-workload runs per GPU before the demo says it is ready


TICKS = 1800  # replayed seconds; then the last answers hold
LEAK_START = 2 << 30  # the trainer's GPU memory at the start...
LEAK_RATE = 1 << 30  # ...and what it adds each replayed second: 95 % full in about 2 minutes
FULL = 0.96  # the trainer "runs out of memory" (is stopped) when its GPU is this full
# The local processes the demo starts and lists on its GPUs: (name, GPU, GPU memory, CPU duty cycle)
PROCESSES = (("trainer", 0, LEAK_START, 0.3), ("inference", 1, 20 << 30, 0.1))
# A real process that names itself (its comm, which gpuwatch shows) and keeps a share of a core busy.
_PROCESS = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
duty = float(sys.argv[2])
keep = bytearray(64 << 20)  # some RSS for its host side
while True:
    t = time.monotonic()
    while time.monotonic() - t < duty * 0.1:
        pass
    time.sleep((1 - duty) * 0.1)
"""


def build_recording(path: Path, gpus: int, pids: list[int]) -> int:
    """The H200 recording as `gpus` distinct GPUs (UUIDs, bus ids, load, power, temperature) with the
    demo's processes on the first two, the trainer's memory growing until its GPU is full. Returns
    the replayed second at which it is full."""
    rec = json.loads(NVML_RECORDING.read_text())
    n = rec["ticks"]
    base = rec["gpus"][0]

    def latest(op: str):
        return next(a["value"] for a in reversed(base[op][:n]) if a and "value" in a)
    mem = latest("memory_info_v2")
    total, reserved = mem["total"], mem["reserved"]
    full = int((FULL * total - LEAK_START) / LEAK_RATE) + 1  # the replayed second at which the GPU is FULL
    cap = total - reserved - (512 << 20)  # where the leak stops: the GPU has no more to give
    out = []
    for i in range(gpus):
        g = copy.deepcopy(base)
        for op, answers in g.items():
            g[op] = answers[:n] + [None] * (TICKS - n)  # None: the latest answer again
        load = max(0.0, 1.0 - 0.35 * i) if i < 3 else 0.0  # three busy GPUs, the rest idle

        def each(op: str, make):
            g[op] = [{"value": make(t)} for t in range(TICKS)]
        each("uuid", lambda t: "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"gpuwatch-demo/{i}")))
        each("pci_bus_id", lambda t: f"00000000:{0x18 + 0x10 * i:02X}:00.0")
        each("serial", lambda t: f"16539240567{i:02d}")
        each("utilization", lambda t: {"gpu": round(68 * load + 3 * (t % 5) * load), "memory": round(19 * load)})
        each("power_usage", lambda t: int(75_000 + 545_000 * load + 4_000 * (t % 7)))
        each("temperature", lambda t: int(31 + 17 * load + i % 3))
        each("clock sm", lambda t: 1980 if load == 0 else 1755 + 45 * (t % 3))
        procs = [(pid, m, t0 == 0) for pid, (_name, gpu, m, _d), t0 in
                 zip(pids, PROCESSES, range(len(PROCESSES))) if gpu == i]

        def used_by(t: int) -> list[dict]:
            return [{"pid": pid, "used_memory": min(m + LEAK_RATE * t, cap) if leaking else m}
                    for pid, m, leaking in procs]
        each("compute_processes", used_by)
        each("process_utilization", lambda t: [{"pid": pid, "time_stamp": 0, "sm_util": round(61 * load),
                                                "mem_util": round(17 * load), "enc_util": 0, "dec_util": 0}
                                               for pid, _m, _l in procs])
        each("memory_info_v2", lambda t: (lambda used: {"total": total, "reserved": reserved,
                                                        "used": used, "free": total - reserved - used})(
            sum(p["used_memory"] for p in used_by(t)) + (256 << 20)))
        out.append(g)
    rec["gpus"], rec["ticks"] = out, TICKS
    rec["system"] = {op: answers[:n] + [None] * (TICKS - n) for op, answers in rec["system"].items()
                     if not op.startswith("process_name")}  # the recording's pid is not on this host
    path.write_text(json.dumps(rec))
    return full


def agent_command(directory: Path, gpus: int, listen: str, recording: Path | None = None) -> list[str]:
    for f in (NVML_RECORDING, BASELINE_RECORDING):
        if not f.is_file():
            raise GpuwatchError(f"the demo replays {f}, which is not here: run it from a clone of the gpuwatch "
                                "repository (pip install -e .), or start `gpuwatch agent --nvml-replay FILE` yourself")
    # warnings and errors only: the banner is what the person reads
    return [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", "", "--log-level", "warning",
            "--state-dir", str(directory / "state"), "--runtime-dir", str(directory),
            "--listen", listen, "--nvml-replay", str(recording or NVML_RECORDING),
            "--baseline-replay", str(BASELINE_RECORDING), "--no-ebpf"]


def _full(socket_path: str) -> bool:
    """Does the agent read the trainer's GPU (the first) as FULL?"""
    try:
        gpus = control.call(socket_path, "top", timeout=2.0).get("gpus") or []
    except control.ControlError:
        return False
    g = next((g for g in gpus if g.get("index") == 0), None)
    return bool(g and g.get("memory_total_bytes") and
                (g.get("memory_used_bytes") or 0) >= FULL * g["memory_total_bytes"])


def check_port(listen: str) -> None:
    """Refuse at once, naming --listen, when something (another agent) serves on the port."""
    host, _, port = listen.rpartition(":")
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            raise GpuwatchError(f"{listen} is taken ({e.strerror}: another gpuwatch agent?): give the demo "
                                f"another port, `gpuwatch demo --listen 127.0.0.1:{int(port) + 1}`") from None


def _wait_ready(proc: subprocess.Popen, socket_path: str) -> None:
    end = time.monotonic() + START_TIMEOUT
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise GpuwatchError(f"the demo agent exited with status {proc.returncode} (its log is above)")
        try:
            st = control.call(socket_path, "status", timeout=2.0)
            if st.get("snapshot_age_seconds") is not None and (st.get("probes") or {}).get("nvml", {}).get("up"):
                return  # the replayed GPUs are there: the reference workload can be seeded on them
        except control.ControlError:
            pass
        time.sleep(0.2)
    raise GpuwatchError(f"the demo agent did not answer on {socket_path} within {START_TIMEOUT:.0f} s")


def _seed(socket_path: str, say) -> None:
    if os.geteuid() != 0:
        say("(not root: no reference-workload runs seeded; `baseline show` stays empty until its schedule)")
        return
    for i in range(SEED_ROUNDS):
        say(f"replaying reference-workload run {i + 1}/{SEED_ROUNDS} on each GPU...")
        control.call(socket_path, "baseline.run", {}, timeout=120.0)


def run(directory: Path, gpus: int, listen: str, say) -> int:
    """Start the agent, seed it, say how to use it, and wait for Ctrl-C (or for the agent to exit)."""
    check_port(listen)
    directory.mkdir(parents=True, exist_ok=True)
    socket_path = str(directory / "control.sock")

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the agent is stopped, never left behind
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    local = [subprocess.Popen([sys.executable, "-c", _PROCESS, name, str(duty)], stdin=subprocess.DEVNULL)
             for name, _gpu, _mem, duty in PROCESSES]
    recording = directory / "demo-nvml.json"
    full = build_recording(recording, gpus, [p.pid for p in local])
    # The agent's log goes to our stderr; our own lines to stdout, so `2>/dev/null` leaves the how-to.
    proc = subprocess.Popen(agent_command(directory, gpus, listen, recording), stdin=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        _wait_ready(proc, socket_path)
        _seed(socket_path, say)
        host, _, port = listen.rpartition(":")
        say("")
        say(f"gpuwatch demo: a real agent on {gpus} replayed H200s (pid {proc.pid}); Ctrl-C stops it.")
        say(f"  metrics:  curl -s http://{host}:{port}/metrics | grep '^hw_power_watts{{'")
        say(f"  CLI:      export GPUWATCH_SOCKET={socket_path}")
        say("            gpuwatch status; gpuwatch gpus; gpuwatch top; gpuwatch leaks; gpuwatch findings; "
            "gpuwatch baseline show --gpu 0")
        say(f"  story:    `trainer` (pid {local[0].pid}, GPU 0) leaks 1 GiB/s: `gpuwatch leaks` finds it in about a "
            f"minute with a time to OOM; at {FULL:.0%} full (~{full} s) the demo stops it, and `gpuwatch findings` "
            "scores the forecast against that OOM")
        say(f"  Grafana:  scrape {host}:{port} from Prometheus, import dashboards/grafana/*.json")
        say(f"  state:    {directory} (rm -r it when done)")
        while proc.poll() is None:
            if local[0].poll() is None and time.monotonic() - started >= full * 0.8 and _full(socket_path):
                local[0].kill()  # its GPU is full, as the agent reads it: the OOM that ends it
            time.sleep(0.5)
        return proc.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        for p in local:
            if p.poll() is None:
                p.kill()
            p.wait()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
