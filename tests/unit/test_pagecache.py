"""Page-cache residency, the files a process maps or holds open, the node's top readers: real
files on a disk-backed file system, real child processes, the real kernel calls."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from gpuwatch.probes.process import pagecache
from gpuwatch.probes.process.identity import ProcStat
from gpuwatch.probes.process.pagecache import (PAGE, CacheStat, NodeReaders, PageCacheProbe, cachestat, file_label,
                                               large_files, mincore_resident, open_file)
from tests.conftest import ledger_held

MiB = 1 << 20
SIZE = 256 * MiB
PAGES = SIZE // PAGE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")


def _fstype(path: str) -> str:
    """The file system type of the mount that holds `path` (longest mount point prefix)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            mnt = left.split()[4]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, right.split()[0]
    return kind


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    for cand in ("/var/tmp", os.path.expanduser("~"), os.getcwd()):
        if os.path.isdir(cand) and os.access(cand, os.W_OK) and _fstype(cand) not in ("tmpfs", "ramfs", ""):
            d = os.path.join(cand, f"gpuwatch-pagecache-{os.getpid()}")
            os.makedirs(d, exist_ok=True)
            yield d
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
            os.rmdir(d)
            return
    pytest.skip("no disk-backed writable directory (/var/tmp, home, cwd are tmpfs): the page cache "
                "of a tmpfs file is the file itself")


