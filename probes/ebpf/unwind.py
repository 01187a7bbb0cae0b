"""Native call stacks without frame pointers: a copy of the user stack, unwound with the binaries' CFI.

Optimised builds (libcudart_static inside CuPy's runtime module, XLA, RMM, TensorFlow, most vendor
libraries) keep no frame pointers, so the kernel's frame-pointer walk (bpf_get_stackid) stops at the
first such frame and the pool allocator that called the driver is never on the stack. As `perf
--call-graph dwarf` does, the allocation probes copy the top STACK_BYTES of the user stack and the
registers rip, rsp and rbp at the hooked function's first instruction (cuda.bpf.c, gw_copy_stack);
here they are unwound with the `.eh_frame` call-frame information of each binary, found through its
`.eh_frame_hdr` search table and decoded by pyelftools.

x86-64 only: a frame's CFA is rsp or rbp plus an offset; the return address (DWARF register 16) and
rbp (6) are saved at CFA + offset or left as they are; the caller's rsp is the CFA. Anything else (a
DWARF expression: PLT stubs, signal frames; a register rule) stops the walk where it is, as does an
address in no mapped file, a read outside the copy, a frame that does not move up the stack, or
MAX_FRAMES frames.

What a user controls here, and the bounds on it (docs/security.md): their stack's bytes (only
STACK_BYTES are copied, reads stay inside the copy), and their binaries: a search table or FDE past
its section, an FDE longer than MAX_FDE_BYTES or with more than MAX_ROWS rows, is not used; a binary
is opened once (through /proc/PID/map_files, checked to be the mapped regular file) and kept as its
search table's bytes (at most MAX_HDR_BYTES) and an mmap; decoded FDEs are cached, MAX_FDES per binary,
in at most MAX_BINARIES binaries keyed by (device, inode, build-id); the least recently used go first.
"""
from __future__ import annotations

import contextlib
import bisect
import collections
import io
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Callable

STACK_BYTES = 8192  # copied per stack (perf's default dump size for --call-graph dwarf)
MAX_FRAMES = 64
MAX_BINARIES = 64
MAX_FDES = 4096  # decoded FDEs kept per binary
MAX_FDE_BYTES = 1 << 16
MAX_ROWS = 4096
MAX_HDR_BYTES = 32 << 20  # a .eh_frame_hdr search table of 4M functions
RSP, RBP, RA = 7, 6, 16  # DWARF register numbers on x86-64
_TABLE_ENC = 0x3B  # DW_EH_PE_datarel | DW_EH_PE_sdata4: what GNU ld, gold, lld and mold write


@dataclass(frozen=True)
class Row:
    """How to find the caller's frame at one address: CFA = (rsp or rbp) + cfa_off; the return
    address at CFA + ra_off; rbp saved at CFA + bp_off (None: unchanged)."""
    cfa_reg: int
    cfa_off: int
    ra_off: int
    bp_off: int | None


class _Window(io.RawIOBase):
    """A section of an mmap as a stream from offset 0 (what pyelftools' CallFrameInfo reads)."""

    def __init__(self, mm: mmap.mmap, base: int, size: int) -> None:
        self._mm, self._base, self._size, self._pos = mm, base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if self._pos >= end:
            return b""
        data = self._mm[self._base + self._pos:self._base + end]
        self._pos = end
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


