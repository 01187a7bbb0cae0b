"""Page-cache residency of the large files GPU processes map or hold open, and the node's top readers.

A training job whose weights or dataset shards fall out of the page cache reads them from disk
again: the GPU waits on the host. This probe says how much of each large file is cached
(cachestat(2) on Linux 6.5+, which also counts recent evictions; else mincore(2) over a
read-only mapping, which never faults a page in), and which processes of the node read most
from storage (the ones that may be pushing those files out).

Files are opened through /proc/PID/fd/N or /proc/PID/map_files/..., so a deleted file or one
outside our mount namespace is still measured; nothing but a regular file is ever opened.

Which files: only those the process really reads or maps (an fd opened for reading, not an O_PATH
handle nor a write-only fd; a file mapping) and that its user could open by their path and read
(probes/process/access.py asks the kernel with that user's credentials). Otherwise any user could
make the root agent show the path, size and residency of a file they may not read.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from gpuwatch.agent import budget as budget_
from gpuwatch.agent.api import Probe, Sample, printable
from gpuwatch.agent.logs import WarnOnce
from gpuwatch.agent.safefile import open_regular
from gpuwatch.probes.process.access import openable_by_its_user
from gpuwatch.probes.process.identity import read_stat, sanitise_process_name

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_SYSCALL_NR = 451  # cachestat: the same number on x86_64 and aarch64 (unified table since 424)
_WINDOW = 1 << 30  # mincore maps and checks a file 1 GiB at a time: a 256 KiB vector per call
_MAX_FDS = 16384  # fds of one process looked at
_MAX_MAPS_LINES = 65536  # lines of /proc/PID/maps looked at
_MAX_PROCS = 4096  # processes of the node whose io is read per pass
_PATH_MAX = 256  # characters of a file label
_MAX_CHECKS = 64  # large files of one process whose access is checked per listing, largest first
_O_ACCMODE = 0o3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: only bit 0 means resident; the rest are reserved


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


@dataclass(frozen=True, slots=True)
class CacheStat:
    """cachestat(2)'s counts, in pages."""

    cache: int
    dirty: int
    writeback: int
    evicted: int  # evicted pages whose eviction the kernel still remembers (shadow entries)
    recently_evicted: int


