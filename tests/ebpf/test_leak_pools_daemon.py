"""The leak detector's colors from who allocates, through a real agent: its eBPF probe on the fake
libcuda.so.1, told that libfakepool.so is a pool (ebpf.pool_libraries), and NVML replayed from the
H200 with the two leaking processes charged more every second (an edit of the recording).

Two tests/ebpf/allocs.c processes leak, neither with an in-process agent: one through the pool
(its chunks are grey: the finding names the pool), one with plain calls (black: outside any
allocator, with the stacks that hold it). Before the allocating stacks were told apart, both were
grey ("the allocator's pool"). The same two again, with the program, the pool and the runtime built
-O2 -fomit-frame-pointer (as CuPy's modules, XLA and RMM are): before allocation stacks were unwound
from their copies with .eh_frame, the pool's leak was black too ("plain cuMemAlloc/cudaMalloc calls").
A finding needs a minute of growth: this takes about 70 s.
"""
from __future__ import annotations

import time

import pytest

from gpuwatch.agent.control import ControlError, call
from tests.conftest import Agent, nvml_listing, series

pytestmark = pytest.mark.root

MIB = 1 << 20
def _open_leaks(agent: Agent) -> dict[str, dict]:
    try:
        found = call(str(agent.socket), "findings", {"kind": "memory_leak"})["open"]
    except ControlError:
        return {}
    return {f["pid"]: f for f in found}


def test_a_pools_leak_is_grey_and_named_and_plain_calls_are_black(tmp_path, allocs, fake_cuda):
    pooled, plain = allocs(), allocs()
    pooled_nofp, plain_nofp = allocs(path=fake_cuda["allocs_nofp"]), allocs(path=fake_cuda["allocs_nofp"])
    pids = [pooled.pid, plain.pid, pooled_nofp.pid, plain_nofp.pid]
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(nvml_listing(tmp_path, pids)),
                  "--nvml-slow-interval", "1", "--ebpf-library", fake_cuda["lib"],
                  "--ebpf-pool-libraries", "libfakepool.so=fakepool", "--no-baseline", "--no-cupti-sampling")
    try:
        deadline = time.monotonic() + 60
        while 'gpuwatch_probe_up{probe="ebpf"} 1' not in agent.metrics():
            assert time.monotonic() < deadline, agent.output()
            time.sleep(0.2)
        for p in (pooled, pooled_nofp):
            p.send("leak pool 4194304 50")  # 80 MiB/s from the pool: a 32 MiB chunk every 0.4 s
        for p in (plain, plain_nofp):
            p.send("leak plain 16777216 250")  # 64 MiB/s of plain cudaMalloc-like calls
        deadline = time.monotonic() + 150
        while len(leaks := _open_leaks(agent)) < 4:
            assert time.monotonic() < deadline, f"findings {leaks} after 150 s:\n{agent.output()[-3000:]}"
            time.sleep(2)
        # without frame pointers: the pool's leak is grey with the pool named, the plain calls black
        grey, black = leaks[str(pooled_nofp.pid)], leaks[str(plain_nofp.pid)]
        assert (black["color"], black.get("allocator")) == ("black", "none"), black["summary"]
        assert (grey["color"], grey.get("allocator")) == ("grey", "fakepool"), grey["summary"]
        assert all("pool_grow" in " ".join(s["frames"]) for s in grey["stacks"]), grey["stacks"]
        assert all("plain" in " ".join(s["frames"]) and "[libfakepool.so]" not in " ".join(s["frames"])
                   for s in black["stacks"]), black["stacks"]
        grey, black = leaks[str(pooled.pid)], leaks[str(plain.pid)]
        # the plain calls first: eBPF's live bytes alone once made them grey, "the allocator's pool"
        assert (black["color"], black["grey_source"], black.get("allocator")) == ("black", "ebpf", "none")
        assert ("memory outside any allocator (black: plain cuMemAlloc/cudaMalloc calls outside any allocator "
                "grow)" in black["summary"]), black["summary"]
        assert black["stacks"] and {s["allocator"] for s in black["stacks"]} == {"none"}
        assert all("plain+" in " ".join(s["frames"]) for s in black["stacks"])
        assert (grey["color"], grey["grey_source"], grey.get("allocator")) == ("grey", "ebpf", "fakepool")
        assert ("is leaking" in grey["summary"] and "the allocator's pool (grey: driver allocations made by the "
                "fakepool (libfakepool.so) grow)" in grey["summary"]), grey["summary"]
        assert grey["stacks"] and {s["allocator"] for s in grey["stacks"]} == {"fakepool"}
        assert all("[libfakepool.so]" in " ".join(s["frames"]) for s in grey["stacks"])
        text = agent.metrics()
        pooled_bytes = series(text, "gpuwatch_process_cuda_memory_pooled_bytes")
        assert [k for k in pooled_bytes if f'pid="{pooled.pid}"' in k] == [
            f'{{pid="{pooled.pid}",process="allocs",allocator="fakepool"}}']
        assert not [k for k in pooled_bytes if f'pid="{plain.pid}"' in k]
    finally:
        agent.stop()