class Binary:
    """One ELF file's unwinding rules: its .eh_frame_hdr table, FDEs decoded on demand (bounded)."""

    def __init__(self, fd: int) -> None:
        from elftools.dwarf.callframe import CallFrameInfo
        from elftools.dwarf.structs import DWARFStructs
        from elftools.elf.elffile import ELFFile

        size = os.fstat(fd).st_size
        self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.build_id = b""
        self.loads: list[tuple[int, int, int]] = []  # (file offset, vaddr, filesz) of PT_LOAD segments
        self._table = b""
        self._cfi = None
        self._fdes: collections.OrderedDict[int, list[tuple[int, Row | None]]] = collections.OrderedDict()
        if self._mm is None:
            return
        elf = ELFFile(_Window(self._mm, 0, size))
        if elf.get_machine_arch() != "x64":
            return
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_LOAD":
                self.loads.append((seg["p_offset"], seg["p_vaddr"], seg["p_filesz"]))
            elif seg["p_type"] == "PT_NOTE":
                for note in seg.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        self.build_id = bytes.fromhex(note["n_desc"])
        hdr, eh = elf.get_section_by_name(".eh_frame_hdr"), elf.get_section_by_name(".eh_frame")
        if hdr is None or eh is None or eh["sh_type"] == "SHT_NOBITS":
            return
        h_off, h_size, self._hdr_addr = hdr["sh_offset"], hdr["sh_size"], hdr["sh_addr"]
        e_off, e_size, self._eh_addr = eh["sh_offset"], eh["sh_size"], eh["sh_addr"]
        if not (0 < h_size <= MAX_HDR_BYTES and h_off + h_size <= size and e_off + e_size <= size):
            return
        head = self._mm[h_off:h_off + min(h_size, 12)]
        if len(head) < 12 or head[0] != 1 or head[2] != 0x03 or head[3] != _TABLE_ENC:
            return  # (version 1, a udata4 count, the datarel sdata4 table: anything else is not used)
        (count,) = struct.unpack_from("<I", head, 8)
        if 12 + 8 * count > h_size:
            return
        self._table = self._mm[h_off + 12:h_off + 12 + 8 * count]
        self._count = count
        self._eh_size = e_size
        self._cfi = CallFrameInfo(_Window(self._mm, e_off, e_size), e_size, self._eh_addr,
                                  DWARFStructs(little_endian=True, dwarf_format=32, address_size=8), for_eh_frame=True)

    def vaddr(self, file_offset: int) -> int | None:
        for off, va, n in self.loads:
            if off <= file_offset < off + n:
                return file_offset - off + va
        return None

    def row(self, vaddr: int) -> Row | None:
        """The rule at this address (None: no CFI covers it, or one this does not evaluate)."""
        if not self._table:
            return None
        # the search table: (initial location, FDE address) pairs relative to .eh_frame_hdr, sorted
        lo, hi, rel = 0, self._count, vaddr - self._hdr_addr
        table = self._table
        while lo < hi:
            mid = (lo + hi) // 2
            if struct.unpack_from("<i", table, 8 * mid)[0] <= rel:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        start, fde_rel = struct.unpack_from("<ii", table, 8 * (lo - 1))
        fde_off = self._hdr_addr + fde_rel - self._eh_addr
        rows = self._fdes.get(fde_off)
        if rows is None:
            rows = self._decode(fde_off, self._hdr_addr + start)
            self._fdes[fde_off] = rows
            if len(self._fdes) > MAX_FDES:
                self._fdes.popitem(last=False)
        else:
            self._fdes.move_to_end(fde_off)
        if not rows or vaddr >= rows[-1][0]:  # the last entry is the FDE's end
            return None
        i = bisect.bisect_right(rows, vaddr, key=lambda r: r[0]) - 1
        return rows[i][1] if i >= 0 else None

    def _decode(self, fde_off: int, start: int) -> list[tuple[int, Row | None]]:
        if not 0 <= fde_off <= self._eh_size - 8:
            return []
        (length,) = struct.unpack_from("<I", self._mm, self._cfi.stream._base + fde_off)  # type: ignore[union-attr]
        if length == 0 or length > MAX_FDE_BYTES or fde_off + 4 + length > self._eh_size:
            return []
        try:
            fde = self._cfi._parse_entry_at(fde_off)  # one entry (and its CIE), not the whole section
            if len(self._cfi._entry_cache) > 2 * MAX_FDES:  # pyelftools keeps every entry it parsed
                self._cfi._entry_cache.clear()
            if "initial_location" not in fde.header or fde.header["initial_location"] != start:
                return []
            table = fde.get_decoded().table
        except Exception:  # noqa: BLE001 - a malformed FDE of a user's binary: no CFI there
            return []
        if len(table) > MAX_ROWS:
            return []
        rows: list[tuple[int, Row | None]] = []
        for line in table:
            cfa, ra, bp = line["cfa"], line.get(RA), line.get(RBP)
            ok = (cfa.expr is None and cfa.reg in (RSP, RBP) and ra is not None and ra.type == "OFFSET"
                  and (bp is None or bp.type in ("OFFSET", "SAME_VALUE", "UNDEFINED")))
            rows.append((line["pc"], Row(cfa.reg, cfa.offset, ra.arg, bp.arg if bp is not None and bp.type == "OFFSET"
                                         else None) if ok else None))
        rows.append((start + fde.header["address_range"], None))
        return rows


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str


