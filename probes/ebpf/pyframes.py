"""Python frames of a kernel launch: where in a CPython program a sampled launch came from.

The BPF launch program (cuda.bpf.c, gw_launch_sample) walks, for a process registered in the map
py_procs, the interpreter's own structures as py-spy does: the interpreter (from _PyRuntime), its
thread states (the one whose native_thread_id is the launching thread: the GIL may be released,
as ctypes and many extensions do around a call), that thread's current frame, and each frame's
code object and instruction pointer, up to PY_DEPTH frames. Python turns (code object, instruction
offset) into "file:line in function" by reading the code object (filename, qualified name, first
line, location table) in the process's memory.

Offsets are not guessed from a table: they are measured in this very interpreter at start
(calibrate()), from objects whose values are known (a code object made at a chosen line, a frame
of our own, the thread states of two threads), by looking for those values in their memory
through /proc/self/mem (an address that is not mapped reads as nothing: no crash). A process is
then registered when its interpreter is the same version (its `Py_Version`, read in its memory):
Python frames for other versions are not read (said so: python_reason()). CPython 3.11 and 3.12
are the versions this was built against; 3.13+ have _Py_DebugOffsets, not used yet.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass

from gpuwatch.probes.ebpf import driver_names
from gpuwatch.probes.ebpf.loader import file_id
from gpuwatch.probes.ebpf.unwind import read_maps

log = logging.getLogger("gpuwatch.ebpf")

PY_DEPTH = 16  # Python frames kept per sampled launch
NONE = 0xFFFFFFFF  # an offset that does not apply (no _PyCFrame: current_frame is in the thread state)


@dataclass(frozen=True)
class Offsets:
    """Where things are in this CPython version's structures (bytes)."""

    version: int  # sys.hexversion >> 16 (0x030b: 3.11)
    interp_head: int  # _PyRuntime -> the first interpreter (PyInterpreterState *)
    threads_head: int  # interpreter -> its newest thread state
    next: int  # thread state -> the next (older) one
    native_thread_id: int  # thread state -> the thread's id (gettid)
    cframe: int  # thread state -> _PyCFrame * (NONE: current_frame is in the thread state)
    current_frame: int  # (_PyCFrame or thread state) -> the current _PyInterpreterFrame *
    code: int  # _PyInterpreterFrame -> PyCodeObject *
    previous: int  # _PyInterpreterFrame -> the caller's _PyInterpreterFrame *
    instr: int  # _PyInterpreterFrame -> the instruction being run (prev_instr / instr_ptr)
    code_adaptive: int  # PyCodeObject -> its bytecode (code units of 2 bytes)
    filename: int  # PyCodeObject -> co_filename
    qualname: int  # PyCodeObject -> co_qualname
    firstlineno: int  # PyCodeObject -> co_firstlineno (int32)
    linetable: int  # PyCodeObject -> co_linetable (bytes)
    ascii_data: int  # a compact ASCII str's characters
    bytes_data: int  # a bytes object's bytes

    def bpf_values(self) -> dict:
        return {"threads_head": self.threads_head, "next": self.next, "native_thread_id": self.native_thread_id,
                "cframe": self.cframe, "current_frame": self.current_frame, "code": self.code,
                "previous": self.previous, "instr": self.instr}


def _find(mem: driver_names.Memory, base: int, size: int, value: int, width: int = 8) -> list[int]:
    """Offsets in [base, base+size) (aligned to width) where the little-endian value is."""
    data = mem.read(base, size) or b""
    want = value.to_bytes(width, "little")
    return [o for o in range(0, len(data) - width + 1, width) if data[o:o + width] == want]


def _one(found: list[int], what: str) -> int:
    if not found:
        raise LookupError(f"{what} not found")
    return found[0]


def _tstate() -> int:
    f = ctypes.pythonapi.PyThreadState_Get
    f.restype = ctypes.c_void_p
    return f()


