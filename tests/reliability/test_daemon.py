"""Faults 4, 12 and 14 of issue 8 against a real agent (NVML replayed, no eBPF): a child killed by
SIGSEGV, a full disk, a read-only state directory, a truncated database, and SIGHUP with a junk
config, each while /metrics is scraped."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpuwatch.agent import control
from tests.reliability.helpers import (
    Scraper, assert_kept, gpuwatch, kept_state, make_state, replay_args, set_faults, value, wait_until,
)


def store_status(agent) -> dict:
    return control.call(str(agent.socket), "status")["store"]


# ---- 4: a crash inside native code, in a child process -------------------------------------------

def test_4_baseline_child_killed_by_sigsegv_leaves_the_daemon_serving(agent_factory, tmp_path):
    crasher = tmp_path / "crash-python"
    crasher.write_text("#!/bin/sh\nkill -SEGV $$\n")  # what a segfault in torch or the CUDA driver looks like
    crasher.chmod(0o755)
    agent = agent_factory(*replay_args(), "--baseline-python", str(crasher))
    agent.metrics()
    with Scraper(agent.url) as scraper:
        out = gpuwatch("baseline", "run", "--socket", str(agent.socket), "--json")
        time.sleep(1)
    scraper.check()
    assert agent.proc.poll() is None
    (run,) = __import__("json").loads(out.stdout)
    assert run["result"] == "failed" and "SIGSEGV" in run["reason"], run
    assert "SIGSEGV" in agent.output()
    assert value(agent.metrics(), "gpuwatch_baseline_runs_total", result="failed") == 1.0


def test_4_a_segfault_in_the_daemon_itself_is_reported_and_a_restart_finds_the_store(agent_factory, tmp_path):
    """NVML runs in the daemon's process: a crash there ends it (systemd restarts it). What the test
    shows is what is left: the stack of each thread in the log, and the store intact for the next
    agent. SIGSEGV sent from outside takes the same path as one raised inside libnvidia-ml."""
    agent = agent_factory(*replay_args())
    agent.metrics()
    before = make_state(agent, runs=2)
    agent.proc.send_signal(signal.SIGSEGV)
    assert agent.proc.wait(20) == -signal.SIGSEGV
    out = agent.output()
    # The stack of every thread: inside libnvidia-ml, the NVML call that crashed.
    assert "Fatal Python error: Segmentation fault" in out and "most recent call first" in out
    again = agent_factory(*replay_args(), "--state-dir", str(agent.state))
    again.state = agent.state
    again.metrics()
    assert_kept(before, kept_state(again))


# ---- 12: disk full, read-only state directory, truncated database ---------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (root only, as in this sandbox); lazily unmounted at the end."""
    mounts: list[Path] = []

    def mount(path: Path, size: str = "4M", options: str = "") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_12_disk_full_stops_store_writes_and_they_resume(agent_factory, tmp_path, tmpfs):
    tmpfs(tmp_path / "a0" / "state")
    ctl = tmp_path / "nvml-control.json"
    set_faults(ctl)
    agent = agent_factory(*replay_args(), env={"GPUWATCH_TEST_NVML_CONTROL": str(ctl)})
    agent.metrics()
    before = make_state(agent)
    with Scraper(agent.url) as scraper:
        filler = fill(agent.state)
        # Things to record while the disk is full: a baseline run and probe events.
        gpuwatch("baseline", "run", "--socket", str(agent.socket), "--json")
        set_faults(ctl, [{"error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}])
        wait_until(lambda: value(agent.metrics(), "gpuwatch_probe_up", probe="nvml") == 0.0, what="nvml down")
        wait_until(lambda: store_status(agent)["write_errors"] > 0, what="a failed store write")
        filler.unlink()
        set_faults(ctl)
        # The workload runs on the GPUs NVML sees: once it is back.
        wait_until(lambda: value(agent.metrics(), "gpuwatch_probe_up", probe="nvml") == 1.0, what="nvml up")
        out = gpuwatch("baseline", "run", "--socket", str(agent.socket), "--json")
        assert out.returncode == 0, out.stdout + out.stderr
    scraper.check()
    log = agent.output()
    assert "cannot write to" in log and "works again" in log
    after = kept_state(agent)
    assert_kept(before, after)
    assert len(after["runs"]) > len(before["runs"])  # the run after the disk was freed is kept


def test_12_read_only_state_directory_at_start(agent_factory, tmp_path):
    first = agent_factory(*replay_args())
    first.metrics()
    before = make_state(first, runs=1)
    first.stop()
    # A read-only bind mount of the populated state directory: root's permissions do not matter.
    state = first.state
    subprocess.run(["mount", "--bind", str(state), str(state)], check=True)
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        agent = agent_factory(*replay_args(), "--state-dir", str(state))
        agent.metrics()
        with Scraper(agent.url) as scraper:
            st = wait_until(lambda: store_status(agent), what="status")
            # Either the store cannot open (and says why) or its writes fail (and are counted).
            out = gpuwatch("baseline", "run", "--socket", str(agent.socket), "--json")
            assert out.returncode in (0, 1)
            st = store_status(agent)
            assert "error" in st or st["write_errors"] > 0, st
            time.sleep(1)
        scraper.check()
        assert "is not writable (read-only file system" in agent.output(), agent.output()[-2000:]
        agent.stop()
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
    again = agent_factory(*replay_args(), "--state-dir", str(state))
    again.state = state  # --state-dir wins over the helper's own
    again.metrics()
    assert_kept(before, kept_state(again))


def test_12_truncated_database_at_start(agent_factory, tmp_path):
    first = agent_factory(*replay_args())
    first.metrics()
    make_state(first, runs=3)
    first.stop()
    db = first.state / "gpuwatch.db"
    for side in ("-wal", "-shm"):
        Path(str(db) + side).unlink(missing_ok=True)
    os.truncate(db, os.path.getsize(db) // 3)
    agent = agent_factory(*replay_args(), "--state-dir", str(first.state))
    agent.metrics()
    with Scraper(agent.url) as scraper:
        st = wait_until(lambda: store_status(agent), what="status")
        time.sleep(1)
    scraper.check()
    assert "error" in st and "gpuwatch.db" in st["error"] and "move it aside" in st["error"], st
    assert "running without the store" in agent.output()
    with pytest.raises(control.ControlError, match="without its store"):
        control.call(str(agent.socket), "baseline.show", {})


# ---- 14: SIGHUP with an invalid config ------------------------------------------------------------

def test_14_sighup_with_junk_config_keeps_the_running_one(agent_factory, tmp_path):
    config = tmp_path / "gpuwatch.toml"
    config.write_text('[agent]\nlog_level = "info"\n')
    agent = agent_factory(*replay_args(), config=str(config))
    agent.metrics()
    before = make_state(agent, runs=1)
    with Scraper(agent.url) as scraper:
        for junk in (b"[agent\nlog_level = = \n", b"\xff\xfe not utf-8", b'[nvml]\ninterval = "fast"\n'):
            config.write_bytes(junk)
            n = agent.output().count("config reload rejected")
            agent.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: agent.output().count("config reload rejected") > n, what="reload rejected")
        config.write_text('[agent]\nlog_level = "debug"\n')
        agent.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in agent.output(), what="good reload")
        time.sleep(1)
    scraper.check()
    assert agent.proc.poll() is None
    assert value(agent.metrics(), "gpuwatch_probe_up", probe="nvml") == 1.0
    assert_kept(before, kept_state(agent))