def read_maps(pid: int, proc: str = "/proc", executable: bool = True) -> list[Mapping]:
    """A process's executable (or, executable=False, all) file mappings, sorted by start address;
    those before a line that does not parse."""
    out = []
    with contextlib.suppress(OSError, ValueError):
        with open(f"{proc}/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or (executable and b"x" not in parts[1]) or not parts[5].startswith(b"/"):
                    continue
                lo, _, hi = parts[0].partition(b"-")
                major, _, minor = parts[3].partition(b":")
                out.append(Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16), (int(major, 16), int(minor, 16)),
                                   int(parts[4]), os.fsdecode(parts[5].rstrip(b"\n"))))
    return sorted(out, key=lambda m: m.start)


class Unwinder:
    """Unwinds stack copies of processes; binaries cached (bounded) by (device, inode, build-id)."""

    def __init__(self, proc: str = "/proc", max_binaries: int = MAX_BINARIES) -> None:
        self._proc = proc
        self._max = max_binaries
        self._binaries: collections.OrderedDict[tuple, Binary] = collections.OrderedDict()
        self._by_file: dict[tuple[tuple[int, int], int], tuple] = {}  # (dev, inode) -> its cache key
        self.opened = 0  # binaries parsed (a cache miss)

    def _open(self, pid: int, m: Mapping) -> Binary | None:
        fkey = (m.dev, m.inode)
        key = self._by_file.get(fkey)
        if key is not None and key in self._binaries:
            self._binaries.move_to_end(key)
            return self._binaries[key]
        fd = -1
        for path in (f"{self._proc}/{pid}/map_files/{m.start:x}-{m.end:x}", f"{self._proc}/{pid}/root{m.path}"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == (*m.dev, m.inode):
                break
            os.close(fd)  # not the file that is mapped (replaced since)
            fd = -1
        if fd < 0:
            return None
        try:
            b = Binary(fd)
        except Exception:  # noqa: BLE001 - not an ELF file we can read: no CFI
            return None
        finally:
            os.close(fd)
        self.opened += 1
        key = (m.dev, m.inode, b.build_id)
        self._by_file[fkey] = key
        self._binaries[key] = b
        while len(self._binaries) > self._max:
            old, _ = self._binaries.popitem(last=False)
            self._by_file.pop((old[0], old[1]), None)
        return b

    def unwind(self, pid: int, ip: int, sp: int, bp: int, stack: bytes,
               maps: Callable[[], list[Mapping]] | list[Mapping] | None = None) -> list[int]:
        """The return addresses of a stack, innermost first, starting with ip (the hooked
        function's first instruction, where sp points at the return address). maps: the process's
        mappings (or a function giving them), read from /proc when None."""
        mappings = maps() if callable(maps) else maps if maps is not None else read_maps(pid, self._proc)
        starts = [m.start for m in mappings]
        frames, pc, cfa_prev, top = [ip], ip, sp - 1, sp
        for depth in range(MAX_FRAMES):
            look = pc if depth == 0 else pc - 1  # a return address is past its call
            i = bisect.bisect_right(starts, look) - 1
            if i < 0 or look >= mappings[i].end:
                break
            m = mappings[i]
            b = self._open(pid, m)
            va = b.vaddr(look - m.start + m.offset) if b is not None else None
            row = b.row(va) if va is not None else None
            if row is None:
                break
            base = sp if row.cfa_reg == RSP else bp
            if base is None:
                break
            cfa = base + row.cfa_off
            ra = _read(stack, top, cfa + row.ra_off)
            if ra is None or cfa <= cfa_prev:
                break
            if row.bp_off is not None:
                bp = _read(stack, top, cfa + row.bp_off)
            if ra == 0:  # the outermost frame (the CFI of _start and clone say so too: no rule, above)
                break
            frames.append(ra)
            pc, sp, cfa_prev = ra, cfa, cfa
        return frames


def _read(stack: bytes, top: int, addr: int) -> int | None:
    off = addr - top
    if 0 <= off <= len(stack) - 8:
        return struct.unpack_from("<Q", stack, off)[0]
    return None
