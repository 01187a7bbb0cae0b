"""pyframes: CPython's frames located in the agent's own interpreter, and read back the way the
BPF launch program reads them (the same walk, here through /proc/self/mem)."""
from __future__ import annotations

import marshal
import os
import subprocess
import sys
import threading

import pytest

from gpuwatch.probes.ebpf import driver_names, pyframes

SUPPORTED = 0x030b <= sys.hexversion >> 16 <= 0x030c


def walk(pid: int, tid: int, off: pyframes.Offsets) -> list[str | None]:
    """cuda.bpf.c's gw_py_frames, in Python."""
    where = pyframes.runtime_of(pid, off)
    assert isinstance(where, int), where
    with driver_names.Memory(pid) as mem:
        u = mem.u64
        ts = u(u(where) + off.threads_head)
        for _ in range(64):
            if u(ts + off.native_thread_id) & 0xFFFFFFFF == tid:
                break
            ts = u(ts + off.next)
        if off.cframe != pyframes.NONE:
            ts = u(ts + off.cframe)
        frame, frames = u(ts + off.current_frame), []
        for _ in range(pyframes.PY_DEPTH):
            if not frame:
                break
            code, instr = u(frame + off.code), u(frame + off.instr)
            frames.append((code, instr - code))
            frame = u(frame + off.previous)
    r = pyframes.Resolver(pid, off)
    return [r.frame(c, i) for c, i in frames]


@pytest.mark.skipif(not SUPPORTED, reason="Python frames are read for CPython 3.11 and 3.12")
def test_the_frames_of_a_thread_are_read_with_their_lines():
    off = pyframes.calibrate()
    assert isinstance(off, pyframes.Offsets), off
    got: dict = {}

    def inner():
        got["frames"] = walk(os.getpid(), threading.get_native_id(), off)  # this line is read

    def outer():
        inner()

    t = threading.Thread(target=outer)  # another thread than the one that calibrated
    t.start()
    t.join()
    here = __file__
    line = inner.__code__.co_firstlineno + 1
    frames = [f for f in got["frames"] if f and f.startswith(here) and f.endswith(("inner", "outer"))]
    assert frames == [f"{here}:{line} in test_the_frames_of_a_thread_are_read_with_their_lines.<locals>.inner",
                      f"{here}:{line + 3} in test_the_frames_of_a_thread_are_read_with_their_lines.<locals>.outer"]


def assert_lines_match(code) -> int:
    units = 0
    for start, end, line in code.co_lines():
        for unit in range(start // 2, end // 2):
            assert pyframes.line_of(code.co_linetable, code.co_firstlineno, unit) == line, (code, unit)
            units += 1
    for c in code.co_consts:
        if hasattr(c, "co_linetable"):
            units += assert_lines_match(c)
    return units


def test_line_table_matches_the_interpreter_on_far_jumps_back_steps_and_long_lines():
    # lines 40 and 5000 apart (one- and three-byte deltas), loops and a call whose arguments come
    # back up to its first line (negative deltas), columns past 255 and expressions over several
    # lines (the long form), and instructions with no line
    pad = "x" * 300
    src = "\n".join([
        "def far(a):",
        "    b = a + 1" + "\n" * 40,
        "    c = b * 2" + "\n" * 5000,
        "    for i in range(a):",
        "        b += i",
        "    d = (a + 1) * (b - 2) + (a * b) - (a // 3) + (b % 5) + (a << 2) + (b >> 1) + (a ^ b) + (a | b)",
        "    return (b,",
        "            c,",
        f"            '{pad}' + str(a))",
        "def back(xs):",
        "    return [x",
        "            for x in xs",
        "            if x]",
        "try:",
        "    far(1)",
        "except Exception:",
        "    pass",
    ])
    code = compile(src, "<lines>", "exec")
    assert assert_lines_match(code) > 50


def test_line_table_matches_the_interpreter():
    def f(x):
        y = x + 1
        if y:
            return [y,
                    x]
        return None
    assert_lines_match(f.__code__)
    assert pyframes.line_of(b"\x01\x02", 10, 0) is None  # not a location table: no line, no crash
    assert pyframes.line_of(b"", 10, 0) is None


def test_a_process_that_is_not_python_or_another_version_is_said_so(tmp_path):
    off = pyframes.calibrate()
    if isinstance(off, str):
        pytest.skip(off)
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert "not a CPython process" in pyframes.runtime_of(p.pid, off)
    finally:
        p.kill()
        p.wait()
    other = pyframes.Offsets(**{**off.__dict__, "version": off.version + 1})
    assert "its Python frames are read only for the agent's version" in pyframes.runtime_of(os.getpid(), other)


def test_a_forged_code_object_reads_as_nothing():
    off = pyframes.calibrate()
    if isinstance(off, str):
        pytest.skip(off)
    r = pyframes.Resolver(os.getpid(), off)
    assert r.frame(0, 0) is None and r.frame(8, 0) is None
    b = bytearray(b"\x00" * 4096)  # a "code object" whose pointers are zero
    import ctypes
    assert r.frame(ctypes.addressof((ctypes.c_char * 4096).from_buffer(b)), 200) is None


def test_line_table_without_columns_matches_the_interpreter():
    # python -X no_debug_ranges (PYTHONNODEBUGRANGES) writes the form without columns: compiled there,
    # its tables are read here (marshal keeps them as they are)
    src = "\n".join([
        "def f(a):",
        "    b = a" + "\n" * 70,  # a two-byte delta
        "    for i in range(a):",
        "        b -= i",  # and back up to the loop: a negative one
        "    return (b,",
        "            a)",
    ])
    prog = f"import marshal, sys; sys.stdout.write(marshal.dumps(compile({src!r}, '<lines>', 'exec')).hex())"
    r = subprocess.run([sys.executable, "-X", "no_debug_ranges", "-c", prog], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = marshal.loads(bytes.fromhex(r.stdout))
    f = next(c for c in code.co_consts if hasattr(c, "co_linetable"))
    assert {(b >> 3) & 15 for b in f.co_linetable if b & 0x80} <= {13, 15}  # no columns, as said
    assert assert_lines_match(code) > 10
    # a table cut inside a number: the line read so far, no crash
    assert pyframes.line_of(bytes([0x80 | 13 << 3, 0x40]), 7, 0) == 7
