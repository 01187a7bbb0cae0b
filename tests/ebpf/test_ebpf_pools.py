"""Pooled or not: the eBPF probe attributes live driver allocations to a pool allocator by their
allocating call stacks (probes/ebpf/pools.py), on real uprobes on the fake libcuda.so.1.

tests/ebpf/allocs.c takes memory from libfakepool.so (a pool: 32 MiB chunks) and with plain calls;
both reach cuMemAlloc_v2 through libfakert.so (a cudart stand-in), so the caller of the API is the
same library either way and only the frames beyond it tell one from the other, as for PyTorch's
caching allocator over libcudart. libfakepool.so is a pool only because the test's setting says so.
"""
from __future__ import annotations

import pytest

from gpuwatch.agent.metrics import REGISTRY
from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.agent.allocators import OUTSIDE, pool_table
from gpuwatch.probes.ebpf import pools

pytestmark = pytest.mark.root

MIB = 1 << 20
CHUNK = 32 * MIB  # fakepool.c's POOL_CHUNK
SETTING = "libfakepool.so=fakepool"  # ebpf.pool_libraries


@pytest.fixture(scope="module")
def probe(fake_cuda):
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], rescan_interval=3600, pools=pool_table(SETTING))
    p.start()
    yield p
    p.shutdown()


def _series(samples, metric: str, pid: int) -> dict:
    out = {}
    for s in samples:
        if s.metric == metric and s.labels["pid"] == str(pid):
            REGISTRY[s.metric]  # a registered metric, with its labels
            assert set(s.labels) == set(REGISTRY[s.metric].labels)
            out[s.labels.get("allocator", "")] = s.value
    return out


def _work(a) -> None:
    a.send(*["pool 20971520"] * 3)  # 3 x 20 MiB from the pool: three 32 MiB chunks from the driver
    a.send("plain 7340032", "plain 7340032")  # 2 x 7 MiB through the runtime, as cudaMalloc
    a.send("driver 3145728")  # 3 MiB with cuMemAlloc_v2 itself


def test_a_pools_chunks_are_pooled_and_plain_calls_outside_any_allocator(probe, allocs):
    a = allocs()
    _work(a)
    samples = probe.collect()
    assert _series(samples, "gpuwatch.process.cuda.memory.live", a.pid) == {"": 3 * CHUNK + 17 * MIB}
    assert _series(samples, "gpuwatch.process.cuda.memory.pooled", a.pid) == {"fakepool": 3 * CHUNK}
    stacks = probe.snapshot(a.pid)["stacks"]
    by: dict[str, list[int]] = {}
    for st in stacks:
        acc = by.setdefault(st["allocator"], [0, 0])
        acc[0] += st["bytes"]
        acc[1] += st["allocations"]
    assert by == {"fakepool": [3 * CHUNK, 3], OUTSIDE: [17 * MIB, 3]}
    for st in stacks:
        frames = " ".join(st["frames"])
        assert st["frames"][0].startswith("cuMemAlloc_v2") and st["frames"][0].endswith("[libcuda.so.1]")
        if st["allocator"] == "fakepool":  # the caller is the runtime; the pool is further out
            assert st["frames"][1].endswith("[libfakert.so]") and "pool_grow+" in frames, st["frames"]
        elif "fakert_malloc+" in st["frames"][1]:
            assert "plain+" in frames and "[libfakepool.so]" not in frames, st["frames"]
        else:
            assert st["frames"][1].startswith("main+"), st["frames"]  # cuMemAlloc_v2 from main itself
    # What a finding points at: the stacks of one pool, of any pool, or outside any allocator.
    pooled = [st for st in stacks if st["allocator"] == "fakepool"]
    assert probe.live_stacks(a.pid, top=8, allocator="fakepool") == pooled
    assert probe.live_stacks(a.pid, top=8, allocator="*") == pooled
    assert probe.live_stacks(a.pid, top=8, allocator=OUTSIDE) == [st for st in stacks if st not in pooled]
    assert probe.live_stacks(a.pid, top=8, allocator="pytorch") == []
    # The pool gives its chunks back: its series stays, at 0; the plain bytes are still there.
    a.send("release")
    samples = probe.collect()
    assert _series(samples, "gpuwatch.process.cuda.memory.pooled", a.pid) == {"fakepool": 0}
    assert _series(samples, "gpuwatch.process.cuda.memory.live", a.pid) == {"": 17 * MIB}


