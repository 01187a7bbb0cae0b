"""The agent's start and stop with real agents: the state directory lock, a metrics port still held
by an agent that stops, READY only when it really runs (a real NOTIFY_SOCKET)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.conftest import FIXTURE, free_port, wait_for

REPLAY = ("--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling", "--no-baseline")


def gpuwatch(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_second_agent_on_the_same_state_dir_names_the_first_and_exits(agent_factory, tmp_path):
    first = agent_factory(*REPLAY)
    first.metrics()
    t0 = time.monotonic()
    out = gpuwatch("agent", "--config", "", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(first.state),
                   "--runtime-dir", str(tmp_path / "r2"), *REPLAY)
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - t0 < 8  # the first is not stopping: no waiting
    assert (f"another gpuwatch agent (pid {first.proc.pid}) uses {first.state}; stop it or set agent.state_dir"
            in out.stderr), out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r2" / "control.sock").exists()
    assert first.proc.poll() is None and "hw_power_watts" in first.metrics()


def _hold_port(port: int, seconds: float) -> subprocess.Popen:
    code = ("import socket, sys, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {port})); s.listen(); print('held', flush=True); time.sleep({seconds})")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"held\n"
    return p


def test_port_held_for_good_waits_bounded_then_names_the_holder(tmp_path):
    port = free_port()
    holder = _hold_port(port, 60)
    try:
        t0 = time.monotonic()
        out = gpuwatch("agent", "--config", "", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s"),
                       "--runtime-dir", str(tmp_path / "r"), *REPLAY)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1, out.stderr
    assert 9.5 < took < 25
    assert out.stderr.count("is in use; waiting up to 10 s for it") == 1, out.stderr
    assert f"Address already in use by pid {holder.pid} (python" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_port_freed_while_waiting_the_agent_starts(agent_factory):
    port = free_port()
    holder = _hold_port(port, 2)
    agent = agent_factory(*REPLAY[2:], "--nvml-replay", str(FIXTURE), "--listen", f"127.0.0.1:{port}")
    # agent_factory passed its own --listen first; the last one wins
    try:
        assert "hw_power_watts" in wait_for(lambda: _get(port), 20)
    finally:
        holder.wait()
    assert agent.output().count("is in use; waiting up to 10 s") == 1


def _get(port: int) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_sigterm_before_start_up_completes_sends_no_ready_and_exits_cleanly(agent_factory, tmp_path):
    """The first collection hangs (NVML answers after 3 s; the agent waits 2 s for it): a SIGTERM once
    the port is open used to be followed by READY=1 anyway."""
    ctl = tmp_path / "nvml-control.json"
    ctl.write_text(json.dumps({"faults": [{"delay": 3.0}]}))
    sock_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_path))
    notify.settimeout(0.2)
    agent = agent_factory(*REPLAY, env={"NOTIFY_SOCKET": str(sock_path), "GPUWATCH_TEST_NVML_CONTROL": str(ctl)})
    assert wait_for(lambda: "serving Prometheus metrics" in agent.output(), 20), agent.output()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0, agent.output()
    got = []
    while True:
        try:
            got.append(notify.recv(4096).decode())
        except (socket.timeout, BlockingIOError):
            break
    assert not any("READY=1" in m for m in got), got
    assert "STOPPING=1" in got, got
    assert "stopped before start-up completed" in agent.output() and "Traceback" not in agent.output()


def test_ready_is_sent_once_running(agent_factory, tmp_path):
    sock_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_path))
    notify.settimeout(20)
    agent = agent_factory(*REPLAY, env={"NOTIFY_SOCKET": str(sock_path)})
    assert notify.recv(4096).decode().startswith("READY=1")
    assert "hw_power_watts" in agent.metrics()
    os.kill(agent.proc.pid, signal.SIGTERM)
    assert agent.proc.wait(10) == 0


def test_web_config_with_tls10_stops_the_agent_saying_it_cannot_work(tmp_path, pki):
    """OpenSSL 3 at its default security level negotiates no TLS 1.0/1.1: an agent that accepted
    min_version: TLS10 served a port no TLS 1.0 client could reach."""
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                   "  min_version: TLS10\n")
    out = gpuwatch("agent", "--config", "", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                   "--runtime-dir", str(tmp_path / "r"), *REPLAY, "--web-config", str(web))
    assert out.returncode == 1, out.stderr
    assert f"{web}: tls_server_config.min_version: TLS10 cannot work: OpenSSL 3" in out.stderr, out.stderr
    assert "use TLS12 or TLS13" in out.stderr and "Traceback" not in out.stderr
