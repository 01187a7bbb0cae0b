"""probes/process/host.py against real processes: a saturated named thread, a process faulting in an
evicted mmapped file, one in a CPU-quota cgroup, one that exits mid-way, a reused pid."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import psutil
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
        joined = time.monotonic()
        with open(procs, "w") as f:
            f.write(str(p.pid))
        out = two_reads(HostProcessProbe(lambda: {p.pid: "trainer"}), wait=1.5)
        inside = time.monotonic() - joined
    finally:
        p.kill()
        p.wait()
        time.sleep(0.2)
        os.rmdir(d)
    (throttled,) = by(out, "gpuwatch.process.cgroup.cpu.throttled.time")
    (periods,) = by(out, "gpuwatch.process.cgroup.cpu.throttled.periods")
    assert throttled.value > 0.5 and periods.value >= 5  # 90 % of each 100 ms period throttled
    # in seconds (the kernel's µs or ns converted): at most the time it spent in the cgroup, one period a 100 ms
    assert throttled.value <= inside and periods.value <= inside / 0.1 + 1
    (cpu,) = by(out, "gpuwatch.process.cpu.utilization")
    assert cpu.value <= 0.3  # the quota held it to ~10 %


# ---- exact values, from fixture trees of real-format /proc and cgroup files ---------------------------
# The probe reads stat, status, task/ and cgroup under its `proc` and the cgroup files under its
# `cgroup_root`; psutil's reads (CPU times, RSS, I/O) stay on the real process, this one.

class Tree:
    """A /proc and a cgroup root under tmp_path for this test process's pid, in the kernel's formats."""

    def __init__(self, tmp_path, monkeypatch):
        self.pid, self.proc, self.cg = os.getpid(), tmp_path / "proc", tmp_path / "cg"
        self.dir = self.proc / str(self.pid)
        (self.dir / "task").mkdir(parents=True)
        self.cg.mkdir()
        with open(f"/proc/{self.pid}/stat") as f:
            real = f.read()
        self._fields = real[real.rindex(")") + 2:].split()  # the real line's fields after "(comm) "
        with open(f"/proc/{self.pid}/status") as f:
            self._status = f.read()
        self.now = [100.0]
        monkeypatch.setattr(host, "time", type("Clock", (), {"time": staticmethod(lambda: 1.7e9),
                                                             "monotonic": staticmethod(lambda: self.now[0])}))

    def stat_line(self, pid, comm, state="S", minflt=0, majflt=0, utime=0, stime=0, start=777):
        f = list(self._fields)
        f[0], f[7], f[9], f[11], f[12], f[19] = state, minflt, majflt, utime, stime, start
        return f"{pid} ({comm}) {' '.join(map(str, f))}\n"

    def process(self, swap_kb=None, **stat):
        (self.dir / "stat").write_text(self.stat_line(self.pid, "trainer", **stat))
        status = "".join(line for line in self._status.splitlines(True) if not line.startswith("VmSwap:"))
        if swap_kb is not None:
            status += f"VmSwap:\t{swap_kb:8d} kB\n"
        (self.dir / "status").write_text(status)

    def threads(self, ticks, states=()):
        for i, t in enumerate(ticks):
            d = self.dir / "task" / str(self.pid + i)
            d.mkdir(exist_ok=True)
            state = states[i] if i < len(states) else "S"
            (d / "stat").write_text(self.stat_line(self.pid + i, f"worker {i}", state=state, utime=t - t // 2,
                                                   stime=t // 2))

    def cgroup(self, text):
        (self.dir / "cgroup").write_text(text)

    def files(self, rel, **files):
        d = self.cg / rel
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name.replace("_", ".", 1) if name.startswith(("cgroup_", "cpu_", "io_", "memory_")) else d / name
             ).write_text(text)

    def probe(self, **kw):
        return HostProcessProbe(lambda: {self.pid: "trainer"}, proc=str(self.proc), cgroup_root=str(self.cg), **kw)


def value(samples, metric, **labels):
    (s,) = by(samples, metric, **labels)
    return s.value


V2_CPU_STAT = ("usage_usec 9000000\nuser_usec 6000000\nsystem_usec 3000000\nnr_periods 500\nnr_throttled 40\n"
               "throttled_usec 2500000\nnr_bursts 0\nburst_usec 0\n")


def psi(some, full):
    return (f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n")


@pytest.fixture
def tree(tmp_path, monkeypatch):
    t = Tree(tmp_path, monkeypatch)
    t.process(swap_kb=7, minflt=12, majflt=3, utime=100, stime=50)
    t.threads([10, 10, 10, 10, 10])
    t.cgroup("0::/job.slice\n")
    t.files("", cgroup_controllers="cpuset cpu io memory hugetlb pids rdma misc\n")
    t.files("job.slice", cgroup_controllers="cpu io memory pids\n", cpu_stat=V2_CPU_STAT,
            cpu_pressure=psi(1500000, 250000), io_pressure=psi(3000000, 1000))
    return t


def test_units_are_exact_on_cgroup_v2(tree):
    out = tree.probe().collect()
    assert value(out, "gpuwatch.process.memory.swap") == 7 * 1024  # VmSwap is in kB
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.time") == 2.5  # throttled_usec: µs
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.periods") == 40
    stalls = {(s.labels["resource"], s.labels["scope"]): s.value
              for s in by(out, "gpuwatch.process.cgroup.pressure.stall.time")}
    assert stalls == {("cpu", "some"): 1.5, ("cpu", "full"): 0.25, ("io", "some"): 3.0, ("io", "full"): 0.001}
    assert value(out, "gpuwatch.process.paging.faults", type="major") == 3
    assert value(out, "gpuwatch.process.paging.faults", type="minor") == 12
    assert value(out, "gpuwatch.process.threads.blocked") == 0
    assert not by(out, "gpuwatch.process.cpu.utilization")  # seen first: no rate yet
    assert not by(out, "gpuwatch.process.thread.cpu.utilization")
    for s in out:
        assert s.resource == "" and s.ts == 1.7e9 and s.labels["pid"] == str(tree.pid)
        assert s.labels["process"] == "trainer"


def test_rates_are_per_second_of_one_core_and_only_the_busiest_threads(tree):
    probe = tree.probe()
    probe.collect()
    tree.now[0] += 2.0
    tree.process(utime=300, stime=100)  # 250 ticks more in 2 s
    # five threads, 0..100 ticks more each; two in uninterruptible sleep (D)
    tree.threads([10, 50, 110, 30, 70], states="SDSDS")
    out = probe.collect()
    assert value(out, "gpuwatch.process.cpu.utilization") == 250 / host.TICK / 2.0
    threads = [(s.labels["tid"], s.labels["thread"], s.value) for s in by(out, "gpuwatch.process.thread.cpu.utilization")]
    p = tree.pid
    assert threads == [(str(p + 2), "worker_2", 100 / host.TICK / 2.0), (str(p + 4), "worker_4", 60 / host.TICK / 2.0),
                       (str(p + 1), "worker_1", 40 / host.TICK / 2.0)]
    assert value(out, "gpuwatch.process.threads.blocked") == 2
    # a clock that did not move, then ticks that went back: no rate, not a division by zero or a negative one
    tree.process(utime=400, stime=100)
    out = probe.collect()
    assert not by(out, "gpuwatch.process.cpu.utilization") and not by(out, "gpuwatch.process.thread.cpu.utilization")
    tree.now[0] += 1.0
    tree.process(utime=10, stime=10)
    tree.threads([0, 0, 0, 0, 0])
    out = probe.collect()
    assert not by(out, "gpuwatch.process.cpu.utilization") and not by(out, "gpuwatch.process.thread.cpu.utilization")


def test_a_new_thread_has_no_rate_and_too_many_threads_are_not_read(tree):
    probe = tree.probe()
    probe.collect()
    tree.now[0] += 1.0
    tree.threads([10, 10, 10, 10, 10, 10 + host.TICK])  # tid p+5 is new
    out = probe.collect()
    assert [s.value for s in by(out, "gpuwatch.process.thread.cpu.utilization")] == [0.0, 0.0, 0.0]
    probe.MAX_THREADS = 6  # at the limit: still read
    assert by(probe.collect(), "gpuwatch.process.threads.blocked")
    probe.MAX_THREADS = 5
    out = probe.collect()
    assert not by(out, "gpuwatch.process.threads.blocked") and not by(out, "gpuwatch.process.thread.cpu.utilization")
    assert by(out, "gpuwatch.process.cpu.time")  # the process itself still is


def test_a_reused_pid_gets_no_rate_and_its_own_cgroup(tree):
    probe = tree.probe()
    probe.collect()
    tree.files("other.slice", cgroup_controllers="cpu\n", cpu_stat="nr_throttled 1\nthrottled_usec 1000000\n")
    tree.cgroup("0::/other.slice\n")  # the cgroup of a process is read once: the same process keeps its own
    tree.now[0] += 1.0
    tree.process(utime=200, stime=50)
    out = probe.collect()
    assert value(out, "gpuwatch.process.cpu.utilization") == 100 / host.TICK
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.time") == 2.5
    tree.now[0] += 1.0
    tree.process(utime=900, stime=50, start=778)  # another process under the pid now
    out = probe.collect()
    assert not by(out, "gpuwatch.process.cpu.utilization") and not by(out, "gpuwatch.process.thread.cpu.utilization")
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.time") == 1.0  # its cgroup, read afresh
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.periods") == 1
    tree.now[0] += 1.0
    tree.process(utime=1000, stime=50, start=778)
    assert value(probe.collect(), "gpuwatch.process.cpu.utilization") == 100 / host.TICK  # from its own base
    tree.process(state="Z", start=778)  # a zombie: no series, no state
    assert probe.collect() == [] and probe._state == {}


def test_cgroup_v1_cpu_controller_on_a_hybrid_host(tmp_path, monkeypatch):
    t = Tree(tmp_path, monkeypatch)
    t.process(utime=1, stime=1)
    t.threads([1])
    # v2 (unified) without the cpu controller; v1's cpu controller mounted as cpu,cpuacct
    t.cgroup("12:cpu,cpuacct:/job\n4:memory:/job\n0::/job\n")
    t.files("unified", cgroup_controllers="")
    t.files("unified/job", cgroup_controllers="", cpu_stat=V2_CPU_STAT, memory_pressure=psi(4000000, 2000000))
    t.files("cpu,cpuacct/job", cpu_stat="nr_periods 100\nnr_throttled 7\nthrottled_time 1500000000\n")
    out = t.probe().collect()
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.time") == 1.5  # throttled_time: ns
    assert value(out, "gpuwatch.process.cgroup.cpu.throttled.periods") == 7
    stalls = {(s.labels["resource"], s.labels["scope"]): s.value
              for s in by(out, "gpuwatch.process.cgroup.pressure.stall.time")}
    assert stalls == {("memory", "some"): 4.0, ("memory", "full"): 2.0}  # PSI from v2 all the same
    assert cgroup_dirs(t.pid, str(t.proc), str(t.cg)) == (str(t.cg / "unified/job"), str(t.cg / "cpu,cpuacct/job"))


@pytest.mark.parametrize("listed, mounted, also", [("cpu,cpuacct", "cpu", ""), ("cpuacct,cpu", "cpu", ""),
                                                   ("cpu,cpuacct", "cpu,cpuacct", "cpu"), ("cpu", "cpu", ""),
                                                   ("cpuacct,cpu", "cpu,cpuacct", "")])
def test_cgroup_v1_cpu_controller_wherever_it_is_mounted(tmp_path, listed, mounted, also):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text(f"bad line\n3:cpuset:/a\n5:{listed}:/job\n")
    (root / mounted / "job").mkdir(parents=True)
    if also:  # "cpu" is often a link to "cpu,cpuacct": the name listed comes first
        (root / also / "job").mkdir(parents=True)
    (root / "cpuset" / "a").mkdir(parents=True)
    assert cgroup_dirs(7, str(proc), str(root)) == ("", str(root / mounted / "job"))


def test_only_the_first_processes_given_are_read(tree, monkeypatch):
    other = os.getppid()
    (tree.proc / str(other)).mkdir()
    (tree.proc / str(other) / "stat").write_text(tree.stat_line(other, "parent"))
    probe = HostProcessProbe(lambda: {tree.pid: "trainer", other: "parent", 999_999_999: "gone"},
                             proc=str(tree.proc), cgroup_root=str(tree.cg))
    monkeypatch.setattr(probe, "MAX_PROCESSES", 1)
    assert {s.labels["pid"] for s in probe.collect()} == {str(tree.pid)}
    monkeypatch.setattr(probe, "MAX_PROCESSES", 2)
    assert {s.labels["pid"] for s in probe.collect()} == {str(tree.pid), str(other)}
    assert set(probe._state) == {tree.pid, other}


def test_every_series_with_its_labels_and_psutil_values(tree, monkeypatch, caplog):
    me = psutil.Process(tree.pid)
    cpu, ctx, io = me.cpu_times(), me.num_ctx_switches(), me.io_counters()
    probe = HostProcessProbe(lambda: {tree.pid: ""}, proc=str(tree.proc), cgroup_root=str(tree.cg))
    assert (probe.interval, HostProcessProbe(dict).proc, HostProcessProbe(dict).cgroup_root) == (
        5.0, "/proc", "/sys/fs/cgroup")
    out = probe.collect()
    cpu2, ctx2, io2 = me.cpu_times(), me.num_ctx_switches(), me.io_counters()
    assert {(s.metric, tuple(sorted(s.labels.items()))) for s in out} == {
        (m, tuple(sorted({"pid": str(tree.pid), "process": "unknown", **extra}.items()))) for m, extra in (
            ("gpuwatch.process.cpu.time", {"mode": "user"}), ("gpuwatch.process.cpu.time", {"mode": "system"}),
            ("gpuwatch.process.memory.rss", {}), ("gpuwatch.process.memory.swap", {}),
            ("gpuwatch.process.context_switches", {"type": "voluntary"}),
            ("gpuwatch.process.context_switches", {"type": "involuntary"}),
            ("gpuwatch.process.disk.io", {"direction": "read"}), ("gpuwatch.process.disk.io", {"direction": "write"}),
            ("gpuwatch.process.paging.faults", {"type": "major"}), ("gpuwatch.process.paging.faults", {"type": "minor"}),
            ("gpuwatch.process.threads.blocked", {}), ("gpuwatch.process.cgroup.cpu.throttled.time", {}),
            ("gpuwatch.process.cgroup.cpu.throttled.periods", {}),
            *(("gpuwatch.process.cgroup.pressure.stall.time", {"resource": r, "scope": sc})
              for r in ("cpu", "io") for sc in ("some", "full")))}
    assert len(out) == 17  # one sample each
    assert cpu.user <= value(out, "gpuwatch.process.cpu.time", mode="user") <= cpu2.user
    assert cpu.system <= value(out, "gpuwatch.process.cpu.time", mode="system") <= cpu2.system
    assert ctx.voluntary <= value(out, "gpuwatch.process.context_switches", type="voluntary") <= ctx2.voluntary
    assert ctx.involuntary <= value(out, "gpuwatch.process.context_switches", type="involuntary") <= ctx2.involuntary
    assert io.read_bytes <= value(out, "gpuwatch.process.disk.io", direction="read") <= io2.read_bytes
    assert io.write_bytes <= value(out, "gpuwatch.process.disk.io", direction="write") <= io2.write_bytes
    assert value(out, "gpuwatch.process.memory.rss") > 1 << 20
    # /proc/PID/io refused (another user's process without root): no I/O series, said once
    monkeypatch.setattr(psutil.Process, "io_counters", lambda self: (_ for _ in ()).throw(psutil.AccessDenied()))
    with caplog.at_level(logging.WARNING, logger=host.__name__):
        for _ in range(2):
            out = probe.collect()
            assert not by(out, "gpuwatch.process.disk.io") and by(out, "gpuwatch.process.cpu.time")
    assert [r.getMessage() for r in caplog.records] == [
        "cannot read the I/O counters of GPU processes (/proc/PID/io needs root or the same user): "
        "gpuwatch_process_disk_io_bytes_total is left out"]


def test_idle_is_a_rate_of_zero_and_a_thread_gone_mid_read_is_skipped(tree, caplog):
    probe = tree.probe()
    probe.collect()
    tree.now[0] += 1.0
    for tid in (1, 2, 3):  # listed, but ended before their stat was read
        (tree.dir / "task" / str(tree.pid + 100 + tid)).mkdir()
    tree.threads([10, 10, 10, 10, 12], states="DSSSD")
    out = probe.collect()
    assert value(out, "gpuwatch.process.cpu.utilization") == 0.0  # no tick since: idle, not unknown
    assert value(out, "gpuwatch.process.threads.blocked") == 2
    assert [s.value for s in by(out, "gpuwatch.process.thread.cpu.utilization")] == [2 / host.TICK, 0.0, 0.0]
    probe.MAX_THREADS = 7
    with caplog.at_level(logging.WARNING, logger=host.__name__):
        probe.collect()
        probe.collect()
    assert [r.getMessage() for r in caplog.records] == [
        f"process {tree.pid} has 8 threads: its threads are not read one by one (over 7)"]
    assert probe._once.said == {f"threads:{tree.pid}"}


def test_a_process_gone_mid_read_leaves_no_state(tree, monkeypatch):
    probe = tree.probe()
    probe.collect()
    assert tree.pid in probe._state
    monkeypatch.setattr(host.psutil, "Process", lambda pid: (_ for _ in ()).throw(psutil.NoSuchProcess(pid)))
    assert probe.collect() == [] and probe._state == {}
    assert tree.probe().collect() == []  # gone at its first read: nothing to forget either


def test_files_are_read_bounded_and_undecodable_bytes_do_not_stop_a_read(tree):
    tree.files("job.slice", cpu_stat="nr_periods 1\n" * 400 + V2_CPU_STAT)  # past MAX_LINE: not seen
    (tree.dir / "status").write_bytes(b"Name:\t\xff\xfe\nVmSwap:\t 3 kB\n")
    out = tree.probe().collect()
    assert not by(out, "gpuwatch.process.cgroup.cpu.throttled.time")
    assert value(out, "gpuwatch.process.memory.swap") == 3 * 1024
    assert pressure_totals("some avg10=0.00 total=x5\nfull total=7\n") == {"full": 7e-6}


@pytest.mark.parametrize("line, v2", [("0::/job:1", "job:1"), ("0::/a:b:c", "a:b:c")])
def test_a_cgroup_path_may_hold_colons(tmp_path, line, v2):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text(line + "\n")
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu\n")
    assert cgroup_dirs(7, str(proc), str(root)) == (str(root / v2), "")


def test_no_v2_on_a_host_with_cgroup_v1_only(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("2:cpu,cpuacct:/job\n0::/\n")  # no unified hierarchy mounted
    (root / "cpu,cpuacct" / "job").mkdir(parents=True)
    assert cgroup_dirs(7, str(proc), str(root)) == ("", str(root / "cpu,cpuacct" / "job"))