def test_without_frame_pointers_the_pool_is_found_by_unwinding_the_stack_copy(probe, allocs, fake_cuda):
    """The same pool, runtime and program built -O2 -fomit-frame-pointer: the frame-pointer walk
    loses every frame between libcuda's caller and the program, the pool's among them (before the
    stack copies, its chunks were outside any allocator); unwound with .eh_frame, it is there."""
    a = allocs(path=fake_cuda["allocs_nofp"])
    _work(a)
    samples = probe.collect()
    assert _series(samples, "gpuwatch.process.cuda.memory.live", a.pid) == {"": 3 * CHUNK + 17 * MIB}
    assert _series(samples, "gpuwatch.process.cuda.memory.pooled", a.pid) == {"fakepool": 3 * CHUNK}
    stacks = probe.snapshot(a.pid)["stacks"]
    by: dict[str, int] = {}
    for st in stacks:
        by[st["allocator"]] = by.get(st["allocator"], 0) + st["bytes"]
    assert by == {"fakepool": 3 * CHUNK, OUTSIDE: 17 * MIB}
    for st in stacks:
        frames = " ".join(st["frames"])
        if st["allocator"] == "fakepool":  # the whole chain: runtime, pool, program
            assert st["frames"][1].startswith("fakert_malloc+") and "pool_grow" in frames and "pooled" in frames, frames
            assert frames.index("pool_grow") < frames.index("pooled") < frames.index("main+"), frames
        elif "fakert_malloc+" in st["frames"][1]:
            assert "plain" in frames and "[libfakepool.so]" not in frames, frames
    assert probe.loader.unwound >= 3


def test_without_the_setting_the_same_pool_is_outside_any_allocator(fake_cuda, allocs):
    # The built-in table knows no libfakepool.so: its chunks are plain driver allocations.
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], rescan_interval=3600)
    p.start()
    try:
        a = allocs()
        _work(a)
        samples = p.collect()
        assert _series(samples, "gpuwatch.process.cuda.memory.live", a.pid) == {"": 3 * CHUNK + 17 * MIB}
        assert _series(samples, "gpuwatch.process.cuda.memory.pooled", a.pid) == {}
        assert {st["allocator"] for st in p.snapshot(a.pid)["stacks"]} == {OUTSIDE}
    finally:
        p.shutdown()


def test_pooled_bytes_of_processes_beyond_max_processes_are_folded_into_other(fake_cuda, allocs):
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], rescan_interval=3600, max_processes=1, pools=pool_table(SETTING))
    p.start()
    try:
        busy, quiet = allocs(), allocs()
        busy.send(*["plain 4096"] * 5)  # the busiest process keeps its series
        quiet.send("pool 1024")
        samples = p.collect()
        assert _series(samples, "gpuwatch.process.cuda.memory.pooled", busy.pid) == {}
        assert _series(samples, "gpuwatch.process.cuda.memory.pooled", quiet.pid) == {}
        assert [(s.labels, s.value) for s in samples if s.metric == "gpuwatch.process.cuda.memory.pooled"] == [
            ({"pid": "other", "process": "other", "allocator": "fakepool"}, float(CHUNK))]
    finally:
        p.shutdown()


def test_classification_is_cached_per_stack_and_mappings_read_once(probe, allocs, drivers, monkeypatch):
    reads, lookups, passes = [], [], []
    real_maps, ld = pools._Maps, probe.loader

    class CountedMaps(real_maps):
        def __init__(self, pid, *args):
            reads.append(pid)
            super().__init__(pid, *args)

    real_addresses, real_pass = ld.stack_addresses, ld.live_by_pid_stack
    monkeypatch.setattr(pools, "_Maps", CountedMaps)
    monkeypatch.setattr(ld, "stack_addresses", lambda *a, **kw: lookups.append(a) or real_addresses(*a, **kw))
    monkeypatch.setattr(ld, "live_by_pid_stack", lambda: passes.append(1) or real_pass())
    # A process that maps no pool library: its live allocations are not even read.
    d = drivers()
    d.go()
    probe.collect()
    assert passes == [] and reads == [d.pid]
    d.finish()
    probe.collect()  # gone: forgotten
    a = allocs()
    _work(a)
    probe.collect()
    first = len(lookups)
    assert first >= 2 and reads.count(a.pid) == 1  # a stack each (the compiler may split a call site)
    for _ in range(3):
        a.send("pool 20971520", "plain 7340032")  # more allocations from the same stacks
        samples = probe.collect()
    assert len(lookups) == first and reads.count(a.pid) == 1 and len(passes) == 4
    assert _series(samples, "gpuwatch.process.cuda.memory.pooled", a.pid)["fakepool"] > 3 * CHUNK


def test_a_slow_pass_over_the_live_allocations_is_not_redone_at_every_collection(fake_cuda, allocs):
    # A pass taking 0.5 s (as a million live allocations would) is redone after 10 s (5 % of the time);
    # meanwhile the last split is kept, capped at the live bytes.
    now = [1000.0]
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], rescan_interval=3600, pools=pool_table(SETTING),
                      clock=lambda: now[0])
    p.start()
    try:
        timer = iter(x * 0.5 for x in range(100))
        p._pool_timer = lambda: next(timer)  # each pass "takes" 0.5 s
        a = allocs()
        a.send("pool 1024", "plain 4096")
        pooled = lambda: _series(p.collect(), "gpuwatch.process.cuda.memory.pooled", a.pid)  # noqa: E731
        assert pooled() == {"fakepool": CHUNK}
        a.send("pool 33554432")  # a second chunk
        now[0] += 9.9
        assert pooled() == {"fakepool": CHUNK}  # the last split, for 10 s
        a.send("release")
        assert pooled() == {"fakepool": 4096}  # capped at the live bytes (the plain 4096 bytes)
        now[0] += 0.1
        assert pooled() == {"fakepool": 0}  # 10 s on: read again
    finally:
        p.shutdown()
