"""The CFI unwinder (probes/ebpf/unwind.py) on real binaries built here with -O2 -fomit-frame-pointer:
a program whose call chain runs into a library and ends in `snap`, which copies the registers and
the top 8 KiB of the stack at its first instruction, as the eBPF probe does at a hooked function.
The unwound return addresses must name the known chain, frame by frame; the frame-pointer walk of
the same stack finds none of it."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from gpuwatch.probes.ebpf import unwind

HERE = Path(__file__).resolve().parent / "unwind"
CHAIN = ["snap", "lib_c", "lib_b", "lib_a", "outer", "main"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: install gcc (apt-get install gcc)")
    d = tmp_path_factory.mktemp("unwind")
    flags = ["-O2", "-fomit-frame-pointer", "-g0"]
    subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(d / "libchain.so"), str(HERE / "chainlib.c")], check=True)
    subprocess.run([cc, *flags, "-o", str(d / "chain"), str(HERE / "chain.c"), f"-L{d}", "-lchain",
                    f"-Wl,-rpath,{d}"], check=True)
    return d


class Chain:
    """The program, stopped after its snapshot: (sp, bp, ip, stack bytes) and its pid."""

    def __init__(self, d: Path) -> None:
        self.out = d / f"snap-{id(self)}"
        self.proc = subprocess.Popen([str(d / "chain"), str(self.out)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        data = self.out.read_bytes()
        self.sp, self.bp, self.ip = struct.unpack_from("<QQQ", data)
        self.stack = data[24:]
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.communicate("\n", timeout=10)


@pytest.fixture
def chain(built):
    c = Chain(built)
    yield c
    c.close()


def symbol(pid: int, addr: int) -> str | None:
    """The function holding addr in the process (pyelftools, the binary's .symtab)."""
    from elftools.elf.elffile import ELFFile
    for m in unwind.read_maps(pid):
        if m.start <= addr < m.end:
            with open(m.path, "rb") as f:
                elf = ELFFile(f)
                off = addr - m.start + m.offset
                va = next(s["p_vaddr"] + off - s["p_offset"] for s in elf.iter_segments()
                          if s["p_type"] == "PT_LOAD" and s["p_offset"] <= off < s["p_offset"] + s["p_filesz"])
                for table in ("symtab", "dynsym"):
                    sec = elf.get_section_by_name("." + table)
                    for s in (sec.iter_symbols() if sec else ()):
                        if s["st_info"]["type"] == "STT_FUNC" and s["st_value"] <= va < s["st_value"] + max(s["st_size"], 1):
                            return s.name.split(".")[0]  # lib_c.constprop.0 -> lib_c
    return None


def test_unwinds_a_chain_without_frame_pointers_through_a_library(chain):
    u = unwind.Unwinder()
    frames = u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, chain.stack)
    names = [symbol(chain.pid, a if i == 0 else a - 1) for i, a in enumerate(frames)]
    assert names[:len(CHAIN)] == CHAIN, names
    assert len(frames) == len(CHAIN)  # main's return address lies past its 16 KiB frame: beyond the copy
    # the binaries are parsed once: a second unwind of the same stack is from the cache
    opened = u.opened
    assert u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, chain.stack) == frames
    assert u.opened == opened


def test_frame_pointers_alone_lose_the_chain(chain):
    """What bpf_get_stackid does: follow rbp. Without frame pointers it does not name the chain."""
    top, bp, names = chain.sp, chain.bp, []
    for _ in range(16):
        off = bp - top
        if not 0 <= off <= len(chain.stack) - 16:
            break
        bp, ra = struct.unpack_from("<QQ", chain.stack, off)
        names.append(symbol(chain.pid, ra - 1))
    assert not set(CHAIN[1:]) <= set(names), names


def test_a_short_copy_stops_cleanly_where_the_bytes_end(chain):
    u = unwind.Unwinder()
    full = u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, chain.stack)
    # only the return address into lib_c: the walk stops there, no frame from outside the copy
    short = u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, chain.stack[:8])
    assert short == full[:2]
    assert u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, b"") == full[:1]


def test_hostile_inputs_stop_the_walk(chain, tmp_path):
    u = unwind.Unwinder()
    # a stack whose return addresses point at themselves / nowhere: a few frames at most, no loop
    junk = struct.pack("<Q", chain.sp) * 1024
    assert len(u.unwind(chain.pid, chain.ip, chain.sp, chain.bp, junk)) <= 2
    # an ip in no mapping
    assert u.unwind(chain.pid, 0x10, chain.sp, chain.bp, chain.stack) == [0x10]
    # a binary whose .eh_frame_hdr claims more entries than it holds: no CFI, not a crash
    lib = next(m for m in unwind.read_maps(chain.pid) if m.path.endswith("libchain.so"))
    data = bytearray(Path(lib.path).read_bytes())
    from elftools.elf.elffile import ELFFile
    with open(lib.path, "rb") as f:
        hdr = ELFFile(f).get_section_by_name(".eh_frame_hdr")["sh_offset"]
    struct.pack_into("<I", data, hdr + 8, 0x7FFFFFFF)
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    fd = __import__("os").open(bad, 0)
    try:
        b = unwind.Binary(fd)
    finally:
        __import__("os").close(fd)
    assert b.row(0x1000) is None
