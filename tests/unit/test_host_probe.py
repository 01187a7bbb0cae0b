"""probes/process/host.py against real processes: a saturated named thread, a process faulting in an
evicted mmapped file, one in a CPU-quota cgroup, one that exits mid-way, a reused pid."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuwatch.probes.process import host
from gpuwatch.probes.process.host import HostProcessProbe, cgroup_dirs, pressure_totals
from gpuwatch.probes.process.identity import read_stat

BURN_THREAD = r"""
import ctypes, sys, threading, time
def burn():
    ctypes.CDLL(None).prctl(15, b"gw) loader x", 0, 0, 0)  # PR_SET_NAME: a name with ") " in it
    while True:
        pass
threading.Thread(target=burn, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def spawn(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def by(samples, metric, **labels):
    return [s for s in samples if s.metric == metric and all(s.labels.get(k) == v for k, v in labels.items())]


def two_reads(probe, wait=1.0):
    probe.collect()
    time.sleep(wait)
    return probe.collect()


def test_a_saturated_thread_is_named_with_its_share_of_a_core():
    p = spawn(BURN_THREAD)
    try:
        out = two_reads(HostProcessProbe(lambda: {p.pid: "trainer"}))
        tid = max(by(out, "gpuwatch.process.thread.cpu.utilization"), key=lambda s: s.value).labels["tid"]
        thread_stat = read_stat(int(tid), f"/proc/{p.pid}/task")
    finally:
        p.kill()
        p.wait()
    threads = by(out, "gpuwatch.process.thread.cpu.utilization", pid=str(p.pid), process="trainer")
    assert threads and threads[0].labels["thread"] == "gw__loader_x"  # sanitised: ")" and " " are "_"
    assert threads[0].value >= 0.7 and threads[0].labels["tid"] != str(p.pid)
    assert len(threads) <= HostProcessProbe.TOP_THREADS
    (cpu,) = by(out, "gpuwatch.process.cpu.utilization")
    assert 0.7 <= cpu.value <= 1.5
    modes = {s.labels["mode"]: s.value for s in by(out, "gpuwatch.process.cpu.time")}
    assert set(modes) == {"user", "system"} and modes["user"] >= 0.5
    assert by(out, "gpuwatch.process.memory.rss")[0].value > 1 << 20
    assert {s.labels["type"] for s in by(out, "gpuwatch.process.context_switches")} == {"voluntary", "involuntary"}
    # read_stat split comm at the last ")": the thread's fields parse
    assert thread_stat is not None and thread_stat.comm == "gw) loader x" and thread_stat.user_ticks > 0


def disk_backed_dir() -> str | None:
    for d in ("/var/tmp", "/root", os.getcwd()):
        fs = subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True).stdout.strip()
        if fs and fs not in ("tmpfs", "ramfs") and os.access(d, os.W_OK):
            return d
    return None


def test_faulting_in_an_evicted_mmapped_file_shows_as_major_faults_and_reads(tmp_path):
    d = disk_backed_dir()
    if d is None:
        pytest.skip("no disk-backed writable directory: the page cache cannot be dropped for a file")
    path = os.path.join(d, f"gw-host-test-{os.getpid()}.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * 64)  # 64 MiB
        f.flush()
        os.fsync(f.fileno())
    code = f"""
import mmap, os, sys, time
fd = os.open({path!r}, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
print("ready", flush=True)
sys.stdin.readline()
total = sum(m[i] for i in range(0, len(m), 4096))  # every page once
print("ready", flush=True)
time.sleep(600)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        probe = HostProcessProbe(lambda: {p.pid: "server"})
        first = probe.collect()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ready"
        second = probe.collect()
    finally:
        p.kill()
        p.wait()
        os.unlink(path)
    major = [by(out, "gpuwatch.process.paging.faults", type="major")[0].value for out in (first, second)]
    reads = [by(out, "gpuwatch.process.disk.io", direction="read")[0].value for out in (first, second)]
    if major[1] - major[0] < 1:
        pytest.skip("this filesystem kept the file cached through POSIX_FADV_DONTNEED: no major fault to see")
    # readahead brings most pages in ahead of the touch (those faults are minor): the disk reads say how much
    assert reads[1] - reads[0] >= 32 << 20  # most of the 64 MiB came from the disk


def test_a_process_that_exits_or_whose_pid_is_reused_starts_afresh():
    p = spawn(BURN_THREAD)
    probe = HostProcessProbe(lambda: {p.pid: "trainer", 999_999_999: "never"})
    probe.collect()
    probe._state[p.pid].start_time -= 1  # as if another process had had the pid last time
    out = probe.collect()
    assert by(out, "gpuwatch.process.cpu.time") and not by(out, "gpuwatch.process.cpu.utilization")
    assert not by(out, "gpuwatch.process.thread.cpu.utilization")  # no rate across two processes
    p.kill()
    p.wait()
    assert probe.collect() == [] and probe._state == {}  # gone: no series, no state, no exception


def test_state_of_pids_no_longer_given_is_forgotten():
    p = spawn(BURN_THREAD)
    given = {p.pid: "trainer"}
    try:
        probe = HostProcessProbe(lambda: dict(given))
        probe.collect()
        assert p.pid in probe._state
        given.clear()
        assert probe.collect() == [] and probe._state == {}
    finally:
        p.kill()
        p.wait()


def test_pressure_and_cpu_stat_files_parse_and_bad_lines_are_left_out():
    text = "some avg10=0.00 avg60=1.50 avg300=0.20 total=2500000\nfull avg10=0.00 total=x\nbogus total=5\n"
    assert pressure_totals(text) == {"some": 2.5}
    assert pressure_totals(None) == {}
    assert host._kv("nr_periods 10\nnr_throttled 4\nthrottled_usec 123\nbad\nx y\n") == {
        "nr_periods": 10, "nr_throttled": 4, "throttled_usec": 123}
    assert host._kv("VmRSS:\t  1234 kB\nVmSwap:\t 0 kB\n") == {"VmRSS": 1234, "VmSwap": 0}


def test_a_cgroup_path_from_another_namespace_is_not_followed(tmp_path):
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/../../elsewhere\n")
    root = tmp_path / "cg"
    (root).mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    assert cgroup_dirs(7, str(proc), str(root)) == ("", "")
    (proc / "7" / "cgroup").write_text("0::/job.slice\n")
    assert cgroup_dirs(7, str(proc), str(root)) == (str(root / "job.slice"), "")


def _quota_cgroup() -> tuple[str, str] | None:
    """A fresh cgroup with a 10 % CPU quota: (its directory, the file a pid is written to)."""
    name = f"gw-host-test-{os.getpid()}"
    for base, quota, procs in (("/sys/fs/cgroup", "cpu.max", "cgroup.procs"),
                               ("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "cgroup.procs"),
                               ("/sys/fs/cgroup/cpu,cpuacct", "cpu.cfs_quota_us", "cgroup.procs")):
        if not os.path.exists(f"{base}/{quota if base != '/sys/fs/cgroup' else 'cgroup.controllers'}"):
            continue
        d = f"{base}/{name}"
        try:
            os.mkdir(d)
            with open(f"{d}/{quota}", "w") as f:
                f.write("10000 100000" if quota == "cpu.max" else "10000")
            return d, f"{d}/{procs}"
        except OSError:
            try:
                os.rmdir(d)
            except OSError:
                pass
    return None


def test_a_cpu_quota_shows_as_throttled_time_and_periods():
    made = _quota_cgroup()
    if made is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (no writable cgroup v2 cpu.max or v1 cpu "
                    "controller): throttling is not exercised")
    d, procs = made
    p = spawn(BURN_THREAD)
    try:
        with open(procs, "w") as f:
            f.write(str(p.pid))
        out = two_reads(HostProcessProbe(lambda: {p.pid: "trainer"}), wait=1.5)
    finally:
        p.kill()
        p.wait()
        time.sleep(0.2)
        os.rmdir(d)
    (throttled,) = by(out, "gpuwatch.process.cgroup.cpu.throttled.time")
    (periods,) = by(out, "gpuwatch.process.cgroup.cpu.throttled.periods")
    assert throttled.value > 0.5 and periods.value >= 5  # 90 % of each 100 ms period throttled
    (cpu,) = by(out, "gpuwatch.process.cpu.utilization")
    assert cpu.value <= 0.3  # the quota held it to ~10 %
