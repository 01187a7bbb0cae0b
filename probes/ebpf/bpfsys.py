"""The bpf(2) and perf_event_open(2) calls the agent makes itself, through ctypes.

bcc compiles the probe (in a short-lived child, see compiler.py); everything after that — maps,
program load, attaching, reading — is these few system calls, so the long-running agent never
loads bcc and its LLVM (~65 MiB of RSS the moment `import bcc` runs). Debian 12's libbpf (1.1)
predates multi-uprobe links, and bcc 0.26 has no API for them, hence plain syscalls.

Layouts are those of include/uapi/linux/bpf.h and perf_event.h (x86-64). Errors raise OSError
with the errno and the call's name; a program the verifier refuses raises VerifierError with the
verifier's log.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import struct
from typing import Callable, Iterator

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

SYS_BPF = 321            # x86-64
SYS_PERF_EVENT_OPEN = 298

# bpf commands
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY, PROG_LOAD = 0, 1, 2, 3, 4, 5
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_BATCH = 24
LINK_CREATE = 28

# map types
MAP_HASH, MAP_ARRAY, MAP_PERCPU_ARRAY, MAP_STACK_TRACE, MAP_RINGBUF = 1, 2, 6, 7, 27

PROG_KPROBE = 2           # uprobes are kprobe-type programs
ATTACH_PERF_EVENT = 41    # BPF_PERF_EVENT: a program on a perf event, with a cookie (Linux >= 5.15)
ATTACH_UPROBE_MULTI = 48  # BPF_TRACE_UPROBE_MULTI (Linux >= 6.6)
UPROBE_MULTI_RETURN = 1   # BPF_F_UPROBE_MULTI_RETURN

_ATTR_SIZE = 128  # bigger than every member used here; the kernel wants the tail zeroed


class VerifierError(OSError):
    """The kernel refused to load a program; .log holds the verifier's words."""

    def __init__(self, err: int, name: str, log: str) -> None:
        super().__init__(err, f"the kernel refused BPF program {name}: {os.strerror(err)}")
        self.log = log


def _bpf(cmd: int, attr: ctypes.Array, what: str) -> int:
    r = _syscall(SYS_BPF, cmd, attr, len(attr))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({what}): {os.strerror(err)}")
    return r


def _attr(*fields: tuple[int, str, int]) -> ctypes.Array:
    """A zeroed bpf_attr with (offset, struct format, value) written in."""
    buf = ctypes.create_string_buffer(_ATTR_SIZE)
    for off, fmt, value in fields:
        struct.pack_into(fmt, buf, off, value)
    return buf


def _addr(obj) -> int:
    return ctypes.addressof(obj) if obj is not None else 0


# ---- maps ---------------------------------------------------------------------------------------
def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0,
               name: str = "") -> int:
    buf = _attr((0, "I", map_type), (4, "I", key_size), (8, "I", value_size), (12, "I", max_entries),
                (16, "I", flags))
    buf[28:28 + 15] = name.encode()[:15].ljust(15, b"\0")  # map_name[16] after inner_map_fd, numa_node
    return _bpf(MAP_CREATE, buf, f"MAP_CREATE {name}")


def map_info(fd: int) -> dict:
    """type, key_size, value_size, max_entries, flags and name of a map, from the kernel."""
    info = ctypes.create_string_buffer(80)
    _bpf(OBJ_GET_INFO_BY_FD, _attr((0, "I", fd), (4, "I", len(info)), (8, "Q", _addr(info))), "OBJ_GET_INFO_BY_FD")
    t, _id, ks, vs, n, flags = struct.unpack_from("6I", info, 0)
    return {"type": t, "key_size": ks, "value_size": vs, "max_entries": n, "flags": flags,
            "name": info.raw[24:40].split(b"\0")[0].decode()}


BATCH_BYTES = 128 << 10


