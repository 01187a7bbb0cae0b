"""Find libcuda, load the compiled probe, attach its uprobes, read and prune the maps.

bcc never enters this process: compiler.py compiles in a child (or takes the cached object) and
bpfsys.py makes the system calls. Everything that can stop the probe from running raises
ProbeUnavailable with what a person should do about it.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import errno
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import platform
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from gpuwatch.agent import budget as budget_
from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.probes.ebpf import bpfsys, compiler, symbols, unwind
from gpuwatch.probes.ebpf.symbols import API_NAMES, HOOKS, SAMPLED_APIS

log = logging.getLogger("gpuwatch.ebpf")

LIBCUDA_RE = re.compile(r"/libcuda\.so(\.[0-9.]+)?$")
# NCCL: the system's, a wheel's (nvidia/nccl/lib/libnccl.so.2, PyTorch's) or a container's copy
LIBNCCL_RE = re.compile(r"/libnccl\.so(\.[0-9.]+)?$")
HOOKED_LIBRARIES = (LIBCUDA_RE, LIBNCCL_RE)

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39

BCC_REMEDY = ("bcc is not importable: install Debian's python3-bpfcc (`apt-get install python3-bpfcc`; the "
              "PyPI package named bcc is unrelated) and run gpuwatch from the system python3 or from a venv "
              "created with --system-site-packages")


# ---- environment -------------------------------------------------------------------------------
def _effective_caps() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
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


def check_environment(compiling: bool = True) -> None:
    """Raise ProbeUnavailable with the remedy when the probe cannot work here (compiling: bcc and
    kernel headers are needed too, not only the capabilities)."""
    missing = missing_capabilities()
    if missing:
        raise ProbeUnavailable(privileges_message(missing))
    if not compiling:
        return
    if importlib.util.find_spec("bcc") is None:
        raise ProbeUnavailable(BCC_REMEDY)
    if kernel_headers() is None:
        release = platform.release()
        from gpuwatch.agent.kernel_headers import remedy
        raise ProbeUnavailable(f"no kernel headers for {release} (bcc looks in /lib/modules/{release}/build): "
                               f"{remedy(release)}")


# ---- processes in /proc ----------------------------------------------------------------------
def _fields(ctype, *fields: tuple[str, str]) -> struct.Struct:
    """A struct reading these fields (name, struct code; in the order they lie) of one ctype record."""
    fmt, pos = "<", 0
    for name, code in fields:
        f = getattr(ctype, name)
        if f.offset < pos or struct.calcsize("<" + code) != f.size:
            raise ValueError(f"{ctype.__name__}.{name}: not where {fields} expects it")
        fmt += f"{f.offset - pos}x{code}"
        pos = f.offset + f.size
    return struct.Struct(fmt + f"{ctypes.sizeof(ctype) - pos}x")


# ---- finding libcuda ---------------------------------------------------------------------------
def mapped_files(pid: int, proc: str = "/proc") -> list[str]:
    """The files a process maps, once each, in its own mount namespace's paths (not deleted ones)."""
    found: dict[str, None] = {}
    with contextlib.suppress(OSError):
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
    return list(found)


def libraries_in(pid: int, *patterns: re.Pattern) -> list[str]:
    """The files a process maps whose path matches one of patterns, as paths reachable from here
    (through /proc/PID/root)."""
    return [f"/proc/{pid}/root{path}" for path in mapped_files(pid) if any(p.search(path) for p in patterns)]


def file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def scan_libraries(pids: Iterable[int] | None = None) -> dict[tuple[int, int], tuple[str, int]]:
    """Every distinct libcuda or libnccl file (by device and inode) mapped by a running process: its
    path and the user it is charged to (agent/budget.py). The path is the one this process sees it
    by when that is the same file (the host's libcuda: the path outlives the process), else through
    /proc/PID/root (a container's copy). The user is root for a file root owns (the host's driver, an
    image's), else the user of the first process found mapping it (a private copy)."""
    if pids is None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for pid in pids:
        user = None
        for path in libraries_in(pid, *HOOKED_LIBRARIES):
            try:
                st = os.stat(path)
            except OSError:
                continue
            fid = st.st_dev, st.st_ino
            if fid not in seen:
                if st.st_uid and user is None:
                    user = budget_.uid_of(pid)
                own = path[len(f"/proc/{pid}/root"):]
                seen[fid] = (own if file_id(own) == fid else path, user if st.st_uid else 0)
    return seen


HOOKED_PREFIXES = ("cu", "nccl")  # the driver API and NCCL's (not pnccl*, its aliases for profilers)


def function_offsets(path: str) -> dict[str, int]:
    """The file offset of every exported function of an ELF file whose name starts with "cu" (the
    driver API) or "nccl": where a uprobe goes. From the dynamic symbol table, by pyelftools (its
    import and a real libcuda's table take tens of milliseconds: a trace waited on them), kept in the
    eBPF cache per file (device, inode, size, modification and change times: a rewrite changes the
    change time, which no one can set back)."""
    from gpuwatch.agent.safefile import open_regular
    with os.fdopen(open_regular(path), "rb") as f:  # a process's path: whatever it put there
        st = os.fstat(f.fileno())
        ident, name = symbols_cache_name(st)
        cached = _cached_offsets(compiler.read_cache(name), ident, st.st_size)
        if cached is not None:
            return cached
        out = _read_offsets(f, path)
    compiler.write_cache(name, json.dumps({"ident": ident, "offsets": out}).encode(),
                         prune=_SYMBOLS_RE.fullmatch, keep=MAX_SYMBOL_FILES - 1)
    return out


def symbols_cache_name(st: os.stat_result) -> tuple[str, str]:
    """A file's identity in the cache, and the name of its table there."""
    ident = f"{SYMBOLS_FORMAT}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    return ident, f"symbols-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


