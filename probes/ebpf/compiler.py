"""bcc in a short-lived child process: compile the probe to a BPF object, symbolise addresses.

`import bcc` maps LLVM and clang into the process (~65 MiB RSS before compiling, ~130 MiB after),
and nothing frees it. The agent runs for months, so bcc never enters it: a child
(`python -m gpuwatch.probes.ebpf.bcc_child`) compiles the C text and prints the object — each
program's instructions with its map references as indices, each map's definition — and exits; the
agent creates the maps and loads the programs itself (bpfsys.py). Stack symbolisation, rare (a
leak's stacks, a trace's summary), runs the same way.

The object is cached (`cache_dir()`), keyed by the C text, the kernel release and bcc's version,
so only the first start on a machine pays for compiling (seconds); later starts, `gpuwatch trace`
included, load in milliseconds. The cache holds code the kernel will run as root: it is read only
from a directory owned by this user (or root) that no one else may write, from a file likewise,
and must carry its own key.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import stat
import struct
import subprocess
import sys
from pathlib import Path

from gpuwatch.agent import safefile
from gpuwatch.agent.api import ProbeUnavailable
from gpuwatch.probes.ebpf import symbols

log = logging.getLogger("gpuwatch.ebpf")

BPF_SOURCE = Path(__file__).with_name("cuda.bpf.c")
FORMAT = 1  # of the object; a change makes old cache files misses
CHILD_TIMEOUT = 120.0  # seconds: compiling takes 1-6 s on the machines measured
LD_IMM64, PSEUDO_MAP_FD = 0x18, 1
CACHE_ENV = "GPUWATCH_BPF_CACHE"  # a directory, or "off"
MAP_NAMES = (*symbols.HASH_MAPS, "stacks", "stacks_overflow", "stack_used", "events", "graph_events", "name_buf",
             "lstack_buf", "dropped", "frozen", "comm_zero", "ustack_buf")
MAP_FIELDS = ("type", "key_size", "value_size", "max_entries", "flags")
MAX_PROGRAM_BYTES = 1 << 20


def bpf_text() -> str:
    src = BPF_SOURCE.read_text()
    return src.replace("GW_DEFINITIONS", symbols.render_c()).replace("GW_PROGRAMS", symbols.render_programs())


def cache_dir() -> str | None:
    """Where compiled objects are kept: $GPUWATCH_BPF_CACHE ("off": nowhere), else
    /var/cache/gpuwatch/ebpf as root (the unit's CacheDirectory), else $XDG_CACHE_HOME/gpuwatch/ebpf."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return None if env == "off" else env
    if os.geteuid() == 0:
        return "/var/cache/gpuwatch/ebpf"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "gpuwatch", "ebpf")


def bcc_version() -> str:
    """bcc's version without importing it (the import is what this module keeps out of the agent):
    its version.py (0.1 ms), else its distribution's metadata (importlib.metadata: 15 ms)."""
    import importlib.util
    spec = importlib.util.find_spec("bcc")
    if spec is None or not spec.origin:
        return "absent"
    with contextlib.suppress(OSError):
        return Path(spec.origin).with_name("version.py").read_text().split("=")[-1].strip().strip("'\"")
    with contextlib.suppress(Exception):
        from importlib.metadata import version
        return version("bcc")
    return "unknown"


