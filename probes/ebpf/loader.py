"""Find libcuda, compile cuda.bpf.c with bcc, attach uprobes, read and prune the maps.

bcc is imported lazily (`import bcc` only in check_environment/Loader), so this module imports on
machines without it. Everything that can stop the probe from running raises ProbeUnavailable with
what a person should do about it.
"""
from __future__ import annotations

import atexit
import logging
import os
import platform
import re
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.probes.ebpf import symbols
from gpuwatch.probes.ebpf.symbols import API_NAMES, HOOKS

log = logging.getLogger("gpuwatch.ebpf")

BPF_SOURCE = Path(__file__).with_name("cuda.bpf.c")
LIBCUDA_RE = re.compile(r"/libcuda\.so(\.[0-9.]+)?$")
TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39

BCC_REMEDY = ("bcc is not importable: install Debian's python3-bpfcc (`apt-get install python3-bpfcc`; the "
              "PyPI package named bcc is unrelated) and run gpuwatch from the system python3 or from a venv "
              "created with --system-site-packages")


# ---- environment -------------------------------------------------------------------------------
def _effective_caps() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return None


def missing_capabilities() -> list[str]:
    """The capabilities this process lacks to load BPF programs and attach uprobes ([] when none).

    Checked for root too: root in a container, or under a unit or `setpriv`/`capsh` that dropped them,
    has uid 0 but not the capabilities, and bcc would then fail later with an obscure error."""
    caps = _effective_caps()
    if caps is None:  # no /proc/self/status: judge by the uid, as before
        return [] if os.geteuid() == 0 else ["CAP_BPF", "CAP_PERFMON"]
    if caps >> CAP_SYS_ADMIN & 1:
        return []
    return [name for name, cap in (("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON)) if not caps >> cap & 1]


def has_privileges() -> bool:
    return not missing_capabilities()


def privileges_message(missing: list[str]) -> str:
    who = ("it runs as root, but without " if os.geteuid() == 0 else "this process lacks ") + " and ".join(missing)
    return ("the eBPF probe needs root or the capabilities CAP_BPF and CAP_PERFMON (CAP_SYS_ADMIN before "
            f"Linux 5.8); {who}: run the agent as root with its capabilities, as the systemd unit does "
            "(AmbientCapabilities/CapabilityBoundingSet must keep CAP_BPF CAP_PERFMON)")


def kernel_headers() -> str | None:
    """Where bcc will find kernel headers, or None."""
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env:
        return env if os.path.isdir(env) else None
    build = f"/lib/modules/{platform.release()}/build"
    if os.path.isdir(build):
        return os.path.realpath(build)
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return "/sys/kernel/kheaders.tar.xz"
    return None


def tracefs_dir() -> str | None:
    for d in TRACEFS_DIRS:
        if os.path.exists(os.path.join(d, "uprobe_events")):
            return d
    return None


def ensure_tracefs() -> str:
    """bcc's detach path reads <tracefs>/uprobe_events: mount tracefs if it is not (as root)."""
    d = tracefs_dir()
    if d:
        return d
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS_DIRS[0]], capture_output=True, check=False)
        d = tracefs_dir()
        if d:
            return d
    raise ProbeUnavailable("tracefs is not mounted (bcc needs /sys/kernel/tracing/uprobe_events): run "
                           "`mount -t tracefs nodev /sys/kernel/tracing` as root, or add it to /etc/fstab")


def check_environment() -> None:
    """Raise ProbeUnavailable with the remedy when bcc cannot work here."""
    try:
        with warnings.catch_warnings():
            # bcc 0.26's own module has an invalid escape sequence; its warning is noise to our users.
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            import bcc  # noqa: F401
    except ImportError:
        raise ProbeUnavailable(BCC_REMEDY) from None
    missing = missing_capabilities()
    if missing:
        raise ProbeUnavailable(privileges_message(missing))
    if kernel_headers() is None:
        release = platform.release()
        raise ProbeUnavailable(
            f"no kernel headers for {release} (bcc looks in /lib/modules/{release}/build): install "
            f"linux-headers-{release}, or, for a kernel without a headers package, install the nearest "
            f"distribution headers (e.g. linux-headers-amd64) and symlink /lib/modules/{release}/build to "
            f"/usr/src/linux-headers-VERSION-amd64 and /source to its -common sibling: uprobe programs "
            f"need little from them (verified with Debian's 6.1 headers on 6.18 kernels)")
    ensure_tracefs()


# ---- processes in /proc ----------------------------------------------------------------------
# ---- finding libcuda ---------------------------------------------------------------------------
def mapped_files(pid: int, proc: str = "/proc") -> list[str]:
    """The files a process maps, once each, in its own mount namespace's paths (not deleted ones)."""
    found: dict[str, None] = {}
    try:
        with open(f"{proc}/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                # The kernel writes the path as it is, but for a newline (as \\012) and the
                # line's own newline; fsdecode keeps undecodable bytes, so the path opens again.
                raw = parts[5].rstrip(b"\n")
                if raw.endswith(b" (deleted)"):
                    continue
                path = os.fsdecode(raw.replace(b"\\012", b"\n"))
                if path.startswith("/"):
                    found[path] = None
    except OSError:
        pass
    return list(found)


def libcuda_in(pid: int) -> list[str]:
    """The libcuda files mapped by a process, as paths reachable from here (through /proc/PID/root)."""
    return [f"/proc/{pid}/root{path}" for path in mapped_files(pid) if LIBCUDA_RE.search(path)]


def file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def scan_libcuda(pids: Iterable[int] | None = None) -> dict[tuple[int, int], str]:
    """Every distinct libcuda file (by device and inode) mapped by a running process."""
    if pids is None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    seen: dict[tuple[int, int], str] = {}
    for pid in pids:
        for path in libcuda_in(pid):
            fid = file_id(path)
            if fid is not None and fid not in seen:
                seen[fid] = path
    return seen


def function_symbols(path: str) -> dict[str, int]:
    """Function symbols (dynamic and static) of an ELF file: name -> address."""
    from bcc import BPF
    out: dict[str, int] = {}
    for name, addr in BPF.get_user_functions_and_addresses(path.encode(), rb"^cu"):
        out[name.decode() if isinstance(name, bytes) else name] = addr
    return out


# ---- the loaded program ------------------------------------------------------------------------
def bpf_text(launch_latency: bool = False, events: bool = False) -> str:
    src = ("#define GW_EVENTS 1\n" if events else "") + BPF_SOURCE.read_text()
    return src.replace("GW_DEFINITIONS", symbols.render_c()).replace(
        "GW_PROGRAMS", symbols.render_programs(launch_latency))


@dataclass
class Library:
    path: str
    file: tuple[int, int]
    attached: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    uprobes: int = 0


class Loader:
    """One compiled BPF program and the uprobes attached from it."""

    def __init__(self, pid: int | None = None, apis: Iterable[str] | None = None,
                 launch_latency: bool = False, events: bool = False) -> None:
        """launch_latency: give the launch APIs a return probe too (latency, errors); by default
        they are counted at entry only (see symbols.timed). events: compile in the per-call ring
        buffer "events" (one gw_event per timed call; see events.py)."""
        self.pid = pid  # attach only for this process (perf filters by its mm), or None: everyone
        self.hooks = HOOKS if apis is None else tuple(h for h in HOOKS if h.name in set(apis))
        self.launch_latency = launch_latency
        self.untimed = frozenset(h.name for h in self.hooks if not symbols.timed(h, launch_latency))
        self._detacher: threading.Thread | None = None
        self._stop = threading.Event()  # set at interpreter exit: a background detach stops
        self.libraries: dict[tuple[int, int], Library] = {}
        self.compile_seconds = 0.0
        self.attach_seconds = 0.0
        check_environment()
        from bcc import BPF
        t0 = time.perf_counter()
        try:
            self.bpf = BPF(text=bpf_text(launch_latency, events).encode(),
                           cflags=["-Wno-macro-redefined", "-Wno-unused-function"])
        except Exception as e:
            raise ProbeUnavailable(f"bcc could not compile the probe ({e}); see the compiler messages in the "
                                   f"agent's log; the kernel headers used are {kernel_headers()}: install "
                                   f"linux-headers for the running kernel (`gpuwatch doctor` says what is "
                                   f"missing)") from None
        self.compile_seconds = time.perf_counter() - t0
        self._closed = False
        # bcc registers BPF.cleanup to run at interpreter exit; it would race a background detach
        # (close(wait=False)) over the same file descriptors. Ours runs instead (see _at_exit).
        atexit.unregister(self.bpf.cleanup)
        atexit.register(self._at_exit)

    # -- attach / detach ---------------------------------------------------------------------
    def attach(self, path: str) -> Library | None:
        """Attach every hooked symbol the file has; None when this file is already attached."""
        fid = file_id(path)
        if fid is None:
            raise FileNotFoundError(path)
        if fid in self.libraries:
            return None
        t0 = time.perf_counter()
        lib = Library(path, fid)
        self.libraries[fid] = lib
        try:
            present = function_symbols(path)
        except Exception as e:
            log.warning("cannot read the symbols of %s: %s", path, e)
            present = {}
        pid = self.pid if self.pid is not None else -1
        for hook in self.hooks:
            addr = present.get(hook.name)
            if addr is None:
                lib.skipped.append(hook.name)
                continue
            try:
                # Return probe first: a call entered between the two attaches then has no entry
                # record and is not counted, rather than leaving a stale in-flight record.
                if hook.name not in self.untimed:
                    self.bpf.attach_uretprobe(name=path.encode(), sym=hook.name.encode(),
                                              fn_name=symbols.return_fn(hook.name).encode(), pid=pid)
                    lib.uprobes += 1
                self.bpf.attach_uprobe(name=path.encode(), sym=hook.name.encode(),
                                       fn_name=symbols.entry_fn(hook.name).encode(), pid=pid)
                lib.uprobes += 1
                lib.attached.append(hook.name)
            except Exception as e:
                log.warning("cannot attach to %s in %s: %s", hook.name, path, e)
                lib.skipped.append(hook.name)
        self.attach_seconds += time.perf_counter() - t0
        if lib.skipped:
            log.info("%s: %d symbols hooked, not present: %s", path, len(lib.attached), ", ".join(lib.skipped))
        return lib

    @property
    def uprobe_count(self) -> int:
        return len(self.bpf.uprobe_fds) if not self._closed else 0

    def close(self, wait: bool = True) -> None:
        """Detach everything and free the maps. Idempotent.

        Slow by the kernel's doing: closing each uprobe's perf event waits for an RCU grace period
        under a global mutex (~0.08-0.1 s each measured on kernel 6.18; closing from threads does
        not overlap them). Entry probes go first, so no call starts being timed that no return
        probe will finish.

        wait=False: return at once and detach in a daemon thread (`wait_closed()` waits for it).
        The maps must not be read after close() either way. Should the interpreter exit first, the
        thread stops between two uprobes (see _at_exit) and the kernel releases the rest when it
        closes the process's perf-event file descriptors at exit (bcc attaches through the uprobe
        PMU: nothing is left in uprobe_events).
        """
        if self._closed:
            return
        self._closed = True
        if wait:
            self._detach()
        else:
            self._detacher = threading.Thread(target=self._detach, name="gpuwatch-ebpf-detach", daemon=True)
            self._detacher.start()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """After close(): wait for a background detach; True when everything is detached."""
        t = self._detacher
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return self._closed

    @property
    def detaching(self) -> bool:
        t = self._detacher
        return t is not None and t.is_alive()

    def _at_exit(self) -> None:
        # Detaching in the background: stop after the uprobe being detached now and leave the rest
        # to the kernel, which closes them when the process exits. The thread must NOT be inside
        # close() when the process exits: a task being killed (exit_group kills the other threads)
        # that unregisters a uprobe fails to restore the original instruction in the traced
        # processes (measured on 6.18: the int3 stayed in the driver's text), while the kernel's
        # own closing at exit restores everything.
        t = self._detacher
        if t is not None and t.is_alive():
            self._stop.set()
            t.join(5.0)
            return
        # Not closed: detach as bcc's own exit handler did.
        if not self._closed:
            try:
                self.close()
            except Exception as e:  # at interpreter exit: say it, do not raise
                log.warning("detaching at exit: %s", e)

    def _detach(self) -> None:
        t0 = time.perf_counter()
        bpf = self.bpf
        n = len(bpf.uprobe_fds)
        for ev in sorted(bpf.uprobe_fds, key=lambda ev: not ev.startswith(b"p_")):
            if self._stop.is_set():
                log.info("exiting: %d uprobes left to the kernel to release", len(bpf.uprobe_fds))
                return
            try:
                bpf.detach_uprobe_event(ev)
            except Exception as e:
                log.warning("detaching %s: %s", ev, e)
        try:
            bpf.cleanup()
        except Exception as e:
            log.warning("bcc cleanup: %s", e)
        self.libraries.clear()
        atexit.unregister(self._at_exit)  # lets the Loader be garbage-collected
        log.info("detached %d uprobes in %.2f s", n, time.perf_counter() - t0)

    # -- maps ----------------------------------------------------------------------------------
    def stats(self) -> dict[tuple[int, str], tuple[int, int, int, int]]:
        """(pid, api) -> (calls, errors, ns, bytes)."""
        out = {}
        for k, v in self.bpf[b"stats"].items():
            out[(k.pid, API_NAMES[k.api])] = (v.calls, v.errors, v.ns, v.bytes)
        return out

    def errors(self, pid: int | None = None) -> dict[tuple[int, str], dict[int, int]]:
        """(pid, api) -> {CUresult: calls that returned it} (errors only: CUresult != 0)."""
        out: dict[tuple[int, str], dict[int, int]] = {}
        for k, v in self.bpf[b"errors"].items():
            if pid is None or k.pid == pid:
                out.setdefault((k.pid, API_NAMES[k.api]), {})[k.code] = v.value
        return out

    def live_bytes(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self.bpf[b"live_bytes"].items()}

    def live_by_stack(self, pid: int) -> dict[tuple[int, int], tuple[int, int]]:
        """Live allocations of a process by the user stack that made them: (stack id, return
        address) -> (bytes, allocations); stack id -1 where the stack could not be taken."""
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for k, v in self.bpf[b"live"].items():
            if k.pid == pid:
                b, n = out.get((v.stack, v.caller), (0, 0))
                out[(v.stack, v.caller)] = (b + v.size, n + 1)
        return out

    def stack_frames(self, stack_id: int, caller: int, pid: int, limit: int = 16) -> list[str]:
        """The frames of an allocation's stack, innermost first (the API, its caller, ...),
        symbolised and demangled by bcc in the process's binaries: "function+0x1c [library]", or
        the address when nothing names it. With frame pointers missing (most optimised builds)
        the walk stops early: the API and its caller are always there."""
        addrs: list[int] = []
        if stack_id >= 0:
            try:
                addrs = list(self.bpf[b"stacks"].walk(stack_id))[:limit]
            except KeyError:
                pass
        if caller:  # the walk from the API's first instruction skips its caller
            addrs = addrs[:1] + [caller] + addrs[1:]
        frames = []
        for a in addrs[:limit]:
            name = self.bpf.sym(a, pid, show_module=True, show_offset=True, demangle=True)
            text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            frames.append(f"{a:#x}" if text.startswith("[unknown]") else text)
        return frames

    def live_allocations(self, pid: int | None = None) -> int:
        return sum(1 for k in self.bpf[b"live"].keys() if pid is None or k.pid == pid)

    def histogram(self, pid: int | None = None) -> dict[str, dict[int, int]]:
        """api -> {log2 slot: count}; slot s (bcc's bpf_log2l) holds latencies in [2**(s-1), 2**s) ns; slot 0: 0 ns."""
        out: dict[str, dict[int, int]] = {}
        for k, v in self.bpf[b"hist"].items():
            if pid is None or k.pid == pid:
                slots = out.setdefault(API_NAMES[k.api], {})
                slots[k.slot] = slots.get(k.slot, 0) + v.value
        return out

    def kernels(self, pid: int | None = None) -> dict[tuple[int, int], dict]:
        """(pid, CUfunction handle) -> {"launches", "degenerate_launches", "grid", "block",
        "shared_mem_bytes", "stream"} (grid, block, shared memory and stream of the last launch)."""
        out = {}
        for k, v in self.bpf[b"kernels"].items():
            if pid is None or k.pid == pid:
                out[(k.pid, k.handle)] = {
                    "launches": v.launches, "degenerate_launches": v.degenerate,
                    "grid": [v.dims.grid_x, v.dims.grid_y, v.dims.grid_z],
                    "block": [v.dims.block_x, v.dims.block_y, v.dims.block_z],
                    "shared_mem_bytes": v.shared_mem, "stream": v.stream}
        return out

    def names(self, pid: int | None = None) -> dict[tuple[int, int, int], tuple[bytes, bool]]:
        """(pid, symbols.NAME_FUNCTION or NAME_KERNEL, handle) -> (name as the process gave it, up
        to NAME_LEN - 1 bytes; truncated)."""
        out = {}
        for k, v in self.bpf[b"names"].items():
            if pid is None or k.pid == pid:
                out[(k.pid, k.kind, k.handle)] = (bytes(v.name)[:v.len], bool(v.truncated))
        return out

    def dropped(self) -> int:
        return sum(v.value for v in self.bpf[b"dropped"].values())

    def dropped_by_kind(self) -> dict[str, int]:
        """What was not recorded, by what (symbols.DROPPED_KINDS), where anything was."""
        return {symbols.DROPPED_KINDS[k.value]: v.value for k, v in self.bpf[b"dropped"].items() if v.value}

    def forget(self, pids: set[int]) -> None:
        """Remove every map entry of these processes (they exited)."""
        if not pids:
            return
        for name, pid_of in (("stats", lambda k: k.pid), ("hist", lambda k: k.pid), ("errors", lambda k: k.pid),
                             ("live", lambda k: k.pid), ("live_bytes", lambda k: k.value), ("inflight", lambda k: k.pid_tgid >> 32),
                             ("kernels", lambda k: k.pid), ("names", lambda k: k.pid)):
            table = self.bpf[name.encode()]
            doomed = [k for k in table.keys() if pid_of(k) in pids]
            for k in doomed:
                try:
                    del table[k]
                except KeyError:
                    pass

    def pids(self) -> set[int]:
        """Every process with an entry in any map."""
        pids = {k.pid for k in self.bpf[b"stats"].keys()}
        pids.update(k.value for k in self.bpf[b"live_bytes"].keys())
        pids.update(k.pid_tgid >> 32 for k in self.bpf[b"inflight"].keys())
        pids.update(k.pid for k in self.bpf[b"kernels"].keys())
        pids.update(k.pid for k in self.bpf[b"names"].keys())
        return pids
