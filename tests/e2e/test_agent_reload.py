"""SIGHUP and the config file with real agents: every section's changes are named, a config path
that is a FIFO neither hangs the start nor leaks a thread per SIGHUP."""
import os
import signal
import subprocess
import sys
import time

from gpuwatch.agent import config
from tests.conftest import FIXTURE, wait_for

REPLAY = ("--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling", "--no-baseline")

# One setting per section that the test agent's flags do not override, with a valid new value.
# Every section of SETTINGS must be here: a new section fails this test until it is added.
CHANGES = {
    "control": ("group", '"root"'),
    "prometheus": ("enabled", "false"),
    "nvml": ("interval", "2.0"),
    "ebpf": ("max_processes", "5"),
    "history": ("points", "100"),
    "cupti": ("group_seconds", "1.0"),
    "otlp": ("endpoint", '"http://127.0.0.1:4999"'),
    "baseline": ("interval", "3600.0"),
    "host": ("interval", "10.0"),
    "budget": ("files_per_user", "16"),
    "agent": ("log_level", '"debug"'),  # last: it is applied at once, and debug is verbose
}


def _toml(changes: dict) -> str:
    return "".join(f"[{sec}]\n{key} = {value}\n" for sec, (key, value) in changes.items())


def test_every_sections_change_is_named_on_reload(agent_factory, tmp_path):
    assert set(CHANGES) == set(config._SECTIONS)
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text("")
    agent = agent_factory(*REPLAY, config=str(cfg))
    agent.metrics()
    done: dict = {}
    for sec, change in CHANGES.items():
        done[sec] = change
        cfg.write_text(_toml(done))
        n = agent.output().count("config reloaded")
        agent.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: agent.output().count("config reloaded") > n, 10), agent.output()
        line = agent.output().split("config reloaded")[-1].splitlines()[0]
        assert line.startswith(f": {sec}.{change[0]} changed"), line
    assert "config reloaded: agent.log_level changed, applied now" in agent.output()
    assert "otlp.endpoint changed; otlp.endpoint takes effect on restart" in agent.output()
    assert "no changes" not in agent.output()


def test_agent_with_a_fifo_as_config_says_so_and_exits(tmp_path):
    fifo = tmp_path / "gpuwatch.toml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", str(fifo), *REPLAY],
                         capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 10
    assert out.returncode == 1
    assert f"{fifo}: is a FIFO (named pipe), not a regular file" in out.stderr and "Traceback" not in out.stderr


def test_config_symlink_to_a_regular_file_is_followed(tmp_path):
    real = tmp_path / "managed.toml"
    real.write_text("[nvml]\ninterval = 2.0\n")
    (tmp_path / "gpuwatch.toml").symlink_to(real)
    assert config.load(str(tmp_path / "gpuwatch.toml")).nvml.interval == 2.0


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_sighup_with_the_config_replaced_by_a_fifo_leaks_no_thread_and_says_it_once(agent_factory, tmp_path):
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text("")
    agent = agent_factory(*REPLAY, config=str(cfg))
    agent.metrics()
    time.sleep(1)  # the probes' and exporter's threads are up
    before = _threads(agent.proc.pid)
    cfg.unlink()
    os.mkfifo(cfg)
    for _ in range(5):
        agent.proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)
    assert wait_for(lambda: "is a FIFO" in agent.output(), 10), agent.output()
    time.sleep(1)
    assert wait_for(lambda: _threads(agent.proc.pid) <= before, 5), (before, _threads(agent.proc.pid))
    assert agent.output().count("ERROR gpuwatch.agent: config reload rejected") == 1, agent.output()
    assert agent.output().count("event config.reload_rejected") == 1, agent.output()  # one event, too
    assert agent.proc.poll() is None and "hw_power_watts" in agent.metrics()
    # Back to a file: the reload works, and a later FIFO is said again.
    cfg.unlink()
    cfg.write_text("[history]\npoints = 100\n")
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "history.points changed" in agent.output(), 10), agent.output()


def test_a_rejected_reload_is_a_metric_a_status_line_and_an_event(agent_factory, tmp_path):
    """Issue 35 item 5: was only in the log."""
    import json

    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text("")
    agent = agent_factory(*REPLAY, config=str(cfg))
    import re

    def value(name):
        m = re.search(rf"^{name} (\S+)$", agent.metrics(), re.M)
        return float(m.group(1)) if m else None
    assert wait_for(lambda: value("gpuwatch_config_last_reload_success") == 1.0, 20), agent.metrics()
    started = value("gpuwatch_config_last_reload_success_timestamp_seconds")
    assert abs(started - time.time()) < 60
    cfg.write_text("[nvml]\ninterval = -1\n")
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: value("gpuwatch_config_last_reload_success") == 0.0, 10), agent.output()
    assert value("gpuwatch_config_last_reload_success_timestamp_seconds") == started

    def status(*args):
        return subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "status", "--socket", str(agent.socket),
                               *args], capture_output=True, text=True, timeout=30).stdout
    st = json.loads(status("--json"))
    assert st["config"]["success"] is False and "nvml.interval" in st["config"]["error"]
    assert wait_for(lambda: any(e["kind"] == "config.reload_rejected"
                                for e in json.loads(status("--json"))["recent_events"]), 10)
    assert "config: the last reload" in status() and "was rejected" in status()
    cfg.write_text("[nvml]\ninterval = 2.0\n")  # fixed: 1 again, with the time of that reload
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: value("gpuwatch_config_last_reload_success") == 1.0, 10), agent.output()
    assert value("gpuwatch_config_last_reload_success_timestamp_seconds") > started
    assert json.loads(status("--json"))["config"]["success"] is True