def cache_key(text: str) -> str:
    h = hashlib.sha256()
    for part in (str(FORMAT), platform.release(), bcc_version(), text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


class CompiledObject:
    """The probe as the child compiled it: programs (instructions, map references) and maps."""

    def __init__(self, data: dict) -> None:
        """Checked field by field (ValueError): a cache file is input, whoever wrote it."""
        def u32(v) -> int:
            if type(v) is not int or not 0 <= v < 1 << 32:
                raise ValueError(f"{v!r} is not a 32-bit unsigned integer")
            return v
        self.key = str(data["key"])
        self.license = str(data["license"])
        if self.license != "GPL":
            raise ValueError(f"license {self.license!r}: the probe is GPL")
        self.kern_version = u32(data["kern_version"])
        self.maps: list[dict] = [{"name": str(m["name"]), **{k: u32(m[k]) for k in MAP_FIELDS}} for m in data["maps"]]
        names = [m["name"] for m in self.maps]
        if sorted(names) != sorted(MAP_NAMES):
            raise ValueError(f"maps {names}: expected {list(MAP_NAMES)}")
        if sorted(data["programs"]) != sorted(symbols.PROGRAMS):
            raise ValueError(f"programs {sorted(data['programs'])}: expected {list(symbols.PROGRAMS)}")
        self.programs: dict[str, dict] = {}
        for name in symbols.PROGRAMS:
            prog = data["programs"][name]
            code = base64.b64decode(prog["insns"], validate=True)
            if not code or len(code) % 8 or len(code) > MAX_PROGRAM_BYTES:
                raise ValueError(f"program {name}: {len(code)} bytes is not a program")
            refs = [(u32(i), u32(m)) for i, m in prog["maps"]]
            for idx, m in refs:
                if m >= len(names) or idx >= len(code) // 8 or code[idx * 8] != LD_IMM64:
                    raise ValueError(f"program {name}: reference to map {m} at instruction {idx} is not a map load")
            self.programs[name] = {"insns": code, "maps": refs}
        self.compile_seconds = float(data.get("compile_seconds", 0.0))
        self.cached = False

    def instructions(self, name: str, fds: list[int]) -> bytes:
        """Program `name`'s instructions with the map references pointing at these map fds (in
        the order of self.maps)."""
        prog = self.programs[name]
        code = bytearray(prog["insns"])
        for idx, m in prog["maps"]:
            struct.pack_into("<i", code, idx * 8 + 4, fds[m])
        return bytes(code)


def compiled(timeout: float = CHILD_TIMEOUT, before_compiling=None) -> CompiledObject:
    """The compiled probe, from the cache or a child that compiles it now (ProbeUnavailable).
    before_compiling(): called on a cache miss only, to refuse with a remedy what the child
    would fail on (loader.check_environment: bcc, kernel headers)."""
    text = bpf_text()
    key = cache_key(text)
    raw = read_cache(f"{key}.json")
    if raw is not None:
        try:
            data = json.loads(raw)
            if data.get("key") == key:
                obj = CompiledObject(data)
                obj.cached = True
                return obj
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("the cached eBPF probe is not usable (%s): compiling again", e)
    if before_compiling is not None:
        before_compiling()
    data = _child(["compile"], text.encode(), timeout)
    data["key"] = key
    obj = CompiledObject(data)
    log.info("bcc compiled the eBPF probe in %.2f s in a child process (peak RSS %s MiB, all of it gone with "
             "the child)", obj.compile_seconds, data.get("child_peak_rss_mib", "?"))
    write_cache(f"{key}.json", json.dumps(data).encode(), prune=lambda n: _OBJECT_RE.fullmatch(n) is not None)
    return obj


_OBJECT_RE = re.compile(r"[0-9a-f]{32}\.json")
MAX_CACHED = 16 << 20  # bytes read of one cache file


def read_cache(name: str) -> bytes | None:
    """A file of the cache, or None: absent, or not to be trusted (it, or its directory, may be
    written by someone else: said once). The directory is opened safely (safefile.Dir)."""
    where = cache_dir()
    if not where or not os.path.isdir(where):
        return None  # nothing cached yet
    try:
        with safefile.Dir(where) as d:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d.fd)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
                    _say_once(f"ignoring {d.join(name)}: it belongs to uid {st.st_uid} or others may write it")
                    return None
                return f.read(MAX_CACHED)
    except FileNotFoundError:
        return None
    except OSError as e:
        _say_once(f"the eBPF cache in {where} is not usable ({e}): compiling again")
        return None


def write_cache(name: str, data: bytes, prune=None, keep: int = 0) -> None:
    """Put a file in the cache (atomically); of the other files for which prune(name) is true, all
    but the `keep` newest go."""
    where = cache_dir()
    if not where:
        return
    try:
        with safefile.Dir(where, create=True) as d:
            d.write_atomic(name, data, 0o600, fsync=False)
            if prune is not None:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=d.fd)
                try:
                    names = [n for n in os.listdir(fd) if n != name and prune(n)]
                finally:
                    os.close(fd)
                if keep:  # the oldest go
                    def age(n: str) -> int:
                        try:
                            return os.stat(n, dir_fd=d.fd, follow_symlinks=False).st_mtime_ns
                        except OSError:
                            return 0
                    names = sorted(names, key=age)[:max(0, len(names) - keep)]
                for other in names:
                    with contextlib.suppress(OSError):
                        d.remove(other)
    except OSError as e:
        _say_once(f"the eBPF cache in {where} cannot be written (each start compiles again): {e}")


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("%s", message)


def symbolise(pid: int, addrs: list[int], timeout: float = 30.0) -> list[str]:
    """Each address of process pid as "function+0x1c [library]" (demangled) or as hex, by bcc's
    symboliser, in a child."""
    if not addrs:
        return []
    out = _child(["symbolise", str(pid)], json.dumps(addrs).encode(), timeout)
    names = out.get("names")
    if not isinstance(names, list) or len(names) != len(addrs) or not all(isinstance(n, str) for n in names):
        raise ProbeUnavailable("the stack symboliser answered something else than one name per address")
    return names


def _child(args: list[str], stdin: bytes, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "gpuwatch.probes.ebpf.bcc_child", *args]
    try:
        # its own session: a Ctrl-C at the terminal goes to the trace (which then ends cleanly),
        # not to a child that would die with a traceback in the middle of its answer
        p = subprocess.run(cmd, input=stdin, capture_output=True, timeout=timeout, check=False,
                           start_new_session=True)
    except subprocess.TimeoutExpired:
        raise ProbeUnavailable(f"bcc did not finish `{args[0]}` within {timeout:g} s") from None
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip()
        last = err.splitlines()[-1] if err else f"exit status {p.returncode}"
        if p.returncode == 3:  # the child's own words (no bcc, no headers, compile error)
            raise ProbeUnavailable(last)
        log.warning("bcc child (%s) failed:\n%s", args[0], err[-4000:])
        raise ProbeUnavailable(f"bcc could not {args[0]} the probe: {last}")
    try:
        return json.loads(p.stdout)
    except ValueError:
        raise ProbeUnavailable(f"bcc's child printed no object for `{args[0]}`") from None
