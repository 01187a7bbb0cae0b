"""The agent and the CLI as a user runs them: real processes, real sockets."""
import json
import subprocess
import sys
import time

from tests.conftest import FIXTURE


def gpuwatch(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def wait_status(agent, timeout=20):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = gpuwatch("status", "--socket", str(agent.socket), "--json")
        if out.returncode == 0:
            st = json.loads(out.stdout)
            if st["probes"].get("nvml", {}).get("state") not in (None, "starting"):
                return st
        time.sleep(0.2)
    raise AssertionError(f"no status from the agent: {out.stderr}\n{agent.output()}")


def test_status_reports_probes_gpus_and_exporter(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "2")
    st = wait_status(agent)
    assert st["probes"]["nvml"]["state"] == "up"
    assert [g["index"] for g in st["gpus"]] == [0, 1]
    assert all(g["up"] and 140e9 < g["memory_total_bytes"] < 160e9 for g in st["gpus"])
    assert st["exporters"]["prometheus"]["listen"] == f"127.0.0.1:{agent.port}"
    assert st["store"]["path"].endswith("gpuwatch.db")
    human = gpuwatch("status", "--socket", str(agent.socket))
    assert human.returncode == 0 and "nvml" in human.stdout and "NVIDIA H200" in human.stdout


def test_second_agent_on_the_same_port_says_why_it_cannot_start(agent_factory, tmp_path):
    first = agent_factory("--nvml-replay", str(FIXTURE))
    first.metrics()
    out = gpuwatch("agent", "--config", "", "--listen", f"127.0.0.1:{first.port}", "--state-dir",
                   str(tmp_path / "s2"), "--runtime-dir", str(tmp_path / "r2"), "--nvml-replay", str(FIXTURE))
    assert out.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{first.port}" in out.stderr and "in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_agent_without_a_usable_state_dir_still_serves(agent_factory, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--state-dir", str(blocker / "state"))
    assert "hw_power_watts" in agent.metrics() or wait_status(agent)
    st = wait_status(agent)
    assert str(blocker) in st["store"]["error"]
    assert "store unavailable" in gpuwatch("status", "--socket", str(agent.socket)).stdout


def test_bad_config_fails_at_start_naming_file_key_and_reason(tmp_path):
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text('[nvml]\ninterval = "fast"\n')
    out = gpuwatch("agent", "--config", str(cfg))
    assert out.returncode == 1
    assert f"{cfg}: nvml.interval:" in out.stderr and '"fast"' in out.stderr
    out = gpuwatch("agent", "--config", "", "--nvml-interval", "-1")
    assert out.returncode == 1 and "--nvml-interval / $GPUWATCH_NVML_INTERVAL: nvml.interval" in out.stderr


def test_bad_web_config_stops_the_agent_naming_file_key_and_reason(tmp_path, pki):
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n")  # no key_file
    base = ["agent", "--config", "", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
            "--runtime-dir", str(tmp_path / "r"), "--nvml-replay", str(FIXTURE)]
    out = gpuwatch(*base, "--web-config", str(web))
    assert out.returncode == 1, out.stderr
    assert f"bad web config (prometheus.web_config): {web}: tls_server_config.key_file: missing" in out.stderr
    assert "Traceback" not in out.stderr
    web.write_text("basic_auth_users:\n  alice: hunter2\n")
    out = gpuwatch(*base, "--web-config", str(web))
    assert out.returncode == 1 and f"{web}: basic_auth_users.alice: not a bcrypt hash" in out.stderr
    assert "hunter2" not in out.stderr
    out = gpuwatch(*base, "--web-config", str(tmp_path / "absent.yml"))
    assert out.returncode == 1 and "prometheus.web_config: no such file" in out.stderr


def test_gpus_lists_recorded_gpu_and_its_process():
    out = gpuwatch("gpus", "--config", "", "--nvml-replay", str(FIXTURE), "--json")
    assert out.returncode == 0, out.stderr
    (gpu,) = json.loads(out.stdout)
    assert gpu["name"] == "NVIDIA H200" and gpu["uuid"].startswith("GPU-")
    (proc,) = gpu["processes"]
    assert proc["name"] == "python3" and proc["memory_bytes"] > 2 * 2**30  # the recorded job held 2 GiB
    table = gpuwatch("gpus", "--config", "", "--nvml-replay", str(FIXTURE))
    assert gpu["uuid"] in table.stdout and "python3" in table.stdout


def test_gpus_and_doctor_without_a_gpu_say_why():
    out = gpuwatch("gpus", "--config", "")
    assert out.returncode == 1 and "NVML unavailable" in out.stderr and "install the NVIDIA driver" in out.stderr
    doc = gpuwatch("doctor", "--config", "", "--json")
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert checks["nvml library"]["ok"] is False and checks["nvml library"]["remedy"]
    assert doc.returncode == 1


def test_status_without_an_agent_says_so(tmp_path):
    out = gpuwatch("status", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "no gpuwatch agent is listening" in out.stderr


def test_sigterm_stops_the_agent_promptly(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE))
    agent.metrics()
    t = time.monotonic()
    assert agent.stop() == 0
    assert time.monotonic() - t < 5
    assert not agent.socket.exists()


def test_sighup_with_an_invalid_config_keeps_the_running_one(agent_factory, tmp_path):
    import signal

    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text('[agent]\nlog_level = "info"\n')
    agent = agent_factory("--nvml-replay", str(FIXTURE), config=str(cfg))
    agent.metrics()
    cfg.write_text("[nvml\njunk")
    agent.proc.send_signal(signal.SIGHUP)
    end = time.monotonic() + 10
    while "config reload rejected" not in agent.output() and time.monotonic() < end:
        time.sleep(0.1)
    assert "config reload rejected, keeping the running config" in agent.output()
    assert str(cfg) in agent.output()
    assert agent.proc.poll() is None and "hw_power_watts" in agent.metrics()
    cfg.write_text('[agent]\nlog_level = "debug"\n')
    agent.proc.send_signal(signal.SIGHUP)
    end = time.monotonic() + 10
    while "config reloaded" not in agent.output() and time.monotonic() < end:
        time.sleep(0.1)
    assert "config reloaded: agent.log_level changed, applied now" in agent.output()