def _calibrate(mem: driver_names.Memory) -> Offsets:
    api = ctypes.pythonapi
    runtime = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
    get_interp = api.PyInterpreterState_Get
    get_interp.restype = ctypes.c_void_p
    interp = get_interp()
    interp_head = min(_find(mem, runtime, 4096, interp) or [-1])
    if interp_head < 0:
        raise LookupError("the interpreter in _PyRuntime not found")

    # Thread states: two threads started one after the other; the newest is the list's head and
    # the one before it is its next.
    states: dict[int, tuple[int, int]] = {}
    done = threading.Event()
    started = []

    def other(i: int, ready: threading.Event) -> None:
        states[i] = (_tstate(), threading.get_native_id())
        ready.set()
        done.wait(5)

    try:
        for i in (0, 1):
            ready = threading.Event()
            t = threading.Thread(target=other, args=(i, ready), daemon=True)
            t.start()
            started.append(t)
            ready.wait(5)
        (older, older_tid), (newest, newest_tid) = states[0], states[1]
        threads_head = _one(_find(mem, interp, 65536, newest), "the thread list's head")
        nxt = _one(_find(mem, newest, 1024, older), "the next thread state")
        native = _one([o for o in _find(mem, older, 1024, older_tid) if o in _find(mem, newest, 1024, newest_tid)],
                      "native_thread_id")
    finally:
        done.set()
        for t in started:
            t.join(5)

    # This frame, as the interpreter keeps it: a PyFrameObject points at its _PyInterpreterFrame,
    # which points at the code object.
    def here():
        frame = sys._getframe()
        iframe, off_code = _iframe_of(mem, frame)
        return iframe, off_code, _iframe_of(mem, frame.f_back)[0]

    iframe, off_code, caller_iframe = here()
    if iframe is None or caller_iframe is None:
        raise LookupError("the interpreter frame not found")
    previous = _one(_find(mem, iframe, 96, caller_iframe), "the previous frame")
    tstate = _tstate()
    # The current frame: in the thread state (3.13) or one pointer away (_PyCFrame, 3.11/3.12).
    # While memory is read the current frame is the reader's, a few calls below this one: a
    # candidate is right when its chain of callers reaches this function's frame.
    iframe_now = _iframe_of(mem, sys._getframe())[0]
    if iframe_now is None:
        raise LookupError("this function's interpreter frame not found")

    def reaches(p: int | None) -> bool:
        for _ in range(8):
            if not p:
                return False
            if p == iframe_now:
                return True
            p = mem.u64(p + previous)
        return False

    cframe, current = NONE, None
    for o in range(0, 512, 8):
        if reaches(mem.u64(tstate + o)):
            current = o
            break
    else:
        for o in range(0, 512, 8):
            q = mem.u64(tstate + o)
            if q and q > 4096 and any(reaches(mem.u64(q + k)) for k in (0, 8, 16)):
                cframe = o
                current = next(k for k in (0, 8, 16) if reaches(mem.u64(q + k)))
                break
    if current is None:
        raise LookupError("the current frame in the thread state not found")

    # the code object's fields, from a function made at a known line
    ns: dict = {}
    # (a method: its qualified name is not its name, so the two fields are told apart)
    exec(compile("\n" * 4240 + "class C:\n    def gw_calibration_probe(self):\n        return 1\n",
                 "gw_calibration.py", "exec"), ns)
    c = ns["C"].gw_calibration_probe.__code__
    filename = _one(_find(mem, id(c), 256, id(c.co_filename)), "co_filename")
    qualname = _one(_find(mem, id(c), 256, id(c.co_qualname)), "co_qualname")
    linetable = _one(_find(mem, id(c), 256, id(c.co_linetable)), "co_linetable")
    firstlineno = _one(_find(mem, id(c), 256, c.co_firstlineno, width=4), "co_firstlineno")
    raw = mem.read(id(c), 512) or b""
    adaptive = raw.find(c.co_code[:4], 64)
    if adaptive < 0:
        raise LookupError("the bytecode not found")
    s = "gw_calibration_probe"
    ascii_data = (mem.read(id(s), 128) or b"").find(s.encode())
    b = b"gw-calibration-bytes"
    bytes_data = (mem.read(id(b), 128) or b"").find(b)
    # the instruction pointer: a frame field pointing into its code's bytecode
    instr = None
    for o in range(0, 96, 8):
        p = mem.u64(iframe_now + o)
        code_now = sys._getframe().f_code
        start = id(code_now) + adaptive
        if p and start <= p < start + len(code_now.co_code):
            instr = o
            break
    if instr is None or ascii_data < 0 or bytes_data < 0:
        raise LookupError("the instruction pointer or string layout not found")
    return Offsets(sys.hexversion >> 16, interp_head, threads_head, nxt, native, cframe, current, off_code,
                   previous, instr, adaptive, filename, qualname, firstlineno, linetable, ascii_data, bytes_data)


