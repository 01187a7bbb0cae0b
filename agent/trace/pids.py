"""The traced process: checks made before anything is compiled (check_pid, validate), whether it
still runs under its PID (alive, pid_reused), and which libcuda files it maps (cuda_libraries)."""
from __future__ import annotations

import contextlib
import os
import pwd
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.api import printable
from gpuwatch.probes.ebpf import loader
from gpuwatch.probes.process import identity

PF_KTHREAD = 0x00200000  # task flag of kernel threads (include/linux/sched.h)
WAIT_POLL_S = 0.25


# ---- /proc -------------------------------------------------------------------------------------
def comm(pid: int, proc: str = "/proc") -> str:
    """The command name to show a person, "?" when it cannot be read. Any process may name itself
    anything (prctl PR_SET_NAME): characters that are not printable (newlines, terminal escape
    sequences) become "?", so a name cannot forge lines or colours on the terminal."""
    name = identity.comm(pid, proc)
    return printable(name) if name else "?"


def _tgid(pid: int, proc: str = "/proc") -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    return None


def pid_max(proc: str = "/proc") -> int:
    try:
        with open(f"{proc}/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's ceiling (PID_MAX_LIMIT on 64-bit)


# The same process still runs / another one has the PID now: pid and start time (identity).
alive = identity.same_process
pid_reused = identity.pid_reused


def not_yours_message(pid: int, uid: int) -> str:
    """For a caller (uid) who does not own the process: to whom it belongs."""
    who = identity.identify(pid)
    other = next((u for u in who.uids if u != uid), None) if who else None  # a setuid program: its owner
    if other is None:
        owner = "another user"
    else:
        try:
            owner = f"user {pwd.getpwuid(other).pw_name}"
        except KeyError:
            owner = f"uid {other}"
    return f"process {pid} belongs to {owner}: you can trace only your own processes"


# ---- validation (before compiling anything) ------------------------------------------------------
@dataclass
class Target:
    pid: int
    process: str
    start_time: int
    libraries: list[str] = field(default_factory=list)  # what the probe attaches to


def check_pid(pid: int, proc: str = "/proc", privileged: Callable[[], bool] | None = None) -> Target:
    """Everything about the PID except whether it uses CUDA; without privileges, that the caller owns
    it (the gpuwatch agent traces only those for a caller). Raises TraceError."""
    if pid <= 0:
        raise TraceError(f"PID must be a positive integer (got {pid})")
    limit = pid_max(proc)
    if pid > limit:
        raise TraceError(f"PID {pid} is above this system's largest PID ({limit}, /proc/sys/kernel/pid_max): "
                         f"no such process")
    st = identity.read_stat(pid, proc)
    if st is None or st.state in ("X", "x"):
        raise TraceError(f"no such process: PID {pid}")
    if st.flags & PF_KTHREAD:
        raise TraceError(f"PID {pid} is a kernel thread: it runs no CUDA")
    if st.state == "Z":
        raise TraceError(f"process {pid} ({comm(pid, proc)}) has exited (a zombie waiting for its parent)")
    tgid = _tgid(pid, proc)
    if tgid is not None and tgid != pid:
        raise TraceError(f"PID {pid} is a thread of process {tgid} ({comm(tgid, proc)}): use --pid {tgid}")
    if not (privileged or loader.has_privileges)():
        if not identity.owns(os.geteuid(), identity.identify(pid)):
            raise TraceError(not_yours_message(pid, os.geteuid()) + " (root can trace any)")
    return Target(pid, comm(pid, proc), st.start_time)


def maps_file(pid: int, path: str, proc: str = "/proc") -> bool:
    """Does the process map this file (compared by device and inode, through /proc/PID/root)?"""
    want = loader.file_id(path)
    return want is not None and any(loader.file_id(f"{proc}/{pid}/root{m}") == want
                                    for m in loader.mapped_files(pid, proc))


def cuda_libraries(target: Target, library: str | None = None, proc: str = "/proc") -> list[str]:
    """The libcuda files to attach to, and the libnccl files the process maps beside them (its
    collectives); [] when it maps no libcuda (yet)."""
    if library is not None:
        if not maps_file(target.pid, library, proc):
            return []
        return [library] + loader.libraries_in(target.pid, loader.LIBNCCL_RE)
    found = loader.libraries_in(target.pid, *loader.HOOKED_LIBRARIES)  # one read of its maps
    if not any(loader.LIBCUDA_RE.search(p) for p in found):
        return []
    return sorted(found, key=lambda p: not loader.LIBCUDA_RE.search(p))  # libcuda first, as before


def no_cuda_message(target: Target, library: str | None) -> str:
    if library is not None:
        return (f"process {target.pid} ({target.process}) does not map {library} (--library): "
                f"check the path, or use --wait if it has not loaded it yet")
    return (f"process {target.pid} ({target.process}) does not use CUDA: no libcuda.so is mapped "
            f"(use --wait to wait until it loads CUDA)")


def validate(pid: int, library: str | None = None, wait: bool = False, proc: str = "/proc",
             privileged: Callable[[], bool] | None = None) -> Target:
    """All checks; with wait=False also that the process maps libcuda. Raises TraceError."""
    if library is not None and not os.path.isfile(library):
        raise TraceError(f"--library {library}: no such file")
    target = check_pid(pid, proc, privileged)
    if not wait:
        target.libraries = cuda_libraries(target, library, proc)
        if not target.libraries:
            raise TraceError(no_cuda_message(target, library))
    return target


def wait_for_cuda(target: Target, library: str | None, proc: str = "/proc", poll: float = WAIT_POLL_S,
                  sleep: Callable[[float], None] = time.sleep) -> Target:
    """Poll until the process maps libcuda; TraceError when it exits first."""
    while True:
        if not alive(target.pid, target.start_time, proc):
            raise TraceError(f"process {target.pid} ({target.process}) exited before it loaded CUDA")
        target.libraries = cuda_libraries(target, library, proc)
        if target.libraries:
            return target
        sleep(poll)
