"""Could a process's user open this file? Asked of the kernel, with that user's credentials.

The agent runs as root and reads other users' processes; what it shows about a file they hold
(its path, size, page-cache residency) must not tell anyone more than that user could learn
alone. So a file is shown only when the process's user could open it by the path the process
names it: every directory on the way searchable, the file readable, under that user's real uid,
real gid and supplementary groups. The kernel decides (mode bits, POSIX ACLs, LSMs), not a
re-implementation of its rules here.

The check runs in a short-lived thread of its own that takes those credentials with raw
setgroups/setfsgid/setfsuid and then drops every effective capability (capset): the kernel keeps
credentials per thread, and these calls change only the calling thread (glibc's setgroups would
change every thread of the agent, the raw syscall does not). Without CAP_SYS_PTRACE a symlink the
user planted cannot jump through another user's /proc/PID/cwd or /proc/PID/fd into a directory
that user could not search; without CAP_DAC_READ_SEARCH no permission is bypassed. What needs the
agent's own rights — /proc/PID/root, and /proc/PID/fd/N or /proc/PID/map_files/... of a deleted
file — is opened O_PATH beforehand by the calling thread and handed over as fds. The thread ends
with the check, and its credentials with it.

Nothing but a regular file is ever opened for reading: the path is opened O_PATH (no open of a
device, FIFO or pty happens), fstat must show the very file listed, and only then is that inode
reopened O_RDONLY|O_NONBLOCK|O_NOCTTY through our own /proc/self/fd, so no path is walked twice.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.setfsuid.argtypes = (ctypes.c_uint,)
_libc.setfsgid.argtypes = (ctypes.c_uint,)
_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine())  # the raw syscall: this thread only
_NO_ID = 0xFFFFFFFF  # (uid_t)-1: setfs[ug]id changes nothing and returns the current id
_CAP_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words of each set


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_MAX_STATUS = 1 << 20  # /proc/PID/status with 65,536 groups is under 500 KiB
_MAX_GROUPS = 65536  # NGROUPS_MAX


@dataclass(frozen=True, slots=True)
class Credentials:
    """Who a process runs as, for deciding what it may open: the user who runs it."""

    uid: int  # real
    gid: int  # real
    groups: tuple[int, ...]  # supplementary


def credentials(pid: int) -> Credentials | None:
    """The process's real uid, real gid and supplementary groups (/proc/PID/status); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read(_MAX_STATUS)
    except OSError:
        return None
    fields: dict[bytes, list[bytes]] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"Uid", b"Gid", b"Groups"):
            fields[key] = rest.split()
    try:
        groups = tuple(int(g) for g in fields.get(b"Groups", [])[:_MAX_GROUPS])
        return Credentials(int(fields[b"Uid"][0]), int(fields[b"Gid"][0]), groups)
    except (KeyError, IndexError, ValueError):
        return None


def _take(creds: Credentials) -> str | None:
    """Give the calling thread `creds` for file access; None when done, else why not."""
    if sorted(set(creds.groups)) != sorted(set(os.getgroups())):
        if _SETGROUPS is None:
            return f"no raw setgroups syscall known on {platform.machine()}"
        arr = (ctypes.c_uint * max(len(creds.groups), 1))(*creds.groups)
        if _libc.syscall(ctypes.c_long(_SETGROUPS), ctypes.c_size_t(len(creds.groups)), arr) != 0:
            return f"setgroups: {os.strerror(ctypes.get_errno())} (needs CAP_SETGID)"
    _libc.setfsgid(creds.gid)
    _libc.setfsuid(creds.uid)
    # setfs[ug]id say nothing on failure: ask which ids the thread has now
    if _libc.setfsgid(_NO_ID) != creds.gid or _libc.setfsuid(_NO_ID) != creds.uid:
        return "setfsuid/setfsgid refused (needs CAP_SETUID and CAP_SETGID)"
    # no capability left in effect: the user's permissions, nothing more (pid 0: this thread)
    head, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if _libc.capget(ctypes.byref(head), data) != 0:
        return f"capget: {os.strerror(ctypes.get_errno())}"
    for d in data:
        d.effective = 0
    if _libc.capset(ctypes.byref(head), data) != 0:
        return f"capset: {os.strerror(ctypes.get_errno())}"
    return None


def _same(fd: int, key: tuple[int, int]) -> os.stat_result | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == key else None


def _readable(fd: int) -> bool:
    """Read permission on the inode behind an O_PATH fd, with the thread's credentials (no path walked)."""
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC))
        return True
    except OSError:
        return False


def _opath(path: str, dir_fd: int | None = None) -> int | None:
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None


def reachable(root: int, path: str, key: tuple[int, int], handle: int | None) -> bool:
    """With the calling thread's credentials: can it open `path` (as the process names it) from the
    process's root directory (an O_PATH fd) and read it, and is that the file (device, inode) `key`?
    A deleted file ("... (deleted)", no links left) has no path: the directory it was in must be
    searchable, and the file itself, reached through `handle` (an O_PATH fd of /proc/PID/fd/N or
    /proc/PID/map_files/...), readable."""
    if not path.startswith("/"):
        return False
    fd = _opath(path.lstrip("/") or ".", root)
    if fd is not None:
        try:
            if _same(fd, key):
                return _readable(fd)
        finally:
            os.close(fd)
    name = path.removesuffix(" (deleted)")
    if name == path or handle is None:
        return False  # the path names no file, or another one now (renamed, replaced)
    # "DIR/." is looked up in DIR: search permission on it and on every directory above it
    fd = _opath(f"{os.path.dirname(name).lstrip('/')}/." if os.path.dirname(name) != "/" else ".", root)
    if fd is None:
        return False
    os.close(fd)
    st = _same(handle, key)
    return st is not None and st.st_nlink == 0 and _readable(handle)


def as_user(creds: Credentials, fn: Callable[[], list]) -> list:
    """fn() run in a thread of its own holding `creds` for file access; [] when they cannot be
    taken (logged once per reason by the caller: the exception says why)."""
    out: list = []
    failed: list[str] = []

    def run() -> None:
        why = _take(creds)
        if why is not None:
            failed.append(why)
            return
        out.extend(fn())

    t = threading.Thread(target=run, name=f"access-uid-{creds.uid}", daemon=True)
    t.start()
    t.join()
    if failed:
        raise PermissionError(failed[0])
    return out


def openable_by_its_user(pid: int, files: Sequence, limit: int, max_checks: int = 64) -> list:
    """Of `files` (each with .path, .st_dev, .st_ino, .handle), in order, the first `limit` that the
    user running process `pid` could open by their path and read; at most `max_checks` looked at.
    Raises PermissionError when that user's credentials cannot be taken."""
    creds = credentials(pid)
    if creds is None:
        return []
    candidates = list(files[:max_checks])
    root = _opath(f"/proc/{pid}/root")  # with the agent's rights: the check's thread has none
    if root is None:
        return []
    handles = {i: _opath(f.handle) for i, f in enumerate(candidates) if f.path.endswith(" (deleted)")}
    try:
        def check() -> list:
            ok = []
            for i, f in enumerate(candidates):
                if len(ok) >= limit:
                    break
                if reachable(root, f.path, (f.st_dev, f.st_ino), handles.get(i)):
                    ok.append(f)
            return ok

        return as_user(creds, check)
    finally:
        os.close(root)
        for fd in handles.values():
            if fd is not None:
                os.close(fd)