def _write(path: str, size: int) -> str:
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for _ in range(size // MiB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


@pytest.fixture(scope="module")
def big(disk_dir):
    return _write(os.path.join(disk_dir, "big.bin"), SIZE)


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: str, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read is cached
        off = 0
        while off < length and (n := len(os.pread(fd, min(8 * MiB, length - off), off))):
            off += n
    finally:
        os.close(fd)


def _resident(path: str) -> tuple[int, CacheStat | None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mincore_resident(fd, os.fstat(fd).st_size), cachestat(fd)
    finally:
        os.close(fd)



def _child(code: str, *args: str) -> subprocess.Popen:
    """A Python child running `code`; returns once it printed "ready"."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", line
    return p


def _stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


MAPPER = "import mmap,sys\nf=open(sys.argv[1],'rb')\nm=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\nf.close()\n" \
         "print('ready',flush=True)\n__import__('time').sleep(600)\n"
HOLDER = "import sys,time\nfs=[open(p,'rb') for p in sys.argv[1:]]\nprint('ready',flush=True)\ntime.sleep(600)\n"


def test_residency_read_dropped_half(big):
    _read(big, SIZE)
    pages, cs = _resident(big)
    assert pages >= PAGES - 16
    if cs is not None:
        assert abs(cs.cache - pages) <= 4 and cs.cache <= PAGES
    _drop(big)
    pages, cs = _resident(big)
    assert pages <= 16
    if cs is not None:
        assert cs.cache <= 16
    _read(big, SIZE // 2)
    pages, cs = _resident(big)
    # Under memory pressure (CI beside other jobs) reclaim may take a few hundred pages back at
    # once; cachestat counts them as evicted, and they are the only slack given.
    reclaimed = cs.evicted if cs is not None else 0
    assert PAGES // 2 - 16 - reclaimed <= pages <= PAGES // 2 + 2 * MiB // PAGE
    if cs is not None:
        assert abs(cs.cache - pages) <= 4


def test_cachestat_range(big):
    _drop(big)
    _read(big, SIZE // 2)
    fd = os.open(big, os.O_RDONLY)
    try:
        first = cachestat(fd, 0, SIZE // 2)
        second = cachestat(fd, SIZE // 2, SIZE // 2)
    finally:
        os.close(fd)
    if first is None:
        pytest.skip(f"cachestat(2) not in kernel {os.uname().release}")
    # pages reclaim took back under memory pressure are counted as evicted: the only slack given
    assert first.cache + first.evicted >= PAGES // 2 - 16 and second.cache <= 2 * MiB // PAGE


def test_cachestat_enosys_is_none_and_probe_falls_back(big, monkeypatch):
    # A syscall number no kernel has: the real ENOSYS path, as on a kernel before 6.5.
    monkeypatch.setattr(pagecache, "_SYSCALL_NR", 2000)
    fd = os.open(big, os.O_RDONLY)
    try:
        assert cachestat(fd) is None
    finally:
        os.close(fd)
    _read(big, SIZE)
    p = _child(HOLDER, big)
    try:
        probe = PageCacheProbe(lambda: {p.pid: "holder"}, 64 * MiB)
        got = {s.metric: s.value for s in probe.collect() if s.labels.get("pid") == str(p.pid)}
    finally:
        _stop(p)
    assert got["gpuwatch.process.file.size"] == SIZE
    assert got["gpuwatch.process.file.cache.resident"] >= SIZE - 16 * PAGE
    assert "gpuwatch.process.file.cache.evicted" not in got  # mincore knows nothing of evictions


def _memory_cgroup(limit: int) -> tuple[str, str] | None:
    """A fresh memory cgroup limited to `limit` bytes: (its directory, its cgroup.procs); None if none can be made."""
    for root, knob in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue  # not a cgroup file system (a tmpfs holding v1 hierarchies, say)
        d = os.path.join(root, f"gpuwatch-test-{os.getpid()}")
        try:
            os.mkdir(d)
        except OSError:
            continue
        try:
            with open(os.path.join(d, knob), "r+") as f:  # r+: the kernel made it, or it is not there
                f.write(str(limit))
            return d, os.path.join(d, "cgroup.procs")
        except OSError:
            os.rmdir(d)
    return None


def test_cachestat_counts_reclaim_evictions(big):
    # fadvise DONTNEED leaves no shadow entries; reclaim does. A reader in a 48 MiB memory cgroup
    # makes the kernel reclaim the file's pages as it reads them.
    fd = os.open(big, os.O_RDONLY)
    try:
        if cachestat(fd) is None:
            pytest.skip(f"cachestat(2) not in kernel {os.uname().release}")
        _drop(big)
        before = cachestat(fd)
        cg = _memory_cgroup(48 * MiB)
        if cg is None:
            pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
        try:
            code = ("import os,sys\nopen(sys.argv[2],'w').write(str(os.getpid()))\n"
                    "f=open(sys.argv[1],'rb',buffering=0)\nwhile f.read(1<<20): pass\n")
            subprocess.run([sys.executable, "-c", code, big, cg[1]], check=True, timeout=120)
        finally:
            os.rmdir(cg[0])
        after = cachestat(fd)
    finally:
        os.close(fd)
    assert before is not None and after is not None
    assert after.evicted > before.evicted + PAGES // 4  # most of the 256 MiB did not fit in 48 MiB


def test_large_files_mapped_open_small_and_once(big, disk_dir):
    small = _write(os.path.join(disk_dir, "small.bin"), 4 * MiB)
    mapper = _child(MAPPER, big)
    holder = _child(HOLDER, big, small, big)  # the big file open twice: listed once
    try:
        for p in (mapper, holder):
            files = large_files(p.pid, 64 * MiB)
            assert [(f.path, f.size) for f in files] == [(big, SIZE)]
        key = (os.stat(big).st_dev, os.stat(big).st_ino)
        assert (files[0].st_dev, files[0].st_ino) == key
        mine = [f.path for f in large_files(holder.pid, 1 * MiB) if f.path.startswith(disk_dir)]
        assert mine == [big, small]  # largest first (the interpreter and libc are mapped too)
        assert len(large_files(holder.pid, 1 * MiB, limit=1)) == 1
        fd = open_file(files[0])
        os.close(fd)
    finally:
        _stop(mapper)
        _stop(holder)
        os.unlink(small)
    assert large_files(holder.pid, 1) == []  # gone: nothing, no error


def test_large_files_skips_fifos_and_devices(disk_dir):
    fifo = os.path.join(disk_dir, "fifo")
    os.mkfifo(fifo)
    code = "import os,sys\nfd=os.open(sys.argv[1],os.O_RDWR)\nz=open('/dev/zero','rb')\nprint('ready',flush=True)\n" \
           "__import__('time').sleep(600)\n"
    p = _child(code, fifo)
    try:
        files = large_files(p.pid, 0)
        assert files and all(os.path.isfile(f.path) for f in files)  # the interpreter's own mapped files
        assert not any(f.path in (fifo, "/dev/zero") for f in large_files(p.pid, 0))
    finally:
        _stop(p)
        os.unlink(fifo)


def test_deleted_but_open_file_is_measured(disk_dir):
    path = _write(os.path.join(disk_dir, "deleted.bin"), 96 * MiB)
    _read(path, 96 * MiB)
    p = _child(HOLDER, path)
    os.unlink(path)
    try:
        files = large_files(p.pid, 64 * MiB)
        assert [(f.path, f.size) for f in files] == [(path + " (deleted)", 96 * MiB)]
        probe = PageCacheProbe(lambda: {p.pid: "holder"}, 64 * MiB)
        got = {s.metric: s for s in probe.collect() if s.labels.get("pid") == str(p.pid)}
    finally:
        _stop(p)
    assert got["gpuwatch.process.file.size"].value == 96 * MiB
    assert got["gpuwatch.process.file.cache.resident"].value >= 96 * MiB - 16 * PAGE
    assert got["gpuwatch.process.file.size"].labels["file"] == path + " (deleted)"


READER = ("import os,sys\nfd=os.open(sys.argv[1],os.O_RDONLY)\nprint('ready',flush=True)\n"
          "while True:\n os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)\n off=0\n"
          " while (n:=len(os.pread(fd,1<<20,off))): off+=n\n")


def test_node_readers_top_reader(big):
    readers = NodeReaders()
    p = _child(READER, big)
    try:
        assert readers.sample() == []  # every pid is new: no rate yet
        time.sleep(1.0)
        top = readers.sample()
    finally:
        _stop(p)
    mine = [r for r in top if r.pid == p.pid]
    assert len(top) <= 5 and mine, top
    assert 1 * MiB < mine[0].rate < 100 * (1 << 30)  # storage speed, not garbage
    assert mine[0].comm.startswith("python")
    assert [r.rate for r in top] == sorted((r.rate for r in top), reverse=True)


def test_probe_end_to_end_and_exit_midway(big, caplog):
    _read(big, SIZE)
    p = _child(MAPPER, big)
    probe = PageCacheProbe(lambda: {p.pid: "reader"}, 64 * MiB)
    assert probe.name == "pagecache" and probe.interval == 10.0
    with caplog.at_level(logging.WARNING):
        try:
            samples = [s for s in probe.collect() if s.labels.get("pid") == str(p.pid)]
        finally:
            _stop(p)
        assert {s.metric for s in samples} >= {"gpuwatch.process.file.size", "gpuwatch.process.file.cache.resident"}
        for s in samples:
            assert s.labels == {"pid": str(p.pid), "process": "reader", "file": big}
        by = {s.metric: s.value for s in samples}
        assert by["gpuwatch.process.file.size"] == SIZE
        # what reclaim took back under memory pressure (cachestat's evicted) is the only slack
        assert (by["gpuwatch.process.file.cache.resident"] + by.get("gpuwatch.process.file.cache.evicted", 0.0)
                >= SIZE - 16 * PAGE)
        fd = os.open(big, os.O_RDONLY)
        has_cachestat = cachestat(fd) is not None
        os.close(fd)
        assert ("gpuwatch.process.file.cache.evicted" in by) == has_cachestat
        # The process exited after its files were listed (the list is kept 60 s): dropped quietly.
        after = probe.collect()
    assert not [s for s in after if s.labels.get("pid") == str(p.pid) and s.metric.startswith("gpuwatch.process.")]
    assert not [r for r in caplog.records if r.name == pagecache.__name__]


def test_file_label_bounded_and_clean():
    assert file_label("/a\nb\x1b[31m") == "/a?b?[31m"
    assert len(file_label("/" + "x" * 1000)) == 256


def test_mincore_windows_and_deadline(big, monkeypatch):
    _drop(big)
    _read(big, SIZE // 2 + 3 * MiB)  # ends inside the third 64 MiB window
    fd = os.open(big, os.O_RDONLY)
    try:
        whole = mincore_resident(fd, SIZE)
        monkeypatch.setattr(pagecache, "_WINDOW", 64 * MiB)  # four windows, one vector
        assert mincore_resident(fd, SIZE) == whole
        assert abs(whole - (SIZE // 2 + 3 * MiB) // PAGE) <= 2 * MiB // PAGE
        with pytest.raises(TimeoutError):
            mincore_resident(fd, SIZE, deadline=time.monotonic() - 1)
    finally:
        os.close(fd)


# ---- the node's top readers, exactly: a fake /proc listing, stat and io, and a fake monotonic clock -----

class Node:
    """What NodeReaders reads of the node: /proc's entries, each pid's stat (start time, comm) and
    /proc/PID/io read_bytes, and the clock (still unless a pid's read moves it: `slow`)."""

    def __init__(self, monkeypatch):
        self.procs: dict[int, list] = {}  # pid -> [start time, comm, read_bytes or None]
        self.now, self.slow = 1000.0, {}  # pid -> seconds its read takes
        monkeypatch.setattr(pagecache, "os", SimpleNamespace(scandir=self._scandir))
        monkeypatch.setattr(pagecache, "read_stat", self._stat)
        monkeypatch.setattr(pagecache, "_read_bytes", self._read_bytes)
        monkeypatch.setattr(pagecache, "time", SimpleNamespace(monotonic=lambda: self.now, time=lambda: 1.7e9))

    def _scandir(self, path):
        assert path == "/proc"
        return [SimpleNamespace(name=n) for n in ("self", *map(str, self.procs), "sys", "thread-self")]

    def _stat(self, pid, proc="/proc"):
        p = self.procs.get(pid)
        return None if p is None or p[0] is None else ProcStat(p[1], "S", 0, p[0])

    def _read_bytes(self, pid):
        self.now += self.slow.get(pid, 0.0)
        p = self.procs.get(pid)
        return None if p is None else p[2]

    def read(self, **by_pid):
        for pid, n in by_pid.items():
            self.procs[int(pid[1:])][2] += n


def rates(readers):
    return [(r.pid, r.comm, r.rate) for r in readers.sample()]


def test_node_readers_sort_and_cut_with_more_readers_than_the_cut(monkeypatch):
    node = Node(monkeypatch)
    node.procs = {pid: [pid * 10, f"job {pid}", 1000] for pid in range(101, 109)}
    node.procs[109] = [1090, "no io", None]  # /proc/PID/io unreadable: not a reader
    node.procs[110] = [None, "no stat", 0]  # exited between the listing and its stat
    readers = NodeReaders()
    assert rates(readers) == []  # every pid is new: no rate yet
    node.now += 2.0
    node.read(p101=10, p102=70, p103=30, p104=0, p105=50, p106=90, p107=20, p108=60)
    assert rates(readers) == [(106, "job_106", 45.0), (102, "job_102", 35.0), (108, "job_108", 30.0),
                              (105, "job_105", 25.0), (103, "job_103", 15.0)]  # five of seven, busiest first
    node.now += 4.0
    node.read(p101=2, p103=1)
    node.procs[102][2] -= 500  # read_bytes went down (another process's counter): no rate
    readers.top = 10
    assert rates(readers) == [(101, "job_101", 0.5), (103, "job_103", 0.25)]  # below one byte a second too
    node.now += 1.0
    node.read(p102=100)
    assert rates(readers) == [(102, "job_102", 100.0)]  # from where it went down to


def test_node_readers_no_rate_across_a_reused_pid(monkeypatch):
    node = Node(monkeypatch)
    node.procs = {201: [50, "old", 1 << 30], 202: [60, "other", 0]}
    readers = NodeReaders()
    rates(readers)
    node.now += 1.0
    node.procs[201] = [70, "new", 1 << 20]  # the pid names another process, which has read less so far
    node.read(p202=8)
    assert rates(readers) == [(202, "other", 8.0)]
    node.procs[201] = [70, "new", 3 << 20]
    node.now += 2.0
    node.read(p202=8)
    assert rates(readers) == [(201, "new", float(1 << 20)), (202, "other", 4.0)]  # from its own first read
    node.procs[201] = [71, "newer", 1 << 40]  # reused again, and far ahead: still no rate
    node.now += 1.0
    assert rates(readers) == []


def test_node_readers_pass_budget_and_bound_keep_what_was_not_reached(monkeypatch):
    node = Node(monkeypatch)
    node.procs = {pid: [pid, "r", 0] for pid in (301, 302, 303, 304)}
    readers = NodeReaders(budget_s=0.5)
    rates(readers)
    assert sorted(readers._last) == [301, 302, 303, 304]
    node.slow = {302: 0.5, 303: 0.25}  # the pass is at its budget after 302 (303 still read), past it after 303
    node.now += 1.0
    node.read(p301=100, p302=100, p303=100, p304=100)
    assert rates(readers) == [(301, "r", 100.0), (302, "r", 100 / 1.5), (303, "r", 100 / 1.75)]
    assert readers._last[304] == (304, 0, 1000.0)  # not reached: kept as it was
    node.slow = {}
    node.now += 1.0
    assert rates(readers) == [(304, "r", 100 / 2.75)]
    readers.max_procs = 3  # as many entries as the bound: a complete pass, which forgets what exited
    del node.procs[304]
    rates(readers)
    assert sorted(readers._last) == [301, 302, 303]
    node.procs[305] = [305, "r", 0]
    rates(readers)
    assert sorted(readers._last) == [301, 302, 303]  # 305 not reached; nothing gone to keep
    readers.max_procs = 1  # incomplete: what was not reached is kept, up to twice the bound in all
    rates(readers)
    assert sorted(readers._last) == [301, 302]


def test_node_readers_as_samples(monkeypatch):
    node = Node(monkeypatch)
    node.procs = {401: [1, "loader", 0]}
    probe = PageCacheProbe(lambda: {}, 64 * MiB)
    assert probe.collect() == []
    node.now += 2.0
    node.read(p401=6)
    assert probe.collect() == [pagecache.Sample("gpuwatch.node.process.disk.read.rate", 3.0, "",
                                                {"pid": "401", "process": "loader"}, 1.7e9)]


def test_read_bytes_of_a_real_process():
    p = _child("print('ready',flush=True)\n__import__('time').sleep(600)\n")
    try:
        with open(f"/proc/{p.pid}/io") as f:
            want = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
        assert pagecache._read_bytes(p.pid) == want
    finally:
        _stop(p)
    assert pagecache._read_bytes(p.pid) is None  # reaped: no such file


# ---- PageCacheProbe's own logic, exactly: listing, relisting, the budget, its samples and what it says ------

def _file(name, size):
    return pagecache.OpenFile(f"/data/{name}", size, 1, hash(name) & 0xffff, f"/proc/0/fd/{name}")


class Listing:
    """Two real pids (the ledger reads their users) whose stat start times, large files and residency are fakes."""

    def __init__(self, monkeypatch):
        self.a, self.b = os.getpid(), os.getppid()
        self.start = {self.a: 10, self.b: 20}
        self.files = {self.a: [_file("a1", 100 * MiB), _file("a2", 80 * MiB)], self.b: [_file("b1", 90 * MiB)]}
        self.listed: list[int] = []
        self.deadlines: list[float] = []
        self.now, self.tick = 50.0, {}  # file name -> seconds its residency takes
        self.resident = {}  # file name -> (resident, evicted, size) or None
        monkeypatch.setattr(pagecache, "read_stat", lambda pid, proc="/proc": ProcStat(
            "x", "Z" if self.start.get(pid) is None else "S", 0, self.start.get(pid) or 0))
        monkeypatch.setattr(pagecache, "large_files", self._large_files)
        monkeypatch.setattr(pagecache, "time", SimpleNamespace(monotonic=lambda: self.now, time=lambda: 1.7e9))

    def _large_files(self, pid, min_bytes, limit):
        assert (min_bytes, limit) == (64 * MiB, PageCacheProbe.MAX_FILES)
        self.listed.append(pid)
        if isinstance(self.files[pid], Exception):
            raise self.files[pid]
        return list(self.files[pid])

    def probe(self, procs=None):
        probe = PageCacheProbe(lambda: dict(procs or {self.a: "trainer", self.b: "loader"}), 64 * MiB)
        probe.readers.sample = lambda: []

        def residency(f, deadline):
            self.deadlines.append(deadline)
            self.now += self.tick.get(f.path, 0.0)
            return self.resident.get(f.path, (f.size // 2, None, f.size))
        probe._residency = residency
        return probe


def test_probe_samples_exactly(monkeypatch):
    ls = Listing(monkeypatch)
    ls.resident = {"/data/a1": None,  # gone since listed
                   "/data/a2": (60 * MiB, 5 * MiB, 80 * MiB),
                   "/data/b1": (95 * MiB, None, 90 * MiB)}  # more than the file (it shrank): at most its size
    out = ls.probe().collect()
    a, b = {"pid": str(ls.a), "process": "trainer"}, {"pid": str(ls.b), "process": "loader"}
    want = [("gpuwatch.process.file.size", 80 * MiB, dict(a, file="/data/a2")),
            ("gpuwatch.process.file.cache.resident", 60 * MiB, dict(a, file="/data/a2")),
            ("gpuwatch.process.file.cache.evicted", 5 * MiB, dict(a, file="/data/a2")),
            ("gpuwatch.process.file.size", 90 * MiB, dict(b, file="/data/b1")),
            ("gpuwatch.process.file.cache.resident", 90 * MiB, dict(b, file="/data/b1"))]
    if ls.b < ls.a:  # pids in order
        want = want[3:] + want[:3]
    assert out == [pagecache.Sample(m, float(v), "", labels, 1.7e9) for m, v, labels in want]
    assert ls.deadlines == [50.0 + PageCacheProbe.BUDGET_S] * 3  # the collection's start and its budget


def test_probe_lists_a_process_once_a_minute_and_afresh_when_its_pid_is_reused(monkeypatch):
    ls = Listing(monkeypatch)
    probe = ls.probe({ls.a: "trainer"})
    probe.collect()
    ls.now += PageCacheProbe.RELIST_S - 1
    probe.collect()
    assert ls.listed == [ls.a] and ledger_held(probe._followed, ls.a) == 2
    ls.now += 1  # a minute since it was listed
    probe.collect()
    assert ls.listed == [ls.a] * 2
    ls.start[ls.a] = 11  # another process under the pid: listed again now
    ls.files[ls.a] = [_file("new", 70 * MiB)]
    out = probe.collect()
    assert ls.listed == [ls.a] * 3 and ledger_held(probe._followed, ls.a) == 1
    assert {s.labels["file"] for s in out} == {"/data/new"}
    ls.start[ls.a] = None  # exited (a zombie): nothing, and nothing held
    assert probe.collect() == [] and ledger_held(probe._followed, ls.a) == 0 and probe._files == {}


def test_probe_forgets_processes_no_longer_given_and_charges_the_files_budget(monkeypatch):
    ls = Listing(monkeypatch)
    ls.start[ls.b] = None  # a zombie when first seen: nothing listed, nothing to forget
    assert {s.labels["pid"] for s in ls.probe().collect()} == {str(ls.a)} and ls.listed == [ls.a]
    ls.start[ls.b] = 20
    given = {ls.a: "trainer", ls.b: "loader"}
    probe = ls.probe(given)
    probe.collect()
    assert (ledger_held(probe._followed, ls.a), ledger_held(probe._followed, ls.b)) == (2, 1)
    del given[ls.b]
    probe.collect()
    assert set(probe._files) == {ls.a} and ledger_held(probe._followed, ls.b) == 0 and ledger_held(probe._followed, ls.a) == 2
    probe.MAX_PROCESSES = 0
    assert probe.collect() == [] and probe._files == {} and ledger_held(probe._followed, ls.a) == 0


def test_probe_says_once_what_it_cannot_do(monkeypatch, caplog):
    ls = Listing(monkeypatch)
    ls.files[ls.a] = PermissionError(1, "Operation not permitted")
    calls = [0]

    def processes():
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("no snapshot yet")
        return {ls.a: "trainer", ls.b: "loader"}
    probe = ls.probe()
    probe.processes = processes
    probe.readers.sample = lambda: [pagecache.Reader(7, "dd", 2.0)]
    with caplog.at_level(logging.INFO, logger=pagecache.__name__):
        out = probe.collect()
        assert {s.labels["pid"] for s in out} == {str(ls.b), "7"}  # a's files cannot be checked: none shown
        for _ in range(2):
            assert [s.labels["pid"] for s in probe.collect()] == ["7"]  # no processes: the readers still
    assert [r.getMessage() for r in caplog.records] == [
        "page cache: no file is shown: cannot check what a process's user may read: [Errno 1] Operation not "
        "permitted (said once)", "page cache: no list of GPU processes: no snapshot yet (said once)"]


def test_probe_stops_at_its_budget_and_says_so_once(monkeypatch, caplog):
    ls = Listing(monkeypatch)
    probe = ls.probe({ls.a: "trainer"})
    probe.readers.sample = lambda: [pagecache.Reader(7, "dd", 2.0)]
    ls.tick = {"/data/a1": PageCacheProbe.BUDGET_S}  # exactly the budget: a2 is still measured
    with caplog.at_level(logging.WARNING, logger=pagecache.__name__):
        out = probe.collect()
        assert [(s.metric, s.labels.get("file")) for s in out][-2:] == [
            ("gpuwatch.process.file.cache.resident", "/data/a2"), ("gpuwatch.node.process.disk.read.rate", None)]
        ls.tick = {"/data/a1": PageCacheProbe.BUDGET_S + 0.5}  # past it: a2 waits for the next collection
        for _ in range(2):
            out = probe.collect()
            assert [s.labels.get("file") for s in out] == ["/data/a1", "/data/a1", None]
            assert out[-1] == pagecache.Sample("gpuwatch.node.process.disk.read.rate", 2.0, "",
                                               {"pid": "7", "process": "dd"}, 1.7e9)
    assert [r.getMessage() for r in caplog.records] == [
        "page cache: a collection ran past 2.0 s; the rest waits (said once)"]


def test_residency_from_cachestat_then_mincore_and_its_failures(big, monkeypatch, caplog):
    fd = os.open(big, os.O_RDONLY)
    st = os.fstat(fd)
    os.close(fd)
    listed = pagecache.OpenFile(big, SIZE, st.st_dev, st.st_ino, big)
    probe = PageCacheProbe(dict, 64 * MiB)
    calls = []

    def fake_cachestat(fd, offset=0, length=0):
        calls.append(fd)
        return CacheStat(3, 0, 0, 2, 1) if len(calls) == 1 else None
    monkeypatch.setattr(pagecache, "cachestat", fake_cachestat)
    assert probe._residency(listed, time.monotonic() + 60) == (3 * PAGE, 2 * PAGE, SIZE)  # pages to bytes
    with caplog.at_level(logging.INFO, logger=pagecache.__name__):
        resident, evicted, size = probe._residency(listed, time.monotonic() + 60)  # ENOSYS: mincore from now on
        assert evicted is None and size == SIZE and 0 <= resident <= SIZE
        probe._residency(listed, time.monotonic() + 60)
        assert len(calls) == 2 and probe._cachestat is False
        assert probe._residency(listed, time.monotonic() - 1) is None  # mincore past the deadline
        assert probe._residency(listed, time.monotonic() - 1) is None
        moved = pagecache.OpenFile(big, SIZE, st.st_dev, st.st_ino + 1, big)  # another file at the handle now
        assert probe._residency(moved, time.monotonic() + 60) is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "cachestat(2) is not in this kernel (before Linux 6.5): page-cache residency from mincore(2)"),
        ("WARNING", f"page-cache residency of {big}: [Errno {errno.ETIMEDOUT}] mincore(2) ran past the collection's "
                    "budget (said once)")]


def test_mapped_files_handles_and_fds_opened_for_reading(big, disk_dir, monkeypatch):
    """/proc/PID/maps of a real process: one entry per mapped file (by inode), opened through map_files,
    or through the process's root without map_files (no CAP_SYS_ADMIN), "(deleted)" dropped there."""
    gone = _write(os.path.join(disk_dir, "gone.bin"), 4 * MiB)
    twice = ("import mmap,sys\nms=[]\nfor p in sys.argv[1:]:\n f=open(p,'rb')\n"
             " ms+=[mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ), mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)]\n"
             "w=open(sys.argv[1],'ab')\nq=__import__('os').open(sys.argv[1],__import__('os').O_PATH)\n"
             "print('ready',flush=True)\n__import__('time').sleep(600)\n")
    p = _child(twice, big, gone)
    os.unlink(gone)
    try:
        with open(f"/proc/{p.pid}/maps") as f:
            first = {}
            for line in f:
                if line.split()[5:] in ([big], [gone, "(deleted)"]):
                    first.setdefault(line.split()[5], line.split()[0])  # the first of its two mappings
        mine = sorted((path, h) for h, path in pagecache._mapped_files(p.pid) if path.startswith(disk_dir))
        assert mine == [(big, f"/proc/{p.pid}/map_files/{first[big]}"),
                        (gone + " (deleted)", f"/proc/{p.pid}/map_files/{first[gone]}")]
        real_exists = os.path.exists
        monkeypatch.setattr(pagecache.os.path, "exists", lambda x: "/map_files/" not in x and real_exists(x))
        assert sorted(h for h, path in pagecache._mapped_files(p.pid) if path.startswith(disk_dir)) == [
            f"/proc/{p.pid}/root{big}", f"/proc/{p.pid}/root{gone}"]
        monkeypatch.undo()
        # of its fds on big: mmap's two duplicates (read-only) are for reading; the write-only and O_PATH ones not
        assert sorted(pagecache._opened_for_reading(h) for h, path in pagecache._fd_files(p.pid) if path == big) == [
            False, False, True, True]
        with open(big, "rb") as rd, open(big, "r+b") as rw:
            assert pagecache._opened_for_reading(f"/proc/{os.getpid()}/fd/{rd.fileno()}")
            assert pagecache._opened_for_reading(f"/proc/{os.getpid()}/fd/{rw.fileno()}")
    finally:
        _stop(p)
    assert list(pagecache._mapped_files(p.pid)) == [] and list(pagecache._fd_files(p.pid)) == []


def test_cachestat_fields_and_errors(big):
    fd = os.open(big, os.O_RDONLY)
    try:
        cs = cachestat(fd)
        if tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2]) >= (6, 5):
            assert cs is not None  # the kernel has it: not the fallback
        if cs is not None:
            assert all(isinstance(getattr(cs, n), int) for n in ("cache", "dirty", "writeback", "evicted",
                                                                  "recently_evicted"))
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        cachestat(fd)  # closed
    assert (e.value.errno, e.value.strerror) == (errno.EBADF, os.strerror(errno.EBADF)) or cs is None


def test_mincore_exact_count_errors_and_an_empty_file(big, disk_dir, monkeypatch):
    _read(big, SIZE)
    fd = os.open(big, os.O_RDONLY)
    try:
        monkeypatch.setattr(pagecache, "_WINDOW", 64 * MiB)
        # 96 MiB: a full window then a shorter one, whose vector still holds the first window's bytes
        assert mincore_resident(fd, 96 * MiB) >= 96 * MiB // PAGE - 16
        assert mincore_resident(fd, 96 * MiB) <= 96 * MiB // PAGE
        assert mincore_resident(fd, 0) == 0
    finally:
        os.close(fd)
    wfd = os.open(big, os.O_WRONLY)  # a shared read mapping of a write-only fd: EACCES
    try:
        with pytest.raises(OSError) as e:
            mincore_resident(wfd, SIZE)
        assert (e.value.errno, e.value.strerror) == (errno.EACCES, os.strerror(errno.EACCES))
    finally:
        os.close(wfd)


def test_open_file_is_that_file_without_atime_or_says_not_the_file_listed(big):
    st = os.stat(big)
    fd = open_file(pagecache.OpenFile(big, SIZE, st.st_dev, st.st_ino, big))
    try:
        import fcntl
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NOATIME  # root may: reading does not touch its atime
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError) as e:
        open_file(pagecache.OpenFile(big, SIZE, st.st_dev, st.st_ino + 1, big))
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ENOENT, "not the file listed", big)