class Map:
    """A map by its fd, keys and values as ctypes types of the map's sizes."""

    def __init__(self, fd: int, name: str, key_type, value_type) -> None:
        self.fd, self.name, self.key_type, self.value_type = fd, name, key_type, value_type
        self._batch_ok = True

    def _call(self, cmd: int, what: str, buf: ctypes.Array) -> bool:
        """False for ENOENT (no such key, or no key after it)."""
        if _syscall(SYS_BPF, cmd, buf, len(buf)) >= 0:
            return True
        err = ctypes.get_errno()
        if err == 2:  # ENOENT
            return False
        raise OSError(err, f"bpf({what} {self.name}): {os.strerror(err)}")

    def lookup(self, key):
        value = self.value_type()
        buf = _attr((0, "I", self.fd), (8, "Q", _addr(key)), (16, "Q", _addr(value)))
        return value if self._call(MAP_LOOKUP_ELEM, "MAP_LOOKUP_ELEM", buf) else None

    def update(self, key, value, flags: int = 0) -> None:
        _bpf(MAP_UPDATE_ELEM, _attr((0, "I", self.fd), (8, "Q", _addr(key)), (16, "Q", _addr(value)),
                                    (24, "Q", flags)), f"MAP_UPDATE_ELEM {self.name}")

    def delete(self, key) -> bool:
        """True when the key was there."""
        return self._call(MAP_DELETE_ELEM, "MAP_DELETE_ELEM", _attr((0, "I", self.fd), (8, "Q", _addr(key))))

    def keys(self) -> list:
        out = []
        prev, key = None, self.key_type()
        while True:
            buf = _attr((0, "I", self.fd), (8, "Q", _addr(prev)), (16, "Q", _addr(key)))
            if not self._call(MAP_GET_NEXT_KEY, "MAP_GET_NEXT_KEY", buf):
                return out
            out.append(key)
            prev, key = key, self.key_type()

    def items(self) -> list[tuple]:
        """Every (key, value): one BPF_MAP_LOOKUP_BATCH per 4096 entries where the map type has it
        (hash maps, Linux >= 5.6), else one lookup per key (entries deleted meanwhile are skipped)."""
        if self._batch_ok:
            try:
                return list(self._batch())
            except OSError as e:
                if e.errno not in (22, 95, 524):  # EINVAL, EOPNOTSUPP, ENOTSUPP: no batch ops here
                    raise
                self._batch_ok = False
        out = []
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:
                out.append((k, v))
        return out

    def _batch(self, chunk: int = 4096) -> Iterator[tuple]:
        for keys, values, n in self._batches(chunk):
            for i in range(n):
                yield type(keys[i]).from_buffer_copy(keys[i]), type(values[i]).from_buffer_copy(values[i])

    def raw_batches(self, chunk: int = 4096) -> Iterator[tuple[bytes, bytes, int]]:
        """Every entry as raw bytes, a batch at a time: (n keys, n values, n). For readers of many
        entries: decoding them with struct is several times faster than a ctypes object each.
        OSError where the map has no batch ops."""
        ks, vs = ctypes.sizeof(self.key_type), ctypes.sizeof(self.value_type)
        for keys, values, n in self._batches(chunk):
            yield ctypes.string_at(keys, n * ks), ctypes.string_at(values, n * vs), n

    def _batches(self, chunk: int) -> Iterator[tuple]:
        # at most BATCH_BYTES of buffers: 4096 of the communicators' 1 KiB values were 4.3 MiB
        # zeroed at each collection, kept by malloc between them
        chunk = max(1, min(chunk, BATCH_BYTES // (ctypes.sizeof(self.key_type) + ctypes.sizeof(self.value_type))))
        keys = (self.key_type * chunk)()
        values = (self.value_type * chunk)()
        token_in = ctypes.c_uint64(0)  # the opaque batch position (a bucket index for hash maps)
        token_out = ctypes.c_uint64(0)
        first = True
        while True:
            buf = _attr((0, "Q", 0 if first else _addr(token_in)), (8, "Q", _addr(token_out)),
                        (16, "Q", _addr(keys)), (24, "Q", _addr(values)), (32, "I", chunk), (36, "I", self.fd))
            r = _syscall(SYS_BPF, MAP_LOOKUP_BATCH, buf, len(buf))
            err = ctypes.get_errno() if r < 0 else 0
            if r < 0 and err != 2:  # ENOENT: this was the last batch
                if err == 28:  # ENOSPC: a bucket holds more than `chunk` entries
                    chunk *= 4
                    keys, values = (self.key_type * chunk)(), (self.value_type * chunk)()
                    continue
                raise OSError(err, f"bpf(MAP_LOOKUP_BATCH {self.name}): {os.strerror(err)}")
            n = struct.unpack_from("I", buf, 32)[0]
            yield keys, values, n
            if r < 0:
                return
            token_in.value, first = token_out.value, False


# ---- programs -----------------------------------------------------------------------------------
def prog_load(insns: bytes, name: str, license: str = "GPL", prog_type: int = PROG_KPROBE,
              expected_attach_type: int = 0, kern_version: int = 0) -> int:
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    buf = _attr((0, "I", prog_type), (4, "I", len(insns) // 8), (8, "Q", _addr(code)), (16, "Q", _addr(lic)),
                (40, "I", kern_version), (68, "I", expected_attach_type))
    buf[48:48 + 15] = name.encode()[:15].ljust(15, b"\0")  # prog_name[16] after prog_flags
    r = _syscall(SYS_BPF, PROG_LOAD, buf, len(buf))
    if r >= 0:
        return r
    err = ctypes.get_errno()
    log = ctypes.create_string_buffer(1 << 20)  # again, with the verifier's log
    struct.pack_into("IIQ", buf, 24, 1, len(log), _addr(log))
    r = _syscall(SYS_BPF, PROG_LOAD, buf, len(buf))
    if r >= 0:  # loads when logging: keep it
        return r
    raise VerifierError(err, name, log.value.decode(errors="replace")[-4000:])


def uprobe_multi_link(prog_fd: int, path: str, offsets: list[int], cookies: list[int], pid: int = 0,
                      retprobe: bool = False) -> int:
    """One BPF_TRACE_UPROBE_MULTI link: the program at every file offset of `path` (entry, or
    return with retprobe), cookie i at offset i, only in process `pid` (0: every process). Closing
    the fd detaches them all, in one RCU grace period."""
    n = len(offsets)
    p = ctypes.create_string_buffer(os.fsencode(path))
    offs = (ctypes.c_uint64 * n)(*offsets)
    cks = (ctypes.c_uint64 * n)(*cookies)
    buf = _attr((0, "I", prog_fd), (8, "I", ATTACH_UPROBE_MULTI), (16, "Q", _addr(p)), (24, "Q", _addr(offs)),
                (40, "Q", _addr(cks)), (48, "I", n), (52, "I", UPROBE_MULTI_RETURN if retprobe else 0),
                (56, "I", pid))
    return _bpf(LINK_CREATE, buf, f"LINK_CREATE uprobe_multi {os.path.basename(path)}")


# ---- perf-event uprobes (the fallback before Linux 6.6) ----------------------------------------
_PMU = "/sys/bus/event_source/devices/uprobe"


def _uprobe_pmu() -> tuple[int, int]:
    """The uprobe PMU's type and the config bit that makes a probe a return probe."""
    with open(f"{_PMU}/type") as f:
        pmu = int(f.read())
    with open(f"{_PMU}/format/retprobe") as f:  # "config:0"
        bit = int(f.read().strip().split(":")[1])
    return pmu, bit


def perf_uprobe(path: str, offset: int, pid: int = -1, retprobe: bool = False) -> int:
    """A uprobe perf event at a file offset (pid -1: every process, on one CPU slot as bcc does)."""
    pmu, bit = _uprobe_pmu()
    p = ctypes.create_string_buffer(os.fsencode(path))
    attr = ctypes.create_string_buffer(128)
    # perf_event_attr: type, size, config, sample_period, sample_type, read_format, flags, wakeup,
    # bp_type, config1 (uprobe_path), config2 (probe_offset)
    struct.pack_into("IIQQQQQIIQQ", attr, 0, pmu, 128, (1 << bit) if retprobe else 0, 1, 0, 0, 0, 1, 0,
                     _addr(p), offset)
    cpu = 0 if pid == -1 else -1
    fd = _syscall(SYS_PERF_EVENT_OPEN, attr, pid, cpu, -1, 8)  # PERF_FLAG_FD_CLOEXEC
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open(uprobe {os.path.basename(path)}+{offset:#x}): {os.strerror(err)}")
    return fd


def perf_event_link(prog_fd: int, perf_fd: int, cookie: int) -> int:
    """The program on a perf event, with a cookie (BPF_LINK_CREATE BPF_PERF_EVENT, Linux >= 5.15)."""
    return _bpf(LINK_CREATE, _attr((0, "I", prog_fd), (4, "I", perf_fd), (8, "I", ATTACH_PERF_EVENT),
                                   (16, "Q", cookie)), "LINK_CREATE perf_event")


# ---- ring buffer --------------------------------------------------------------------------------
_BUSY, _DISCARD, _HDR = 1 << 31, 1 << 30, 8


class RingBuffer:
    """The consumer side of a BPF_MAP_TYPE_RINGBUF map (the kernel's protocol: a consumer page we
    write, a producer page and the data pages mapped twice, read-only)."""

    def __init__(self, fd: int, size: int, on_record: Callable[[memoryview], None]) -> None:
        self.fd, self.size, self.on_record = fd, size, on_record
        page = mmap.PAGESIZE
        self._cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = memoryview(self._prod)[page:]
        self._mask = size - 1
        self._poll = select.epoll()
        self._poll.register(fd, select.EPOLLIN)
        # wake(): a thread waiting on the ring returns at once (a stop does not wait out its timeout)
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._poll.register(self._wake, select.EPOLLIN)

    def consume(self) -> int:
        """Hand every committed record to on_record; how many."""
        cons = struct.unpack_from("Q", self._cons, 0)[0]
        n = 0
        while True:
            prod = struct.unpack_from("Q", self._prod, 0)[0]
            if cons >= prod:
                break
            while cons < prod:
                hdr = struct.unpack_from("I", self._data, cons & self._mask)[0]
                if hdr & _BUSY:
                    struct.pack_into("Q", self._cons, 0, cons)
                    return n
                length = hdr & ~(_BUSY | _DISCARD)
                start = (cons & self._mask) + _HDR
                if not hdr & _DISCARD:
                    self.on_record(self._data[start:start + length])
                    n += 1
                cons += (length + _HDR + 7) & ~7
                struct.pack_into("Q", self._cons, 0, cons)
        return n

    def wait(self, timeout_ms: int) -> bool:
        """Whether records came within timeout_ms (taken by the next consume())."""
        return bool(self._poll.poll(timeout_ms / 1000))

    def poll(self, timeout_ms: int) -> int:
        if self._poll.poll(timeout_ms / 1000):
            return self.consume()
        return 0

    def wake(self) -> None:
        """End every wait() and poll() now and from now on (the waiter checks why it woke)."""
        os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        self._poll.close()
        os.close(self._wake)
        self._data.release()
        self._prod.close()
        self._cons.close()


def close_all(fds) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