def cachestat(fd: int, offset: int = 0, length: int = 0) -> CacheStat | None:
    """cachestat(2) of [offset, offset+length) of the file (length 0: to its end); None where the
    kernel has no such call (ENOSYS: before 6.5), so the caller falls back to mincore. Raises
    OSError on any other failure."""
    rng = _Range(offset, length)
    out = _CacheStat()
    rc = _libc.syscall(ctypes.c_long(_SYSCALL_NR), ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(out),
                       ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            return None
        raise OSError(err, os.strerror(err))
    return CacheStat(out.nr_cache, out.nr_dirty, out.nr_writeback, out.nr_evicted, out.nr_recently_evicted)


def mincore_resident(fd: int, size: int, deadline: float | None = None) -> int:
    """Pages of the file's first `size` bytes in the page cache: mincore(2) over a read-only shared
    mapping, 1 GiB at a time (never touched, so nothing is faulted in). Raises OSError, and
    TimeoutError once time.monotonic() passes `deadline` (about 25 ms a GiB: 1 TiB takes ~25 s)."""
    vec = ctypes.create_string_buffer(_WINDOW // PAGE)
    resident = 0
    for off in range(0, max(size, 0), _WINDOW):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(errno.ETIMEDOUT, "mincore(2) ran past the collection's budget")
        length = min(_WINDOW, size - off)
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            if _libc.mincore(addr, length, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            _libc.munmap(addr, length)
        pages = -(-length // PAGE)
        resident += vec.raw[:pages].translate(_LOW_BIT).count(1)
    return resident


@dataclass(frozen=True, slots=True)
class OpenFile:
    """A regular file a process maps or holds open."""

    path: str  # as the process names it (readlink: "... (deleted)" once unlinked)
    size: int
    st_dev: int
    st_ino: int
    handle: str  # what to open it by: /proc/PID/fd/N, /proc/PID/map_files/A-B or /proc/PID/root/PATH


def _opened_for_reading(handle: str) -> bool:
    """The fd /proc/PID/fd/N was opened O_RDONLY or O_RDWR, not O_PATH (a handle that reads nothing,
    which anyone may hold on a file they cannot read), by its flags in /proc/PID/fdinfo/N."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(handle.replace("/fd/", "/fdinfo/", 1), "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"flags:"):
                    flags = int(line.split()[1], 8)
                    return not flags & os.O_PATH and flags & _O_ACCMODE in (os.O_RDONLY, os.O_RDWR)
    return False


def _fd_files(pid: int) -> Iterable[tuple[str, str]]:
    """(handle, path) of the process's open fds."""
    base = f"/proc/{pid}/fd"
    try:
        with os.scandir(base) as it:
            for i, entry in enumerate(it):
                if i >= _MAX_FDS:
                    break
                handle = f"{base}/{entry.name}"
                try:
                    yield handle, os.readlink(handle)
                except OSError:  # closed meanwhile
                    continue
    except OSError:
        return


def _mapped_files(pid: int) -> Iterable[tuple[str, str]]:
    """(handle, path) of the files the process maps, one per file (by inode), map_files first."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.readlines()[:_MAX_MAPS_LINES]
    except OSError:
        return
    seen: set[tuple[bytes, bytes]] = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[4] == b"0" or not parts[5].startswith(b"/"):
            continue  # anonymous, [heap], [stack], ...
        key = (parts[3], parts[4])
        if key in seen:
            continue
        seen.add(key)
        path = os.fsdecode(parts[5].rstrip(b"\n"))  # the exact bytes: the path is opened to check access
        handle = f"/proc/{pid}/map_files/{parts[0].decode(errors='replace')}"
        if not os.path.exists(handle):  # no map_files access (needs CAP_SYS_ADMIN): the path in its root
            handle = f"/proc/{pid}/root{path.removesuffix(' (deleted)')}"
        yield handle, path


def large_files(pid: int, min_bytes: int, limit: int = 8) -> list[OpenFile]:
    """The largest regular files (at least min_bytes) process `pid` maps or holds open for reading
    and that its user could open by their path and read, one per (device, inode), largest first, at
    most `limit` (of the largest _MAX_CHECKS). [] when the process is gone or unreadable. Raises
    PermissionError when the user's credentials cannot be taken to check (no CAP_SETUID, CAP_SETGID)."""
    found: dict[tuple[int, int], OpenFile] = {}
    for handle, path in (*_fd_files(pid), *_mapped_files(pid)):
        try:
            st = os.stat(handle)  # follows the magic link to the file itself, deleted or not
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size < min_bytes or (st.st_dev, st.st_ino) in found:
            continue
        if handle.startswith(f"/proc/{pid}/fd/") and not _opened_for_reading(handle):
            continue
        found[(st.st_dev, st.st_ino)] = OpenFile(path, st.st_size, st.st_dev, st.st_ino, handle)
    ranked = sorted(found.values(), key=lambda f: (-f.size, f.path))
    return openable_by_its_user(pid, ranked, limit, _MAX_CHECKS)


def open_file(f: OpenFile) -> int:
    """An O_RDONLY fd on that very file (same device and inode, a regular file); raises OSError.
    The process may have put anything at the handle since it was listed (a pty in place of the fd:
    see safefile.open_regular, which opens nothing else). O_NOATIME where allowed."""
    fd = open_regular(f.handle, noatime=True)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (f.st_dev, f.st_ino):
            raise FileNotFoundError(errno.ENOENT, "not the file listed", f.handle)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True, slots=True)
class Reader:
    pid: int
    comm: str
    rate: float  # bytes read from storage per second since the last sample


class NodeReaders:
    """The processes of the node reading most from storage (/proc/PID/io read_bytes), between two
    calls of sample(). A pid seen first, or reused by another process, has no rate yet."""

    def __init__(self, top: int = 5, max_procs: int = _MAX_PROCS, budget_s: float = 0.5) -> None:
        self.top, self.max_procs, self.budget_s = top, max_procs, budget_s
        self._last: dict[int, tuple[int, int, float]] = {}  # pid -> (start time, read_bytes, monotonic)

    def sample(self) -> list[Reader]:
        end = time.monotonic() + self.budget_s
        now: dict[int, tuple[int, int, float]] = {}
        out: list[Reader] = []
        try:
            entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
        except OSError:
            return []
        complete = len(entries) <= self.max_procs
        for name in entries[:self.max_procs]:
            if time.monotonic() > end:
                complete = False
                break
            pid = int(name)
            st = read_stat(pid)
            rb = _read_bytes(pid)
            if st is None or rb is None:
                continue
            t = time.monotonic()
            now[pid] = (st.start_time, rb, t)
            prev = self._last.get(pid)
            if prev is None or prev[0] != st.start_time or t <= prev[2] or rb < prev[1]:
                continue
            rate = (rb - prev[1]) / (t - prev[2])
            if rate > 0:
                out.append(Reader(pid, sanitise_process_name(st.comm), rate))
        if not complete:  # keep what this pass did not reach, bounded
            for pid, v in self._last.items():
                if len(now) >= 2 * self.max_procs:
                    break
                now.setdefault(pid, v)
        self._last = now
        out.sort(key=lambda r: -r.rate)
        return out[:self.top]


def _read_bytes(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"read_bytes:"):
                    v = int(line.split()[1])
                    return v if v >= 0 else None
    return None


def file_label(path: str) -> str:
    """A path as a label: what is not printable (C0 and C1 controls, bidi controls, undecodable
    bytes) becomes "?", at most 256 characters."""
    return printable(path[:_PATH_MAX])


class PageCacheProbe(Probe):
    """Per GPU process and large file: size, bytes in the page cache, bytes recently evicted
    (cachestat only); per node: the top readers from storage."""

    name = "pagecache"
    deadline = 5.0
    RELIST_S = 60.0  # the files a process has open change rarely: list them once a minute
    MAX_PROCESSES = 16
    MAX_FILES = 8
    BUDGET_S = 2.0  # per collection; what is left waits for the next one

    def __init__(self, processes: Callable[[], Mapping[int, str]], min_bytes: int, interval: float = 10.0,
                 budgets: budget_.Budgets | None = None) -> None:
        self.processes, self.min_bytes, self.interval = processes, min_bytes, interval
        # files followed, charged to each process's user ("files": per user and node-wide)
        self._followed = budget_.Ledger((budgets or budget_.Budgets())["files"])
        self.readers = NodeReaders()
        self._files: dict[int, tuple[int, float, list[OpenFile]]] = {}  # pid -> (start time, listed at, files)
        self._cachestat = True  # until the kernel says ENOSYS
        self._once = WarnOnce(log)  # each failing read said once

    def _files_of(self, pid: int, now: float) -> list[OpenFile]:
        st = read_stat(pid)
        if st is None or st.exited:
            self._files.pop(pid, None)
            self._followed.release(pid)
            return []
        cached = self._files.get(pid)
        if cached and cached[0] == st.start_time and now - cached[1] < self.RELIST_S:
            return cached[2]
        self._followed.release(pid)
        try:
            files = large_files(pid, self.min_bytes, self.MAX_FILES)
        except PermissionError as e:  # no CAP_SETUID/CAP_SETGID: what its user may read cannot be checked
            self._once("access", "page cache: no file is shown: cannot check what a process's user may read: %s "
                       "(said once)", e)
            files = []
        files = [f for f in files if self._followed.charge(pid)]
        self._files[pid] = (st.start_time, now, files)
        return files

    def _residency(self, f: OpenFile, deadline: float) -> tuple[int, int | None, int] | None:
        """(resident bytes, evicted bytes or None, size now) of the file; None when it is gone."""
        try:
            fd = open_file(f)
        except OSError:
            return None  # closed, unmapped or replaced since it was listed: dropped quietly
        try:
            size = os.fstat(fd).st_size
            if self._cachestat:
                cs = cachestat(fd)
                if cs is not None:
                    return cs.cache * PAGE, cs.evicted * PAGE, size
                self._cachestat = False
                log.info("cachestat(2) is not in this kernel (before Linux 6.5): page-cache residency from mincore(2)")
            return mincore_resident(fd, size, deadline) * PAGE, None, size
        except OSError as e:
            self._once(f"residency:{e.errno}", "page-cache residency of %s: %s (said once)", file_label(f.path), e)
            return None
        finally:
            os.close(fd)

    def collect(self) -> list[Sample]:
        start = time.monotonic()
        ts = time.time()
        out: list[Sample] = []
        try:
            procs = dict(self.processes())
        except Exception as e:  # the daemon's view of GPU processes: never fatal here
            self._once("processes", "page cache: no list of GPU processes: %s (said once)", e)
            procs = {}
        pids = sorted(procs)[:self.MAX_PROCESSES]
        for pid in list(self._files):
            if pid not in pids:
                del self._files[pid]
                self._followed.release(pid)
        for pid in pids:
            labels = {"pid": str(pid), "process": procs[pid]}
            for f in self._files_of(pid, start):
                if time.monotonic() - start > self.BUDGET_S:
                    self._once("budget", "page cache: a collection ran past %.1f s; the rest waits (said once)",
                               self.BUDGET_S)
                    return out + self._readers(ts)
                r = self._residency(f, start + self.BUDGET_S)
                if r is None:
                    continue
                resident, evicted, size = r
                fl = {**labels, "file": file_label(f.path)}
                out.append(Sample("gpuwatch.process.file.size", float(size), labels=fl, ts=ts))
                out.append(Sample("gpuwatch.process.file.cache.resident", float(min(resident, size)), labels=fl, ts=ts))
                if evicted is not None:
                    out.append(Sample("gpuwatch.process.file.cache.evicted", float(evicted), labels=fl, ts=ts))
        return out + self._readers(ts)

    def _readers(self, ts: float) -> list[Sample]:
        return [Sample("gpuwatch.node.process.disk.read.rate", r.rate,
                       labels={"pid": str(r.pid), "process": r.comm}, ts=ts) for r in self.readers.sample()]