def _iframe_of(mem: driver_names.Memory, frame) -> tuple[int | None, int | None]:
    """A frame object's _PyInterpreterFrame (the pointer in the PyFrameObject to memory that
    holds the frame's code object), and the code object's offset in it; (None, None) if not found."""
    for o in range(16, 64, 8):
        q = mem.u64(id(frame) + o)
        if q:
            hits = _find(mem, q, 96, id(frame.f_code))
            if hits:
                return q, hits[0]
    return None, None


_CALIBRATED: "Offsets | str | None" = None
_LOCK = threading.Lock()


def calibrate() -> "Offsets | str":
    """This interpreter's offsets, measured once; or why they could not be."""
    global _CALIBRATED
    with _LOCK:
        if _CALIBRATED is None:
            if not (0x030b <= sys.hexversion >> 16 <= 0x030c):
                _CALIBRATED = f"Python frames are read for CPython 3.11 and 3.12, the agent runs {sys.version.split()[0]}"
            else:
                try:
                    with driver_names.Memory(os.getpid()) as mem:
                        _CALIBRATED = _calibrate(mem)
                except (LookupError, OSError, ValueError, AttributeError) as e:
                    _CALIBRATED = f"CPython's frames could not be located in the agent's own interpreter: {e}"
                    log.warning("launch stacks without Python frames: %s", _CALIBRATED)
        return _CALIBRATED


# ---- the processes: is it a CPython we can read, and where is its runtime ----------------------
_PYTHON_FILE = __import__("re").compile(r"/(lib)?python3\.\d+[^/]*$")
_ELF_CACHE: dict[tuple[int, int], "tuple[int, int, int] | None"] = {}


