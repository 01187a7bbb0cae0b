"""Finding libcuda in /proc/PID/maps when the paths are hostile: spaces, parentheses, quotes,
newlines (the kernel writes \\012), invalid UTF-8, deleted files. A real process maps real files;
no eBPF is involved (this is how the eBPF probe and `gpuwatch trace` find what to attach to)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuwatch.probes.ebpf import loader

_MAPPER = """
import mmap, os, sys, time
maps = []
for p in sys.argv[1:]:
    fd = os.open(os.fsencode(bytes.fromhex(p)), os.O_RDONLY)
    maps.append(mmap.mmap(fd, 4096, prot=mmap.PROT_READ))
    os.close(fd)
print("ready", flush=True)
time.sleep(30)
"""


def test_hostile_paths_are_found_exactly_and_deleted_ones_skipped(tmp_path):
    base = os.fsencode(tmp_path)
    names = [b"/my dir (1)/libcuda.so.1", b"/quo\"te's\\/libcuda.so.1", b"/new\nline/libcuda.so.1",
             b"/bad\xff\xfeutf8/libcuda.so.1", b"/trailing space /libcuda.so.1", b"/plain/other.so"]
    paths = [base + n for n in names]
    gone = base + b"/gone/libcuda.so.1"
    for p in paths + [gone]:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    child = subprocess.Popen([sys.executable, "-c", _MAPPER, *(p.hex() for p in paths + [gone])],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        os.unlink(gone)  # now a "(deleted)" mapping
        found = loader.mapped_files(child.pid)
        ours = [os.fsencode(p) for p in found if os.fsencode(p).startswith(base)]
        assert sorted(ours) == sorted(paths)
        cuda = loader.libraries_in(child.pid, loader.LIBCUDA_RE)
        assert len(cuda) == 5
        for p in cuda:
            assert os.path.exists(p), p  # reachable through /proc/PID/root, bytes intact
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_maps_nothing():
    p = subprocess.Popen(["true"])
    p.wait()
    assert loader.mapped_files(p.pid) == []
