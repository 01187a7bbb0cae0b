"""Kernel names for handles the probe never saw being handed out, read from the driver's memory.

A process that fetched its kernel handles before the probe attached (a training job traced an
hour in, cuBLAS and Triton kernels loaded at start-up) launches handles whose names no hook saw.
The driver keeps each function's name: cuFuncGetName(&name, f) returns a pointer to it without
copying. Where that pointer lives inside the driver's (undocumented) function object differs
between driver versions, so it is not hard-coded: `calibrate()` asks this very driver, in a child
process, about kernels with names we chose, and finds the chain of offsets that leads from a
handle to its name (handle -> [+o1] -> ... -> [+on] = pointer to the name). `resolve()` then follows
that chain in the traced process's memory (/proc/PID/mem, root), and accepts only a NUL-terminated
string that looks like a kernel symbol. A chain that does not hold for a handle yields no name:
the launch stays "unnamed", never misnamed by a guess that was not checked against the driver.

The calibration child creates a CUDA context on one GPU for about a second (the driver's primary
context: some hundred MiB of GPU memory, freed when the child exits) and JIT-compiles two empty
kernels from PTX. It runs once per libcuda file, in a child so that the agent itself never loads
libcuda, with a timeout.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("gpuwatch.ebpf")

Chain = tuple[int, ...]

# Names the calibration kernels get: one plain, one mangled like nvcc's output.
CALIBRATION_NAMES = (b"gpuwatch_calibrate_a", b"_Z22gpuwatch_calibrate_bbbPfi")
_PTX_TARGETS = ((b"8.0", b"sm_80"), (b"7.0", b"sm_70"), (b"6.0", b"sm_52"))
# What a kernel symbol may contain: identifier characters and what mangling, templates and
# compilers add (Triton: triton_poi_fused_add_0; nvcc: _ZN2at6native...; clones: foo.cold, foo$1).
_SYMBOL_RE = re.compile(rb"[A-Za-z_.$][A-Za-z0-9_.$@<>:,()\[\]*&~ -]{0,4094}")
_USER_MIN, _USER_MAX = 0x10000, 0x7FFF_FFFF_FFFF
SCAN_BYTES = 512   # how much of each object is searched for pointers
MAX_DEPTH = 3      # pointers followed from the handle
MAX_NODES = 20000  # objects read per search, a bound on the calibration's cost
NAME_MAX = 4096


def plausible(addr: int) -> bool:
    """Could this be a pointer into a process's user space (x86-64, 47-bit)?"""
    return _USER_MIN <= addr <= _USER_MAX and addr % 8 == 0