def _symbols(path: str) -> "tuple[int, int, int] | None":
    """(_PyRuntime, Py_Version, the first PT_LOAD's page) virtual addresses in an ELF file."""
    key = file_id(path)
    if key is None:
        return None
    if key in _ELF_CACHE:
        return _ELF_CACHE[key]
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from gpuwatch.agent.safefile import open_regular
    found = None
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # a process's path: whatever it put there
            elf = ELFFile(f)
            loads = [s["p_vaddr"] for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            dynsym = elf.get_section_by_name(".dynsym")
            if dynsym is not None and loads:
                want = {}
                for name in ("_PyRuntime", "Py_Version"):
                    syms = dynsym.get_symbol_by_name(name) or []
                    defined = [s for s in syms if s["st_shndx"] != "SHN_UNDEF"]
                    if defined:
                        want[name] = defined[0]["st_value"]
                if len(want) == 2:
                    found = (want["_PyRuntime"], want["Py_Version"], min(loads) & ~0xFFF)
    except (OSError, ELFError):
        found = None
    if len(_ELF_CACHE) < 1024:
        _ELF_CACHE[key] = found
    return found


def runtime_of(pid: int, offsets: Offsets) -> "int | str":
    """The address of the interpreter pointer (in _PyRuntime) of a CPython process of our version,
    or why its Python frames cannot be read."""
    seen = set()
    for m in read_maps(pid, executable=False):
        if m.offset != 0 or m.path in seen or not _PYTHON_FILE.search(m.path):
            continue
        seen.add(m.path)
        syms = _symbols(f"/proc/{pid}/root{m.path}")
        if syms is None:
            continue
        runtime, version, first = syms
        bias = m.start - first
        try:
            with driver_names.Memory(pid) as mem:
                v = mem.u64(bias + version)
        except OSError as e:
            return f"cannot read process {pid}'s memory: {e.strerror or e}"
        if v is None:
            continue
        if v >> 16 != offsets.version:
            return (f"process {pid} runs CPython {v >> 24}.{(v >> 16) & 0xFF}, the agent {offsets.version >> 8}."
                    f"{offsets.version & 0xFF}: its Python frames are read only for the agent's version")
        return bias + runtime + offsets.interp_head
    return "not a CPython process (no python3.x or libpython3.x exporting _PyRuntime is mapped)"


# ---- reading frames --------------------------------------------------------------------------
def _varint(data: bytes, i: int) -> tuple[int, int]:
    b = data[i]
    v, shift = b & 63, 6
    i += 1
    while b & 64 and i < len(data):
        b = data[i]
        v |= (b & 63) << shift
        shift += 6
        i += 1
    return v, i


def line_of(linetable: bytes, firstlineno: int, index: int) -> int | None:
    """The line of code unit `index` from a 3.11+ location table (Objects/locations.md)."""
    line, unit, i = firstlineno, 0, 0
    while i < len(linetable):
        head = linetable[i]
        if not head & 0x80:
            return None  # not at an entry: not a table we know
        code, length = (head >> 3) & 15, (head & 7) + 1
        i += 1
        if code == 15:
            delta, here = 0, None
        elif code == 14:
            v, i = _varint(linetable, i)
            delta = -(v >> 1) if v & 1 else v >> 1
            for _ in range(3):
                _, i = _varint(linetable, i)
            here = True
        elif code == 13:
            v, i = _varint(linetable, i)
            delta = -(v >> 1) if v & 1 else v >> 1
            here = True
        elif code >= 10:
            delta, here = code - 10, True
            i += 2
        else:
            delta, here = 0, True
            i += 1
        line += delta
        if unit <= index < unit + length:
            return line if here else None
        unit += length
    return None


class Resolver:
    """Code objects of one process named "file:line in function", read through /proc/PID/mem."""

    MAX_CACHED = 65536
    ENTRY_BYTES = 256  # a cached frame beside its text: key, dict slot, string header (charged to "stacks")

    def __init__(self, pid: int, offsets: Offsets, ledger=None) -> None:
        """ledger: an agent.budget.Ledger each cached frame is charged to (its user's "stacks"
        budget; past it frames are read again each time, not kept); None: not charged."""
        self.pid, self.off, self.ledger = pid, offsets, ledger
        self._cache: dict[tuple[int, int], str | None] = {}

    def _str(self, mem: driver_names.Memory, addr: int | None, limit: int = 256) -> str | None:
        if not addr:
            return None
        n = mem.u64(addr + 16)  # PyASCIIObject.length (after the object header)
        if n is None or not 0 < n <= limit:
            return None
        raw = mem.read(addr + self.off.ascii_data, n)
        if not raw or len(raw) != n:
            return None
        from gpuwatch.agent.api import printable
        return printable(raw.decode("ascii", errors="replace"))  # the process chose it: no controls

    def frame(self, code: int, instr_byte: int) -> str | None:
        """The frame at code object `code`, its instruction `instr_byte` bytes into the object."""
        key = (code, instr_byte)
        if key in self._cache:
            return self._cache[key]
        text = None
        try:
            with driver_names.Memory(self.pid) as mem:
                o = self.off
                filename = self._str(mem, mem.u64(code + o.filename), 1024)
                name = self._str(mem, mem.u64(code + o.qualname))
                first = mem.read(code + o.firstlineno, 4)
                table_obj = mem.u64(code + o.linetable)
                size = mem.u64(table_obj + 16) if table_obj else None
                table = mem.read(table_obj + o.bytes_data, size) if table_obj and size and size <= 1 << 16 else b""
                if filename and name and first:
                    firstlineno = int.from_bytes(first, "little", signed=True)
                    index = (instr_byte - o.code_adaptive) // 2
                    line = line_of(table or b"", firstlineno, index) if index >= 0 else None
                    text = f"{filename}:{line if line is not None else firstlineno} in {name}"
        except OSError:
            return None  # gone, or no access: not cached
        if len(self._cache) < self.MAX_CACHED and (
                self.ledger is None or self.ledger.charge(self.pid, self.ENTRY_BYTES + len(text or ""))):
            self._cache[key] = text
        return text
