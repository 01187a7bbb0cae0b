"""Counter arbitration: GPU performance counters serve one profiler at a time, so the daemon's PM
sampler steps aside while another profiler is on the node.

A holder is found by scanning /proc (about 11 µs a process, so ~5 ms a scan on a node with 500
processes): a process named like a profiler (Nsight Compute `ncu`/`nv-nsight-cu-cli`, Nsight
Systems `nsys`/`nsight-sys`, DCGM's `nv-hostengine`, which may hold the profiling counters for
its DCP fields, and `dcgmi dmon` asking for profiling fields), or a process whose environment has
CUDA_INJECTION64_PATH (a tool injected into a CUDA program; readable as root, others are skipped).
The environment is read once per process (it is fixed at exec), so a scan costs one read of
/proc/PID/stat per process.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_YIELD_TO = ("ncu", "nv-nsight-cu-cli", "nsys", "nsight-sys", "dcgmi", "nv-hostengine")
INJECTION = b"CUDA_INJECTION64_PATH="
COMM_MAX = 15  # the kernel truncates /proc/PID/comm to 15 characters
NAME_RE = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")
# DCGM profiling (DCP) field ids are 1001-1099 (DCGM_FI_PROF_*): `dcgmi dmon -e 1002,...` makes the
# host engine hold the counters; other dcgmi commands do not.
_DCGM_PROF_FIELD = re.compile(r"(?<![0-9])10(0[1-9]|[1-9][0-9])(?![0-9])")


@dataclass(frozen=True)
class Holder:
    """A process that holds, or may hold, the GPU performance counters."""

    name: str
    pid: int | None  # None: known only from a CUPTI error, not from /proc
    why: str

    def __str__(self) -> str:
        who = f"{self.name} (pid {self.pid})" if self.pid is not None else self.name
        return f"{who}: {self.why}"


def parse_names(text: str) -> tuple[str, ...]:
    """'ncu, nsys' -> ('ncu', 'nsys'); ValueError naming a bad entry."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if not NAME_RE.match(n):
            raise ValueError(f"{n!r} is not a process name (letters, digits, . _ + - only)")
    return names


def _read(path: str, limit: int = 1 << 16) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_all(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


class Arbiter:
    """scan() -> the first counter holder on the node, or None."""

    def __init__(self, names: tuple[str, ...] | list[str] = DEFAULT_YIELD_TO, proc: str = "/proc",
                 check_environ: bool = True) -> None:
        self.names = tuple(names)
        # A name longer than comm's 15 characters shows there truncated; argv[0] confirms it.
        self._comms = {n[:COMM_MAX]: n for n in self.names}
        self.proc = proc
        self.check_environ = check_environ
        self._env_cache: dict[tuple[int, bytes], str | None] = {}  # (pid, starttime+comm) -> injection

    def scan(self, exclude: tuple[int, ...] | set[int] | frozenset[int] = ()) -> Holder | None:
        found = self.holders(exclude)
        return found[0] if found else None

    def holders(self, exclude: tuple[int, ...] | set[int] | frozenset[int] = ()) -> list[Holder]:
        """Every holder on the node, by pid."""
        seen: set[tuple[int, bytes]] = set()
        found: list[Holder] = []
        me = os.getpid()
        try:
            entries = os.scandir(self.proc)
        except OSError:
            return []
        with entries:
            for e in entries:
                if not e.name.isdigit():
                    continue
                pid = int(e.name)
                if pid == me or pid in exclude:
                    continue
                stat = _read(f"{self.proc}/{pid}/stat", 4096)
                if not stat:
                    continue
                lp, rp = stat.find(b"("), stat.rfind(b")")
                if lp < 0 or rp < 0:
                    continue
                comm = stat[lp + 1:rp].decode(errors="replace")
                rest = stat[rp + 2:].split()
                if not rest or rest[0] == b"Z":  # a zombie holds nothing
                    continue
                holder = self._by_name(pid, comm)
                if holder is None and self.check_environ:
                    key = (pid, (rest[19] if len(rest) > 19 else b"") + b"/" + stat[lp + 1:rp])
                    seen.add(key)
                    if key not in self._env_cache:
                        self._env_cache[key] = self._injection(pid)
                    inj = self._env_cache[key]
                    if inj:
                        holder = Holder(comm, pid, f"CUDA_INJECTION64_PATH={inj} (a profiler injected "
                                                   "into a CUDA program)")
                if holder is not None:
                    found.append(holder)
        if self.check_environ:
            for k in [k for k in self._env_cache if k not in seen]:
                del self._env_cache[k]
        return sorted(found, key=lambda h: h.pid or 0)

    def _by_name(self, pid: int, comm: str) -> Holder | None:
        name = self._comms.get(comm)
        if name is None:
            return None
        if len(name) > COMM_MAX or name in ("dcgmi",):
            argv = (_read_all(f"{self.proc}/{pid}/cmdline") or b"").split(b"\0")
            args = [a.decode(errors="replace") for a in argv if a]
            if len(name) > COMM_MAX and (not args or os.path.basename(args[0]) != name):
                return None
            if name == "dcgmi" and not _dcgmi_profiling(args):
                return None
        return Holder(name, pid, "a profiler named in cupti.yield_to")

    def _injection(self, pid: int) -> str | None:
        env = _read_all(f"{self.proc}/{pid}/environ")
        if not env:
            return None  # not ours to read (another user, without root) or empty
        for var in env.split(b"\0"):
            if var.startswith(INJECTION) and len(var) > len(INJECTION):
                return var[len(INJECTION):].decode(errors="replace")
        return None


def _dcgmi_profiling(args: list[str]) -> bool:
    """`dcgmi dmon -e 1002,1003` asks the host engine for profiling fields; `dcgmi discovery` does not."""
    if "dmon" not in args:
        return False
    for i, a in enumerate(args):
        if a in ("-e", "--field-id") and i + 1 < len(args) and _DCGM_PROF_FIELD.search(args[i + 1]):
            return True
        if a.startswith("--field-id=") and _DCGM_PROF_FIELD.search(a):
            return True
    return False