class Memory:
    """Reads a process's memory through /proc/PID/mem: None for what is not mapped.

    Needs ptrace access to the process (root, or the same user with ptrace_scope 0, or itself).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, addr: int, n: int) -> bytes | None:
        try:
            data = os.pread(self.fd, n, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data or None

    def read_upto(self, addr: int, n: int) -> bytes | None:
        """Up to n bytes at addr, fewer when the mapping ends before (page by page)."""
        data = self.read(addr, n)
        if data is not None:
            return data
        end = (addr // 4096 + 1) * 4096  # the rest of the first page
        return self.read(addr, min(n, end - addr))

    def u64(self, addr: int) -> int | None:
        data = self.read(addr, 8)
        return int.from_bytes(data, "little") if data is not None and len(data) == 8 else None

    def cstring(self, addr: int, limit: int = NAME_MAX) -> bytes | None:
        """The NUL-terminated string at addr (at most limit bytes), None when unreadable or longer."""
        out = b""
        while len(out) < limit:
            chunk = self.read_upto(addr + len(out), min(256, limit - len(out)))
            if not chunk:
                return None
            nul = chunk.find(b"\0")
            if nul >= 0:
                return out + chunk[:nul]
            out += chunk
        return None


def find_chains(mem: Memory, handle: int, name: bytes, name_ptr: int = 0) -> set[Chain]:
    """Every offset chain of at most MAX_DEPTH pointers from handle to a pointer at the name (the
    address name_ptr, or any NUL-terminated copy of name)."""
    found: set[Chain] = set()
    frontier: list[tuple[int, Chain]] = [(handle, ())]
    seen = {handle}
    nodes = 0
    for _depth in range(MAX_DEPTH):
        nxt: list[tuple[int, Chain]] = []
        for addr, path in frontier:
            nodes += 1
            if nodes > MAX_NODES:
                return found
            data = mem.read_upto(addr, SCAN_BYTES)
            if not data:
                continue
            for off in range(0, len(data) - 7, 8):
                v = int.from_bytes(data[off:off + 8], "little")
                if not plausible(v) and not (name_ptr and v == name_ptr):
                    continue
                chain = path + (off,)
                if v == name_ptr or mem.read(v, len(name) + 1) == name + b"\0":
                    found.add(chain)
                elif v not in seen:
                    seen.add(v)
                    nxt.append((v, chain))
        frontier = nxt
    return found


def resolve(mem: Memory, handle: int, chain: Chain) -> bytes | None:
    """Follow the chain from handle to a name; None unless it ends at a plausible kernel symbol."""
    addr = handle
    for off in chain[:-1]:
        nxt = mem.u64(addr + off)
        if nxt is None or not plausible(nxt):
            return None
        addr = nxt
    ptr = mem.u64(addr + chain[-1])
    if ptr is None or not _USER_MIN <= ptr <= _USER_MAX:
        return None
    name = mem.cstring(ptr)
    if not name or not _SYMBOL_RE.fullmatch(name):
        return None
    return name


@dataclass(frozen=True)
class Calibration:
    """Offset chains that lead from a handle to its name in one driver build."""

    function: tuple[Chain, ...] = ()  # CUfunction (cuModuleGetFunction, cuKernelGetFunction)
    kernel: tuple[Chain, ...] = ()    # CUkernel (cuLibraryGetKernel): accepted where a CUfunction is
    error: str | None = None

    @property
    def chains(self) -> tuple[Chain, ...]:
        """The shortest chain of each kind, CUfunction first. Longer chains that also held during
        calibration usually pass through a neighbouring object and would name the wrong kernel."""
        best: dict[Chain, None] = {}
        for found in (self.function, self.kernel):
            if found:
                best.setdefault(found[0], None)
        return tuple(best)

    def name(self, mem: Memory, handle: int) -> bytes | None:
        for chain in self.chains:
            name = resolve(mem, handle, chain)
            if name is not None:
                return name
        return None


def calibrate(libcuda: str, timeout: float = 60.0, device: int = 0) -> Calibration:
    """Find the chains of this libcuda file in a child process (see the module doc)."""
    cmd = [sys.executable, "-m", "gpuwatch.probes.ebpf.driver_names", libcuda, str(device)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Calibration(error=f"calibrating kernel names on {libcuda} took over {timeout:.0f} s")
    except OSError as e:
        return Calibration(error=f"cannot run the kernel-name calibration: {e}")
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        return Calibration(error=f"kernel-name calibration failed: {tail[0]}")
    if answer.get("error"):
        return Calibration(error=answer["error"])
    return Calibration(function=tuple(tuple(c) for c in answer.get("function", ())),
                       kernel=tuple(tuple(c) for c in answer.get("kernel", ())))


MAX_CHAINS, MAX_CHAIN_LEN, MAX_OFFSET = 16, 8, 1 << 16  # a cached calibration's bounds


def calibrate_cached(libcuda: str) -> Calibration:
    """calibrate(), kept in the eBPF cache (compiler.read_cache: only a file only we or root may
    write) per libcuda build (its size, modification time and inode): the calibration starts CUDA
    in a child (~0.5 s), once per driver rather than once per trace."""
    from gpuwatch.probes.ebpf import compiler
    try:
        st = os.stat(libcuda)
    except OSError as e:
        return Calibration(error=f"cannot read {libcuda}: {e.strerror}")
    ident = f"{CALIBRATION_FORMAT}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    name = "names-" + hashlib.sha256(ident.encode()).hexdigest()[:24] + ".json"
    raw = compiler.read_cache(name)
    if raw is not None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = json.loads(raw)
            chains = {k: tuple(_chain(c) for c in data[k]) for k in ("function", "kernel")}
            if data.get("ident") == ident and all(len(v) <= MAX_CHAINS for v in chains.values()):
                return Calibration(**chains)
    cal = calibrate(libcuda)
    if not cal.error:
        compiler.write_cache(name, json.dumps({"ident": ident, "function": [list(c) for c in cal.function],
                                               "kernel": [list(c) for c in cal.kernel]}).encode())
    return cal


CALIBRATION_FORMAT = 1


def _chain(c) -> Chain:
    if not isinstance(c, list) or not 1 <= len(c) <= MAX_CHAIN_LEN or \
            not all(type(o) is int and 0 <= o < MAX_OFFSET for o in c):
        raise ValueError(f"not an offset chain: {c!r}")
    return tuple(c)


# ---- demangling ------------------------------------------------------------------------------------
_demangled: dict[str, str] = {}


def demangle(symbols: list[str], timeout: float = 10.0) -> dict[str, str]:
    """Itanium C++ symbols (the "_Z..." that nvcc gives kernels) as C++ declarations, by binutils'
    c++filt in a child process: a name a traced process chose never reaches a demangler inside the
    agent. Symbols that are not mangled, or when c++filt is missing or fails, map to themselves."""
    todo = sorted({s for s in symbols if s not in _demangled and s.startswith("_Z") and "\n" not in s})
    cxxfilt = shutil.which("c++filt")
    if todo and cxxfilt:
        try:
            out = subprocess.run([cxxfilt], input="\n".join(todo) + "\n", capture_output=True, text=True,
                                 timeout=timeout, check=False).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("c++filt: %s", e)
            out = []
        if len(out) == len(todo):
            _demangled.update(zip(todo, out))
    return {s: _demangled.get(s, s) for s in symbols}


# ---- the calibration child -----------------------------------------------------------------------
def _ptx(version: bytes, target: bytes) -> bytes:
    entries = b"".join(b".visible .entry " + n + b"()\n{\n\tret;\n}\n" for n in CALIBRATION_NAMES)
    return b".version " + version + b"\n.target " + target + b"\n.address_size 64\n\n" + entries + b"\0"


def _child(libcuda: str, device: int) -> dict:
    cu = ctypes.CDLL(libcuda)
    vp = ctypes.c_void_p

    def check(what: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    check("cuInit", cu.cuInit(0))
    dev = ctypes.c_int()
    check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), device))
    ctx = vp()
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    ptx = mod = None
    for version, target in _PTX_TARGETS:
        ptx, mod = _ptx(version, target), vp()
        if cu.cuModuleLoadData(ctypes.byref(mod), ptx) == 0:
            break
        mod = None
    if mod is None:
        raise RuntimeError("the driver's JIT accepted none of the calibration PTX versions")
    mem = Memory(os.getpid())
    function: set[Chain] | None = None
    kernel: set[Chain] | None = None
    for name in CALIBRATION_NAMES:
        f, p = vp(), ctypes.c_char_p()
        check("cuModuleGetFunction", cu.cuModuleGetFunction(ctypes.byref(f), mod, name))
        check("cuFuncGetName", cu.cuFuncGetName(ctypes.byref(p), f))
        chains = find_chains(mem, f.value, name, ctypes.cast(p, vp).value or 0)
        function = chains if function is None else function & chains
    # The library route (the runtime's, with lazy loading): CUkernel handles and their CUfunctions.
    lib = vp()
    if hasattr(cu, "cuLibraryLoadData") and cu.cuLibraryLoadData(ctypes.byref(lib), ptx, None, None, 0,
                                                                 None, None, 0) == 0:
        for name in CALIBRATION_NAMES:
            k, f, p = vp(), vp(), ctypes.c_char_p()
            check("cuLibraryGetKernel", cu.cuLibraryGetKernel(ctypes.byref(k), lib, name))
            check("cuKernelGetFunction", cu.cuKernelGetFunction(ctypes.byref(f), k))
            check("cuFuncGetName", cu.cuFuncGetName(ctypes.byref(p), f))
            fchains = find_chains(mem, f.value, name, ctypes.cast(p, vp).value or 0)
            function = fchains if function is None else function & fchains
            kp = ctypes.c_char_p()
            kname_ptr = 0
            if hasattr(cu, "cuKernelGetName") and cu.cuKernelGetName(ctypes.byref(kp), k) == 0:
                kname_ptr = ctypes.cast(kp, vp).value or 0
            kchains = find_chains(mem, k.value, name, kname_ptr)
            kernel = kchains if kernel is None else kernel & kchains
    mem.close()
    shortest = lambda chains: sorted(chains or (), key=lambda c: (len(c), c))  # noqa: E731
    return {"function": shortest(function), "kernel": shortest(kernel)}


def main(argv: list[str]) -> int:
    try:
        answer = _child(argv[0], int(argv[1]) if len(argv) > 1 else 0)
        if not answer["function"] and not answer["kernel"]:
            answer["error"] = "no pointer to a kernel's name found in this driver's function objects"
    except Exception as e:  # the parent reads one JSON line either way
        answer = {"error": f"kernel-name calibration: {e}"}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