def test_fds_bounded_links_once_write_only_fds_skipped_and_the_default_limit(big, disk_dir, monkeypatch):
    small = [_write(os.path.join(disk_dir, f"s{i}.bin"), MiB) for i in range(9)]
    link = os.path.join(disk_dir, "big-link.bin")
    os.link(big, link)
    code = ("import mmap,os,sys\nw=os.open(sys.argv[1],os.O_WRONLY)\nfs=[open(p,'rb') for p in sys.argv[2:]]\n"
            "ms=[mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ) for f in fs[:2]]\n"
            "print('ready',flush=True)\n__import__('time').sleep(600)\n")
    p = _child(code, small[0], big, link, *small[1:])  # w on s0 comes first: not for reading, the rest are
    try:
        files = [f.path for f in large_files(p.pid, MiB, limit=20) if f.path.startswith(disk_dir)]
        assert sorted(files) == sorted([big] + small[1:]) or sorted(files) == sorted([link] + small[1:])
        assert len([h for h, path in pagecache._mapped_files(p.pid) if path in (big, link)]) == 1  # one inode
        assert len(large_files(p.pid, 0)) == 8  # the default limit (the interpreter maps more than that)
        assert [f.path for f in large_files(p.pid, SIZE)] in ([big], [link])  # exactly min_bytes is large
        assert pagecache._opened_for_reading(f"/proc/{p.pid}/fd/999999") is False  # no such fd
        monkeypatch.setattr(pagecache, "_MAX_FDS", 2)
        assert len(list(pagecache._fd_files(p.pid))) == 2
    finally:
        _stop(p)
        for f in (*small, link):
            os.unlink(f)


def test_node_readers_defaults():
    r = NodeReaders()
    assert (r.top, r.max_procs, r.budget_s) == (5, pagecache._MAX_PROCS, 0.5)