SYMBOLS_FORMAT = 1
_SYMBOLS_RE = re.compile(r"symbols-[0-9a-f]{24}\.json")
# Symbol tables kept in the cache: one a libcuda or libnccl build, and one a copy a user made (each
# a file of ~20 KB): past this many, the oldest go
MAX_SYMBOL_FILES = 64
MAX_SYMBOLS = 1 << 16  # entries of one cached table (a libcuda exports ~1,000 cu* functions)


def _cached_offsets(raw: bytes | None, ident: str, size: int) -> dict[str, int] | None:
    """A cached table, checked entry by entry (a cache file is input), or None."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        offsets = data["offsets"]
        if data["ident"] != ident or not isinstance(offsets, dict) or len(offsets) > MAX_SYMBOLS:
            return None
        for k, v in offsets.items():
            if not (k.startswith(HOOKED_PREFIXES) and len(k) <= 256 and type(v) is int and 0 <= v < size):
                return None
        return offsets
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_offsets(f, path: str) -> dict[str, int]:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    out: dict[str, int] = {}
    try:
        elf = ELFFile(f)
        loads = [(s["p_vaddr"], s["p_memsz"], s["p_offset"]) for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None:
            return out
        for sym in dynsym.iter_symbols():
            if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or sym["st_shndx"] == "SHN_UNDEF" \
                    or not sym.name.startswith(HOOKED_PREFIXES) or sym.name in out:
                continue
            v = sym["st_value"]
            for vaddr, memsz, offset in loads:
                if vaddr <= v < vaddr + memsz:
                    out[sym.name] = v - vaddr + offset
                    break
    except ELFError as e:
        raise OSError(f"{path} is not a readable ELF file: {e}") from None
    return out


# ---- the loaded program ------------------------------------------------------------------------
LINKS, PERF_EVENTS = "links", "perf_events"
ATTACH_MODES = ("auto", LINKS, PERF_EVENTS)
LINKS_SINCE = (6, 6)  # BPF_TRACE_UPROBE_MULTI
_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283}.get(platform.machine(), -1)  # -1: refused (ENOSYS)
_MEMBARRIER_CMD_GLOBAL = 1  # synchronize_rcu()
LAUNCH_GAPS = 4096  # launch-probe off times remembered (a 10 s duty cycle: 11 hours)
SYMBOL_BYTES = 192  # a symbolised frame kept, beside its text: its key and dict slot (charged to "stacks")
# an unwound allocation stack kept: its key, dict slot and tuple (RSS per stack kept, bench/stack_cost.py: 1.7 KiB for 7 frames)
UNWOUND_BYTES, UNWOUND_FRAME_BYTES = 1400, 44
# a stack no map entry holds is deleted once no call has taken it for this long (reclaim_stacks)
STACK_IDLE_NS = 1_000_000_000


# The maps with entries per process, removed when it exits (Loader.forget)
PROCESS_MAPS = ("stats", "hist", "errors", "live", "live_bytes", "inflight", "kernels", "names", "capture_streams",
                "capture_events", "captures", "execs", "launch_stacks", "py_procs", "py_seen", "comms", "ustack_seen",
                "ustack_copies", "ustack_count", "procs")


def _pid_of(name: str, key) -> int:
    """The process of a key of map `name`: a u32 key is the pid, inflight's the thread's pid_tgid."""
    return key.pid_tgid >> 32 if name == "inflight" else key.value if symbols.HASH_MAPS[name][0] == "u32" else key.pid


class NotAdmitted(Exception):
    """attach(admit=...) refused the library: its uprobes would take its user past their budget."""


def kernel_version(release: str | None = None) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release or platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def attach_method(mode: str = "auto") -> str:
    """links (one multi-uprobe link per library and kind: attach and detach in milliseconds) where
    the kernel has them (Linux >= 6.6), else perf_events (one perf event per probe: ~0.03 s to
    attach and ~0.1 s to detach each)."""
    if mode not in ATTACH_MODES:
        raise ValueError(f"attach mode {mode!r}: one of {', '.join(ATTACH_MODES)}")
    if mode != "auto":
        return mode
    return LINKS if kernel_version() >= LINKS_SINCE else PERF_EVENTS


def in_parallel(fn: Callable, items: list, threads: int) -> tuple[list, list[tuple[object, Exception]]]:
    """fn over items in up to `threads` threads, items taken in order: (results in the items' order,
    None where it failed; [(item, error)]). For system calls: ctypes drops the GIL in them, so the
    kernel's work (map allocation, the verifier, RCU waits) overlaps, and overlaps Python work in
    other threads."""
    results: list = [None] * len(items)
    errors: list[tuple[object, Exception]] = []
    todo = iter(enumerate(items))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                nxt = next(todo, None)
            if nxt is None:
                return
            try:
                results[nxt[0]] = fn(nxt[1])
            except Exception as e:  # noqa: BLE001 - given to the caller
                errors.append((nxt[1], e))

    workers = [threading.Thread(target=work, name="gpuwatch-ebpf-work", daemon=True)
               for _ in range(min(threads, len(items)) - 1)]
    for w in workers:
        w.start()
    try:
        work()
    finally:
        for w in workers:
            w.join()
    return results, errors


def _close_at_once(fds: list[int], threads: int = 16) -> None:
    """Close every link at once: each close waits for an RCU grace period (~25 ms on 6.18), and
    waits that overlap end together (one after another: 3 links took 75 ms). Entry before return
    no longer matters here: the maps are not read after close()."""
    in_parallel(bpfsys.close_all, [fds[i::threads] for i in range(min(threads, len(fds)))], threads)


@dataclass
class Library:
    path: str
    file: tuple[int, int]
    attached: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    uprobes: int = 0
    fds: list[int] = field(default_factory=list)  # links, then perf events: closing them detaches
    launch_probes: list[tuple[int, int]] = field(default_factory=list)  # (offset, cookie): links mode
    launch_fd: int | None = None  # the link of the launch entries, while they are on
    nccl: bool = False  # a libnccl (NCCL's hooks attached), not a libcuda


class Loader:
    """The probe's maps and programs, loaded into the kernel, and the uprobes attached from them.

    No bcc here: the compiled object comes from compiler.compiled() (cache or child), and maps,
    programs and links are plain bpf() calls (bpfsys)."""

    def __init__(self, pid: int | None = None, apis: Iterable[str] | None = None,
                 launch_latency: bool = False, events: bool = False, attach: str = "auto",
                 prefetch: Iterable[str] = ()) -> None:
        """pid: attach for this process only, or None: every process. apis: hook only these
        symbols. launch_latency: give the launch APIs a return probe too (latency, errors); by
        default they are counted at entry only (see symbols.timed). events: one gw_event per timed
        call in the ring buffer "events" (see events.py), created big enough only then.
        attach: auto | links | perf_events (see attach_method). prefetch: libraries that will be
        attached: their symbols are read while the kernel loads the programs."""
        self.pid = pid
        self.hooks = HOOKS if apis is None else tuple(h for h in HOOKS if h.name in set(apis))
        self.launch_latency = launch_latency
        self.events = events
        self.method = attach_method(attach)
        self.untimed = frozenset(h.name for h in self.hooks if not symbols.timed(h, launch_latency))
        self.libraries: dict[tuple[int, int], Library] = {}
        self.attach_seconds = 0.0
        self._closed = False
        self._detacher: threading.Thread | None = None
        self._stop = threading.Event()  # set at interpreter exit: a background detach stops
        self._symbols: dict[tuple[int, int], str] = {}  # (pid, address) -> symbolised frame
        self._symbol_batch: list[tuple[int, list[int], list[str]]] | None = None  # see symbols_batch()
        # what _symbols holds per process, charged to its user ("stacks"); None: not charged
        self.stack_ledger: budget_.Ledger | None = None
        # allocation stacks unwound from their copies (ustack_copies): (pid, stack id, caller, sp) ->
        # the return addresses, innermost first; () where unwinding found no more than the walk
        self._unwound: dict[tuple[int, int, int, int], tuple[int, ...]] = {}
        self.unwinder = unwind.Unwinder()
        self.unwind_seconds = 0.0  # spent unwinding, and stacks unwound (bench/stack_cost.py)
        self.unwound = 0
        self._symboliser: threading.Thread | None = None
        self._fds: list[int] = []  # maps and programs
        self.launches_on = True  # launch entry probes attached (see set_launches)
        # when they were off: [off, on or None] in CLOCK_MONOTONIC ns (bpf_ktime_get_ns's clock),
        # the last LAUNCH_GAPS of them: a graph captured meanwhile may miss nodes (launches_seen)
        self.launch_gaps: collections.deque = collections.deque(maxlen=LAUNCH_GAPS)
        check_environment(compiling=False)
        t0 = time.perf_counter()
        # file id -> the offsets of its hooked symbols, or why they could not be read (attach() says it)
        self._prefetched: dict[tuple[int, int], dict[str, int] | OSError] = {}
        self._prefetch: threading.Thread | None = None
        # file id -> a prefetched library whose return probes are attached already (with its entry
        # probes, for attach() to add), or why they could not be
        self._early: dict[tuple[int, int], tuple[Library, list, list] | OSError] = {}
        # bcc and kernel headers are needed only when nothing is cached: checked then, for their remedy
        obj = compiler.compiled(before_compiling=check_environment)
        paths = list(prefetch)
        if paths:  # Python work, after the cache's (the GIL): beside the kernel's
            self._prefetch = threading.Thread(target=self._read_symbols, args=(paths,), name="gpuwatch-ebpf-symbols",
                                              daemon=True)
            self._prefetch.start()
        self.compile_seconds = 0.0 if obj.cached else obj.compile_seconds
        self.cached = obj.cached
        try:
            self._load(obj, paths)
        except BaseException:
            self._close_unclaimed()
            bpfsys.close_all(self._fds)
            raise
        self.load_seconds = time.perf_counter() - t0
        atexit.register(self._at_exit)

    def _close_unclaimed(self) -> None:
        """Return probes linked while loading for a library attach() never took (the probe's start
        failed in between): detached with the rest."""
        for early in self._early.values():
            if isinstance(early, tuple):
                self._close_library(early[0])
        self._early.clear()

    def _read_symbols(self, paths: list[str]) -> None:
        for path in paths:
            fid = file_id(path)
            if fid is not None:
                try:
                    self._prefetched[fid] = function_offsets(path)
                except OSError as e:
                    self._prefetched[fid] = e

    def _symbols_of(self, fid: tuple[int, int], path: str) -> dict[str, int]:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
        got = self._prefetched.pop(fid, None)
        if isinstance(got, OSError):
            raise got
        return function_offsets(path) if got is None else got

    def _load(self, obj: compiler.CompiledObject, paths: list[str]) -> None:
        self.maps: dict[str, bpfsys.Map] = {}
        # nothing writes to "events" unless asked: one page then
        sizes = [m["max_entries"] if m["name"] != "events" or self.events else 4096 for m in obj.maps]
        # the large maps take milliseconds each to allocate: made at once

        def create(i: int) -> int:
            m = obj.maps[i]
            return bpfsys.map_create(m["type"], m["key_size"], m["value_size"], sizes[i], m["flags"], m["name"])

        fds, errors = in_parallel(create, list(range(len(obj.maps))), 4)
        self._fds += [fd for fd in fds if fd is not None]
        if errors:
            i, e = min(errors, key=lambda ie: ie[0])
            raise ProbeUnavailable(f"cannot create the eBPF map {obj.maps[i]['name']}: {getattr(e, 'strerror', None) or e} "
                                   f"(memlock limit? run as root with CAP_BPF; the unit sets LimitMEMLOCK=infinity)")
        for m, fd, entries in zip(obj.maps, fds, sizes):
            kv = symbols.MAP_TYPES.get(m["name"])
            if kv is not None:
                k, v = symbols.ctype(kv[0]), symbols.ctype(kv[1])
                if (ctypes.sizeof(k), ctypes.sizeof(v)) != (m["key_size"], m["value_size"]):
                    raise ProbeUnavailable(f"eBPF map {m['name']}: key/value of {m['key_size']}/{m['value_size']} "
                                           f"bytes, Python expects {ctypes.sizeof(k)}/{ctypes.sizeof(v)}")
                self.maps[m["name"]] = bpfsys.Map(fd, m["name"], k, v)
            if m["name"] == "events":
                self.events_map = (fd, entries)
            elif m["name"] == "graph_events":
                self.graph_ring = (fd, entries)
        expected = bpfsys.ATTACH_UPROBE_MULTI if self.method == LINKS else 0
        code = {name: obj.instructions(name, fds) for name in symbols.PROGRAMS}

        def load(name: str) -> int:
            fd = bpfsys.prog_load(code[name], name, obj.license, expected_attach_type=expected,
                                  kern_version=obj.kern_version)
            if name == "gw_return" and self.method == LINKS:
                # The first link waits for an RCU grace period (10-40 ms): the return probes of the
                # libraries named go on while the kernel still verifies the entry program.
                for path in paths:
                    self._link_returns_early(path, fd)
            return fd

        # the verifier takes tens of milliseconds a program: both at once
        progs, errors = in_parallel(load, list(code), len(code))
        self._fds += [fd for fd in progs if fd is not None]
        for _, e in errors:
            if isinstance(e, bpfsys.VerifierError):
                log.warning("%s; the verifier said:\n%s", e, e.log)
                raise ProbeUnavailable(f"{e} (the verifier's log is in the agent's log)") from None
        if errors:
            raise errors[0][1]
        self.progs: dict[str, int] = dict(zip(code, progs))

    # -- attach / detach ---------------------------------------------------------------------
    def attach(self, path: str, admit: Callable[[int], bool] | None = None) -> Library | None:
        """Attach every hooked symbol the file has; None when this file is already attached.
        admit(n): whether n uprobes may be attached to it (a budget); NotAdmitted when not."""
        fid = file_id(path)
        if fid is None:
            raise FileNotFoundError(path)
        if fid in self.libraries:
            return None
        if self._closed:
            raise RuntimeError("the loader is closed")
        t0 = time.perf_counter()
        early = self._early.pop(fid, None)
        if isinstance(early, OSError):
            raise self._attach_error(path, early)
        lib, entries, returns = early or self._plan(path, fid)
        if admit is not None and not admit(len(entries) + len(returns) + len(lib.launch_probes)):
            self._close_library(lib)
            raise NotAdmitted(path)
        try:
            # Return probes first: a call entered between the two attaches then has no entry
            # record and is not counted, rather than leaving a stale in-flight record.
            if returns and early is None:
                self._attach(lib, path, returns, True)
            if entries:
                self._attach(lib, path, entries, False)
            if lib.launch_probes and self.launches_on:
                lib.launch_fd = self._link(path, lib.launch_probes, False)
                lib.uprobes += len(lib.launch_probes)
        except OSError as e:
            self._close_library(lib)
            raise self._attach_error(path, e) from None
        self.libraries[fid] = lib
        self.attach_seconds += time.perf_counter() - t0
        if lib.skipped:
            log.info("%s: %d symbols hooked, not present: %s", path, len(lib.attached), ", ".join(lib.skipped))
        return lib

    def _plan(self, path: str, fid: tuple[int, int]) -> tuple[Library, list, list]:
        """The library, its entry and its return probes ((offset, cookie)), from its symbols."""
        lib = Library(path, fid)
        try:
            present = self._symbols_of(fid, path)
        except OSError as e:
            log.warning("cannot read the symbols of %s: %s", path, e)
            present = {}
        entries, returns = [], []  # (offset, cookie)
        # a libnccl gets NCCL's hooks, anything else the driver's: what it lacks of the other's is no news
        lib.nccl = any(h.group == "nccl" and h.name in present for h in self.hooks)
        for hook in (h for h in self.hooks if (h.group == "nccl") == lib.nccl):
            off = present.get(hook.name)
            if off is None:
                lib.skipped.append(hook.name)
                continue
            lib.attached.append(hook.name)
            entry = (off, symbols.entry_cookie(hook, self.launch_latency))
            # links: launch entries in a link of their own, which set_launches() can take away
            (lib.launch_probes if self.method == LINKS and hook.name in SAMPLED_APIS else entries).append(entry)
            if hook.name not in self.untimed:
                returns.append((off, symbols.return_cookie(hook, self.events)))
        return lib, entries, returns

    def _attach_error(self, path: str, e: OSError) -> Exception:
        if e.errno == errno.ESRCH and self.pid:
            return ProbeUnavailable(f"process {self.pid} does not exist")
        return OSError(e.errno, f"attaching to {path}: {e.strerror or e}")

    def _link_returns_early(self, path: str, prog: int) -> None:
        fid = file_id(path)
        if fid is None or fid in self._early:
            return  # attach() finds it gone, or has it already
        lib, entries, returns = self._plan(path, fid)
        try:
            if returns:
                lib.fds.append(self._link(path, returns, True, prog))
                lib.uprobes += len(returns)
        except OSError as e:
            self._close_library(lib)
            self._early[fid] = e
            return
        self._early[fid] = (lib, entries, returns)

    def _link(self, path: str, probes: list[tuple[int, int]], retprobe: bool, prog: int | None = None) -> int:
        prog = self.progs["gw_return" if retprobe else "gw_entry"] if prog is None else prog
        return bpfsys.uprobe_multi_link(prog, path,
                                        [o for o, _ in probes], [c for _, c in probes], pid=self.pid or 0,
                                        retprobe=retprobe)

    def _attach(self, lib: Library, path: str, probes: list[tuple[int, int]], retprobe: bool) -> None:
        if self.method == LINKS:
            lib.fds.append(self._link(path, probes, retprobe))
            lib.uprobes += len(probes)
            return
        prog = self.progs["gw_return" if retprobe else "gw_entry"]
        for off, cookie in probes:
            pfd = bpfsys.perf_uprobe(path, off, -1 if self.pid is None else self.pid, retprobe)
            lib.fds.append(pfd)
            lib.fds.append(bpfsys.perf_event_link(prog, pfd, cookie))
            lib.uprobes += 1

    def launches_seen(self, begin_ns: int, end_ns: int) -> bool:
        """Whether the launch probes were on all the time from begin_ns to end_ns (CLOCK_MONOTONIC)."""
        if len(self.launch_gaps) == self.launch_gaps.maxlen and begin_ns < self.launch_gaps[0][0]:
            return False  # older than what is remembered
        return not any(off <= end_ns and (on is None or on >= begin_ns) for off, on in self.launch_gaps)

    @property
    def can_toggle_launches(self) -> bool:
        return self.method == LINKS

    def set_launches(self, on: bool) -> None:
        """Attach (on) or detach the launch APIs' entry probes of every library: the per-launch cost
        goes with them (links mode only: a link comes and goes in well under a millisecond)."""
        if not self.can_toggle_launches or on == self.launches_on or self._closed:
            return
        self.launches_on = on
        if on and self.launch_gaps:
            self.launch_gaps[-1][1] = time.monotonic_ns()
        elif not on:
            self.launch_gaps.append([time.monotonic_ns(), None])
        for lib in self.libraries.values():
            if on and lib.launch_probes and lib.launch_fd is None:
                try:
                    lib.launch_fd = self._link(lib.path, lib.launch_probes, False)
                except OSError as e:
                    log.warning("cannot attach the launch probes of %s again: %s", lib.path, e)
                    continue
                lib.uprobes += len(lib.launch_probes)
            elif not on and lib.launch_fd is not None:
                os.close(lib.launch_fd)
                lib.launch_fd = None
                lib.uprobes -= len(lib.launch_probes)

    def detach(self, fid: tuple[int, int]) -> bool:
        """Detach one library (its file is no longer mapped anywhere); False when not attached."""
        lib = self.libraries.pop(fid, None)
        if lib is None:
            return False
        self._close_library(lib)
        return True

    def _close_library(self, lib: Library) -> None:
        # Entry probes first (attached last): no call starts being timed that no return probe finishes.
        if lib.launch_fd is not None:
            os.close(lib.launch_fd)
            lib.launch_fd = None
        for fd in reversed(lib.fds):
            if self._stop.is_set():
                return  # exiting: the kernel closes the rest
            with contextlib.suppress(OSError):
                os.close(fd)
        lib.fds.clear()

    @property
    def uprobe_count(self) -> int:
        return sum(lib.uprobes for lib in self.libraries.values()) if not self._closed else 0

    def close(self, wait: bool = True) -> None:
        """Detach everything and free the maps. Idempotent.

        Links close in milliseconds. Perf-event uprobes (the fallback) do not: closing each waits
        for an RCU grace period under a global mutex (~0.08-0.1 s each on 6.18). wait=False:
        return at once and detach in a daemon thread (`wait_closed()` waits for it); should the
        interpreter exit first, the thread stops between two probes (see _at_exit) and the
        kernel releases the rest when it closes the process's file descriptors.
        The maps must not be read after close()."""
        if self._closed:
            return
        self._closed = True
        if wait or self.method == LINKS:
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
        # A task being killed at exit (exit_group kills the other threads) that is unregistering a
        # perf-event uprobe fails to restore the original instruction in the traced processes
        # (measured on 6.18: the int3 stayed in the driver's text), while the kernel's own closing
        # of the fds at exit restores everything: a background detach stops first.
        t = self._detacher
        if t is not None and t.is_alive():
            self._stop.set()
            t.join(5.0)
            return
        if not self._closed:
            try:
                self.close()
            except Exception as e:  # at interpreter exit: say it, do not raise
                log.warning("detaching at exit: %s", e)

    def _detach(self) -> None:
        t0 = time.perf_counter()
        self._close_unclaimed()
        n = sum(lib.uprobes for lib in self.libraries.values())
        if self.method == LINKS:
            _close_at_once([fd for lib in self.libraries.values() for fd in
                            ([lib.launch_fd] if lib.launch_fd is not None else []) + lib.fds])
            for lib in self.libraries.values():
                lib.launch_fd = None
                lib.fds.clear()
        for lib in list(self.libraries.values()):
            self._close_library(lib)
            if self._stop.is_set():
                log.info("exiting: the uprobes left are released by the kernel")
                return
        self.libraries.clear()
        bpfsys.close_all(self._fds)
        self._fds.clear()
        atexit.unregister(self._at_exit)  # lets the Loader be garbage-collected
        log.info("detached %d uprobes (%s) in %.3f s", n, self.method.replace("_", "-"), time.perf_counter() - t0)

    def freeze(self) -> None:
        """Stop every program from counting, all at once (frozen[0] = 1): from here on the maps hold
        the counts of one instant, so that reads of several maps agree (the end of a trace). The
        uprobes stay attached (detaching one by one would stop some counts before others)."""
        u32 = symbols.ctype("u32")
        self.maps["frozen"].update(u32(0), u32(1))
        # A program that read frozen == 0 just before may still be adding: uprobe programs run
        # under rcu_read_lock, so one RCU grace period (membarrier GLOBAL's synchronize_rcu) sees
        # every one of them through. Where membarrier is refused, a few ms do it in practice.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_MEMBARRIER, _MEMBARRIER_CMD_GLOBAL, 0, 0) != 0:
            time.sleep(0.05)

    # -- maps ----------------------------------------------------------------------------------
    def stats(self) -> dict[tuple[int, str], tuple[int, int, int, int]]:
        """(pid, api) -> (calls, errors, ns, bytes)."""
        out = {}
        for k, v in self.maps["stats"].items():
            if k.api < len(API_NAMES):
                out[(k.pid, API_NAMES[k.api])] = (v.calls, v.errors, v.ns, v.bytes)
        return out

    def errors(self, pid: int | None = None) -> dict[tuple[int, str], dict[int, int]]:
        """(pid, api) -> {CUresult: calls that returned it} (errors only: CUresult != 0)."""
        out: dict[tuple[int, str], dict[int, int]] = {}
        for k, v in self.maps["errors"].items():
            if (pid is None or k.pid == pid) and k.api < len(API_NAMES):
                out.setdefault((k.pid, API_NAMES[k.api]), {})[k.code] = v.value
        return out

    def live_bytes(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self.maps["live_bytes"].items()}

    def live_by_stack(self, pid: int) -> dict[tuple[int, int, int], tuple[int, int]]:
        """Live allocations of a process by the user stack that made them: (stack id, return
        address, stack pointer) -> (bytes, allocations); stack id -1 where the stack could not be taken."""
        out: dict[tuple[int, int, int], tuple[int, int]] = {}
        for p, size, stack, caller, sp in self._live_records():
            if p == pid:
                b, n = out.get((stack, caller, sp), (0, 0))
                out[(stack, caller, sp)] = (b + size, n + 1)
        return out

    def live_by_pid_stack(self) -> dict[tuple[int, int, int, int], int]:
        """Live bytes of every process by allocating stack, in one pass over the live allocations:
        (pid, stack id, return address, stack pointer) -> bytes."""
        out: dict[tuple[int, int, int, int], int] = {}
        for pid, size, stack, caller, sp in self._live_records():
            k = (pid, stack, caller, sp)
            out[k] = out.get(k, 0) + size
        return out

    def _live_records(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Every live allocation as (pid, size, stack id, return address, stack pointer). Each
        collection and each refresh of a trace may ask, so the records are read in batches and
        decoded with struct (0.5 us an allocation, not 2 through ctypes: a trace's refresh read
        88,000 live allocations one by one for 0.2 s while the process went on allocating)."""
        m = self.maps["live"]
        key_of, value_of = _fields(m.key_type, ("pid", "I")), _fields(m.value_type, ("size", "Q"), ("stack", "i"),
                                                                      ("caller", "Q"), ("sp", "Q"))
        batches = m.raw_batches()
        try:
            first = next(batches, None)
        except OSError as e:
            if e.errno not in (22, 95, 524):  # no batch ops here (as Map.items)
                raise
            for k, v in m.items():
                yield k.pid, v.size, v.stack, v.caller, v.sp
            return
        for keys, values, _n in itertools.chain([first] if first is not None else [], batches):
            for (pid,), (size, stack, caller, sp) in zip(key_of.iter_unpack(keys), value_of.iter_unpack(values)):
                yield pid, size, stack, caller, sp

    # ---- allocation stacks without frame pointers (unwind.py) ---------------------------------
    def unwind_copies(self, limit: int = symbols.MAP_SIZES["USTACK_COPIES_MAX"]) -> int:
        """Unwind the stack copies waiting in the kernel (at most `limit`) and free them: their
        map is bounded node-wide, so each collection empties it. Returns how many were unwound."""
        keys = self.maps["ustack_copies"].keys()[:limit]
        maps: dict[int, list[unwind.Mapping]] = {}
        for k in keys:
            self._unwind_copy(k, maps)
        return len(keys)

    def _unwind_copy(self, k, maps: dict[int, list[unwind.Mapping]]) -> tuple[int, ...] | None:
        copies = self.maps["ustack_copies"]
        v = copies.lookup(k)
        copies.delete(k)
        if v is None:
            return None
        key = (k.pid, k.stack, k.caller, k.sp)
        t0 = time.perf_counter()
        if k.pid not in maps:
            maps[k.pid] = unwind.read_maps(k.pid)
        frames = self.unwinder.unwind(k.pid, v.ip, v.sp, v.bp, bytes(v.data)[:min(v.len, unwind.STACK_BYTES)],
                                      maps[k.pid])
        self.unwind_seconds += time.perf_counter() - t0
        self.unwound += 1
        chain = tuple(frames) if len(frames) > 2 else ()  # no further than the API and its caller: the walk's
        ledger = self.stack_ledger
        if ledger is not None and not ledger.charge(k.pid, UNWOUND_BYTES + UNWOUND_FRAME_BYTES * len(chain)):
            # over the user's budget: no more copies of this process (its stacks are the walk's)
            self.maps["ustack_count"].update(symbols.ctype("u32")(k.pid),
                                             symbols.ctype("u32")(symbols.USTACKS_PER_PID))
            return None
        self._unwound[key] = chain
        return chain

    def unwound_stack(self, pid: int, stack_id: int, caller: int, sp: int) -> tuple[int, ...] | None:
        """The unwound return addresses of an allocating stack (its copy unwound now if it is
        waiting), None when there is none (not copied: the process's copies or the budget ran out)."""
        key = (pid, stack_id, caller, sp)
        chain = self._unwound.get(key)
        if chain is None and sp:
            k = symbols.ctype("gw_ustack_key")(pid=pid, stack=stack_id, caller=caller, sp=sp)
            chain = self._unwind_copy(k, {})
        return chain or None

    def stack_addresses(self, stack_id: int, caller: int, limit: int = symbols.STACK_DEPTH + 1,
                        pid: int = 0, sp: int = 0) -> list[int]:
        """An allocation's stack as addresses, innermost first: the API, its caller, then its
        callers, unwound from the stack's copy with the binaries' CFI where there is one (pid and sp
        given), else the frame-pointer walk."""
        if pid and sp:
            chain = self.unwound_stack(pid, stack_id, caller, sp)
            if chain:
                return list(chain[:limit])
        addrs: list[int] = []
        if stack_id >= 0:
            table, index = self._stack_slot(stack_id)
            v = self.maps[table].lookup(symbols.ctype("u32")(index))
            if v is not None:
                addrs = [a for a in v.ip if a][:limit]
        if caller:  # the walk from the API's first instruction skips its caller
            addrs = addrs[:1] + [caller] + addrs[1:]
        return addrs[:limit]

    def stack_frames(self, stack_id: int, caller: int, pid: int, limit: int = 16, wait: bool = True,
                     sp: int = 0) -> list[str]:
        """The frames of an allocation's stack, innermost first (the API, its caller, ...),
        symbolised and demangled by bcc (in a child, once per address) in the process's binaries:
        "function+0x1c [library]", or the address when nothing names it. With frame pointers
        missing (most optimised builds) the walk stops early: the API and its caller are there.
        wait=False: addresses not symbolised yet are given as hex now and symbolised in the
        background (a live view must not wait for the child)."""
        addrs = self.stack_addresses(stack_id, caller, limit, pid=pid, sp=sp)
        unknown = [a for a in dict.fromkeys(addrs) if (pid, a) not in self._symbols]
        if unknown:
            if wait and self._symbol_batch is not None:  # named at the batch's end, with the others
                frames = [f"{a:#x}" for a in addrs]
                self._symbol_batch.append((pid, addrs, frames))
                return frames
            if wait:
                self._symbolise(pid, unknown)
            elif self._symboliser is None or not self._symboliser.is_alive():
                self._symboliser = threading.Thread(target=self._symbolise, args=(pid, unknown),
                                                    name="gpuwatch-ebpf-symbols", daemon=True)
                self._symboliser.start()
        return [self._symbols.get((pid, a), f"{a:#x}") for a in addrs]

    @contextlib.contextmanager
    def symbols_batch(self) -> Iterator[None]:
        """Within it, stack_frames(wait=True) names its frames at the end, all of them from one
        bcc child (~0.2 s each: a snapshot with ten stacks took ten, 2 s at the end of a trace)."""
        outer, self._symbol_batch = self._symbol_batch, []
        try:
            yield
        finally:
            batch, self._symbol_batch = self._symbol_batch, outer
            by_pid: dict[int, dict[int, None]] = {}
            for pid, addrs, _frames in batch:
                by_pid.setdefault(pid, {}).update((a, None) for a in addrs if (pid, a) not in self._symbols)
            for pid, unknown in by_pid.items():
                if unknown:
                    self._symbolise(pid, list(unknown))
            for pid, addrs, frames in batch:
                frames[:] = [self._symbols.get((pid, a), f"{a:#x}") for a in addrs]

    def _symbolise(self, pid: int, addrs: list[int]) -> None:
        if not os.path.exists(f"/proc/{pid}"):
            return  # bcc reads the process's maps: a process that exited leaves addresses (and no child to start)
        try:
            names = compiler.symbolise(pid, addrs)
        except ProbeUnavailable as e:
            log.debug("symbolising process %d: %s", pid, e)
            return
        ledger = self.stack_ledger
        self._symbols.update(((pid, a), name) for a, name in zip(addrs, names)
                             if ledger is None or ledger.charge(pid, SYMBOL_BYTES + len(name)))

    def live_allocations(self, pid: int | None = None) -> int:
        return sum(1 for k in self.maps["live"].keys() if pid is None or k.pid == pid)

    def histogram(self, pid: int | None = None) -> dict[str, dict[int, int]]:
        """api -> {log2 slot: count}; slot s (bcc's bpf_log2l) holds latencies in [2**(s-1), 2**s) ns; slot 0: 0 ns."""
        out: dict[str, dict[int, int]] = {}
        for k, v in self.maps["hist"].items():
            if (pid is None or k.pid == pid) and k.api < len(API_NAMES):
                slots = out.setdefault(API_NAMES[k.api], {})
                slots[k.slot] = slots.get(k.slot, 0) + v.value
        return out

    def kernels(self, pid: int | None = None) -> dict[tuple[int, int], dict]:
        """(pid, CUfunction handle) -> {"launches", "degenerate_launches", "grid", "block",
        "shared_mem_bytes", "stream"} (grid, block, shared memory and stream of the last launch)."""
        out = {}
        for k, v in self.maps["kernels"].items():
            if pid is None or k.pid == pid:
                out[(k.pid, k.handle)] = {
                    "launches": v.launches, "degenerate_launches": v.degenerate,
                    "grid": [v.dims.grid_x, v.dims.grid_y, v.dims.grid_z],
                    "block": [v.dims.block_x, v.dims.block_y, v.dims.block_z],
                    "shared_mem_bytes": v.shared_mem, "stream": v.stream}
        return out

    def launch_stacks(self, pid: int) -> dict[int, list[tuple[int, int, int, tuple]]]:
        """Kernel handle -> [(sampled launches, stack id, return address, ((code object, byte
        offset of its instruction), ...) Python frames innermost first)], busiest first."""
        out: dict[int, list] = {}
        for k, v in self.maps["launch_stacks"].items():
            if k.pid == pid:
                py = tuple((k.code[i], k.instr[i]) for i in range(symbols.PY_DEPTH) if k.code[i])
                out.setdefault(k.handle, []).append((v.value, k.stack, k.caller, py))
        for stacks in out.values():
            stacks.sort(key=lambda s: (-s[0], s[1], s[2]))
        return out

    def set_python(self, pid: int, interp_ptr: int, offsets: dict) -> None:
        """Read the Python frames of this process's launches (pyframes: where its interpreter is)."""
        v = symbols.ctype("gw_py")(interp_ptr=interp_ptr, **offsets)
        self.maps["py_procs"].update(symbols.ctype("u32")(pid), v)

    def execs(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(pid, executable graph) -> (serial: when it was instantiated, 0 before the probe
        attached; launches)."""
        return {(k.pid, k.handle): (v.serial, v.launches) for k, v in self.maps["execs"].items()}

    def names(self, pid: int | None = None) -> dict[tuple[int, int, int], tuple[bytes, bool]]:
        """(pid, symbols.NAME_FUNCTION or NAME_KERNEL, handle) -> (name as the process gave it, up
        to NAME_LEN - 1 bytes; truncated)."""
        out = {}
        for k, v in self.maps["names"].items():
            if pid is None or k.pid == pid:
                out[(k.pid, k.kind, k.handle)] = (bytes(v.name)[:min(v.len, symbols.NAME_LEN - 1)], bool(v.truncated))
        return out

    def communicators(self) -> list[dict]:
        """Every NCCL communicator of every process: {"pid", "comm" (the ncclComm_t), "id" (0: its
        init was not seen), "rank" (-1: unknown), "nranks" (0: unknown), "calls", "bytes", "seq"
        (collectives so far), "destroyed", "entries": [(seq, API name, entry time in CLOCK_MONOTONIC
        ns)] of the last symbols.NCCL_RING collectives, oldest first}."""
        out = []
        ring = symbols.NCCL_RING
        for k, v in self.maps["comms"].items():
            entries = []
            for s in range(max(0, v.seq - ring), v.seq):
                slot = s % ring
                # a slot rewritten since (a newer collective) or not written yet is left out
                if v.slot_seq[slot] == (s + 1) & 0xFFFFFFFF and v.slot_api[slot] < len(API_NAMES):
                    entries.append((s, API_NAMES[v.slot_api[slot]], v.ts[slot]))
            out.append({"pid": k.pid, "comm": k.handle, "id": v.id, "rank": v.rank, "nranks": v.nranks,
                        "calls": v.calls, "bytes": v.bytes, "seq": v.seq, "destroyed": bool(v.destroyed),
                        "entries": entries})
        return out

    def dropped(self) -> int:
        return sum(v.value for _k, v in self.maps["dropped"].items())

    def dropped_by_kind(self) -> dict[str, int]:
        """What was not recorded, by what (symbols.DROPPED_KINDS), where anything was."""
        return {symbols.DROPPED_KINDS[k.value]: v.value for k, v in self.maps["dropped"].items()
                if v.value and k.value < len(symbols.DROPPED_KINDS)}

    def forget(self, pids: set[int]) -> None:
        """Remove every map entry of these processes (they exited)."""
        if not pids:
            return
        for name in PROCESS_MAPS:
            table = self.maps[name]
            for k in table.keys():
                if _pid_of(name, k) in pids:
                    table.delete(k)
        if self._symbols:
            self._symbols = {k: v for k, v in self._symbols.items() if k[0] not in pids}
        if self._unwound:
            self._unwound = {k: v for k, v in self._unwound.items() if k[0] not in pids}
        if self.stack_ledger is not None:
            for pid in pids:
                self.stack_ledger.release(pid)

    def held_stacks(self) -> set[int]:
        """The stack ids some map entry holds: live allocations, calls in flight, sampled launches
        and the stack copies' keys."""
        held = {stack for _pid, _size, stack, _caller, _sp in self._live_records()}
        held.update(v.stack for _k, v in self.maps["inflight"].items())
        for name in ("launch_stacks", "ustack_seen", "ustack_copies"):
            held.update(k.stack for k, _v in self.maps[name].items())  # batched, not a syscall a key
        return held

    @staticmethod
    def _stack_slot(stack_id: int) -> tuple[str, int]:
        """The map and index of a stack id: ids from STACKS_MAX on are the overflow map's."""
        first = symbols.MAP_SIZES["STACKS_MAX"]
        return ("stacks", stack_id) if stack_id < first else ("stacks_overflow", stack_id - first)

    def reclaim_stacks(self, idle_ns: int = STACK_IDLE_NS) -> set[int]:
        """Delete the stacks no map entry holds and none has taken for idle_ns (the stack maps are
        hashed: a dead process's stacks would take the buckets of new ones). Returns the ids deleted."""
        first, used, u32 = symbols.MAP_SIZES["STACKS_MAX"], self.maps["stack_used"], symbols.ctype("u32")
        ids = {k.value for k in self.maps["stacks"].keys()} | \
            {first + k.value for k in self.maps["stacks_overflow"].keys()}
        if not ids:
            return set()
        unheld = ids - self.held_stacks()
        gone = set()
        for sid in sorted(unheld):
            # read just before the delete: a call that took the id after held_stacks() read the
            # maps has marked it (a call between this read and the delete loses its stack: ~1 us
            # after the stack was idle for idle_ns, accepted)
            t = used.lookup(u32(sid))
            if t is not None and time.monotonic_ns() - t.value < idle_ns:
                continue
            table, index = self._stack_slot(sid)
            if self.maps[table].delete(u32(index)):
                gone.add(sid)
        return gone

    def pids(self) -> set[int]:
        """Every process with an entry in any map."""
        return {_pid_of(name, k) for name in ("stats", "live_bytes", "inflight", "kernels", "names", "execs", "comms")
                for k in self.maps[name].keys()}
