"""Process identity: which process a PID names, as one value every part of gpuwatch shares.

A PID alone does not name a process: once it exits, the kernel hands the number to the next
process that needs one. `ProcessIdentity` is a PID *and* its start time (clock ticks since boot,
field 22 of /proc/PID/stat), with what we decide on: its uids, its command name, its root
directory. `is_alive` says whether that same process still runs; a PID reused by another
process is not it.

psutil where it has the call (uids); /proc where it does not (the start time in clock ticks,
the raw comm: psutil gives seconds since the epoch and a name lengthened from the command line).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


_DEAD = ("Z", "X", "x")  # zombie, dead: the process has exited, whatever /proc still shows


def sanitise_process_name(name: str) -> str:
    """A process's name as gpuwatch shows and labels it, in every probe the same: any process may
    call itself anything (prctl PR_SET_NAME), so what could break a label or forge terminal output
    becomes "_"."""
    return re.sub(r"[^A-Za-z0-9_.:+-]", "_", name)[:64] or "unknown"


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int  # clock ticks since boot (/proc/PID/stat field 22): with pid, the process
    uids: tuple[int, int, int]  # real, effective, saved
    comm: str  # sanitise_process_name(/proc/PID/comm)
    root: str  # where /proc/PID/root points ("/" outside containers; "" when it cannot be read)


@dataclass(frozen=True)
class ProcStat:
    """What /proc/PID/stat says about a process (the fields gpuwatch decides on)."""

    comm: str  # raw: any process may call itself anything; sanitise before showing it
    state: str  # R, S, D, Z (zombie), X (dead), ...
    flags: int  # PF_* task flags (PF_KTHREAD: a kernel thread)
    start_time: int  # clock ticks since boot: with the PID, names the process
    minor_faults: int = 0  # the process's (or thread's) own, not its children's
    major_faults: int = 0
    user_ticks: int = 0  # CPU time in clock ticks (os.sysconf("SC_CLK_TCK") a second)
    system_ticks: int = 0

    @property
    def exited(self) -> bool:
        return self.state in _DEAD


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """/proc/PID/stat parsed (the one parser of it in gpuwatch); None when there is no such process."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        # comm may hold spaces and ")": it runs from the first "(" to the last ")".
        name = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw[raw.rindex(b")") + 2:].split()
        # after "(comm) ": state(3) ppid(4) ... flags(9) minflt(10) majflt(12) utime(14) stime(15) ...
        # starttime(22), 1-based as in proc(5): field N is fields[N - 3]
        return ProcStat(name, fields[0].decode(), int(fields[6]), int(fields[19]), int(fields[7]), int(fields[9]),
                        int(fields[11]), int(fields[12]))
    except (ValueError, IndexError):
        return None


def comm(pid: int, proc: str = "/proc") -> str | None:
    """The process's command name as it set it (/proc/PID/comm, raw), None when it cannot be read."""
    try:
        with open(f"{proc}/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return None


def same_process(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """The process that had this start time still runs under `pid` (not exited, PID not reused)."""
    st = read_stat(pid, proc)
    return st is not None and not st.exited and st.start_time == start_time


def pid_reused(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """Another process runs under `pid` now: the one with this start time has exited."""
    st = read_stat(pid, proc)
    return st is not None and not st.exited and st.start_time != start_time


def identify(pid: int) -> ProcessIdentity | None:
    """The process `pid` names now; None when there is none (or it has exited: a zombie)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    first = read_stat(pid)
    if first is None or first.exited:
        return None
    import psutil  # here, not at the top: the control client runs inside users' programs, stdlib only

    try:
        uids = tuple(psutil.Process(pid).uids())
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # AccessDenied: hidepid; ZombieProcess is NoSuchProcess
        return None
    try:
        root = os.readlink(f"/proc/{pid}/root")
    except OSError:  # another user's process, for an unprivileged caller
        root = ""
    # The uids and root were read after the start time: if the PID was reused in between they
    # are another process's. The same start time afterwards says they are this one's.
    if not same_process(pid, first.start_time):
        return None
    return ProcessIdentity(pid, first.start_time, uids, sanitise_process_name(first.comm), root)  # type: ignore[arg-type]


def is_alive(identity: ProcessIdentity) -> bool:
    """That very process still runs: its PID is there, not a zombie, with the same start time
    (another start time: the PID now names another process)."""
    return same_process(identity.pid, identity.start_time)


def owns(caller_uid: int, identity: ProcessIdentity | None) -> bool:
    """May user `caller_uid` look inside this process? Root: any. Others: only when every uid of
    the process (real, effective, saved) is theirs, as ptrace decides, so a setuid program a user
    started is not theirs."""
    if caller_uid == 0:
        return identity is not None
    return identity is not None and all(u == caller_uid for u in identity.uids)
