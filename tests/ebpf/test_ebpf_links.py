"""Multi-uprobe links against the fake libcuda: exact counts on links and on the perf-event
fallback, libraries that come and go, and the launch duty cycle (a fake clock drives the windows;
the uprobes are real: the int3 in the traced process's text says what is attached)."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.ebpf.symbols import SAMPLED_APIS
from tests.ebpf.test_ebpf_cuda import EXPECTED, _probe_fds, _uprobes_installed

pytestmark = pytest.mark.root

LAUNCHES = {api: v[0] for api, v in EXPECTED.items() if api in SAMPLED_APIS}
EXACT = {api: v for api, v in EXPECTED.items() if api not in SAMPLED_APIS}


def _calls(snap: dict) -> dict:
    return {api: (a["calls"], a["errors"], a["bytes"]) for api, a in snap["apis"].items()}


def test_perf_event_fallback_counts_every_api_exactly(fake_cuda, drivers):
    """ebpf.attach = perf_events (what kernels before 6.6 get): the same programs on one perf
    event per probe, told apart by the same cookies: every count, error and byte exact."""
    d = drivers()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, attach="perf_events")
    p.start()
    try:
        assert p.loader.method == "perf_events"
        d.go()
        assert _calls(p.snapshot(d.pid)) == EXPECTED
    finally:
        p.shutdown(wait=False)  # ~0.1 s per perf event: in the background
    assert p.wait_detached(60)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _launch_installed(pid: int, lib: str) -> list[bool]:
    return _uprobes_installed(pid, lib, ("cuLaunchKernel", "cuMemAlloc_v2"))


def test_launch_duty_cycle_estimates_launches_and_keeps_the_rest_exact(fake_cuda_private, drivers):
    lib = fake_cuda_private["lib"]
    clock = Clock()
    # budget 0, no new-process hold: the duty cycle itself, whatever the rate
    p = EbpfCudaProbe(libraries=[lib], launch_sampling=0.1, sampling_period=10.0, clock=clock,
                      exact_launch_rate=0, young_seconds=0)
    p.start()
    try:
        a = drivers(fake_cuda_private["driver"])
        assert _launch_installed(a.pid, lib) == [True, True]
        a.go()  # inside the first window: seen, counted once
        p.collect()
        clock.t += 1.0
        samples = p.collect()  # the window (1 s of 10) closes: the launch link goes
        b = drivers(fake_cuda_private["driver"])
        assert _launch_installed(b.pid, lib) == [False, True]  # allocations stay probed
        b.go()  # between windows: its launches are not seen, everything else is
        snap_b = p.snapshot(b.pid)
        assert _calls(snap_b) == EXACT
        assert p.snapshot(a.pid)["kernels"] and not snap_b["kernels"]

        def calls(samples, pid):
            return {s.labels["api"]: s.value for s in samples if s.metric == "gpuwatch.cuda.calls"
                    and s.labels["pid"] == str(pid) and s.labels["api"] in SAMPLED_APIS}

        assert calls(samples, a.pid) == LAUNCHES  # a closed window, not scaled yet: as seen
        clock.t += 9.0
        samples = p.collect()  # the next window opens: the last one is scaled by its cycle (10 s / 1 s)
        assert _launch_installed(b.pid, lib) == [True, True]
        assert calls(samples, a.pid) == {api: 10 * n for api, n in LAUNCHES.items()}
        ratio = [s.value for s in samples if s.metric == "gpuwatch.ebpf.launch.sampled"]
        assert ratio == [pytest.approx(0.1)]
        # every other API exact for both, whatever the windows
        for d in (a, b):
            got = {s.labels["api"]: s.value for s in samples if s.metric == "gpuwatch.cuda.calls"
                   and s.labels["pid"] == str(d.pid) and s.labels["api"] not in SAMPLED_APIS}
            assert got == {api: v[0] for api, v in EXACT.items()}
        # a trace through the daemon: launches on at once, however the cycle stands
        clock.t += 1.0
        p.collect()
        assert _launch_installed(b.pid, lib) == [False, True]
        p.query(b.pid, exact_launches=60.0)
        assert _launch_installed(b.pid, lib) == [True, True]
        clock.t += 30.0
        p.collect()  # still within the 60 s asked for
        assert _launch_installed(b.pid, lib) == [True, True]
    finally:
        p.shutdown()


def test_every_launch_stays_probed_while_cheap_and_is_sampled_once_costly(fake_cuda_private, drivers):
    """The duty cycle applies only above the node-wide launch budget (ebpf.launch_budget), which is
    exported beside the rate measured."""
    lib = fake_cuda_private["lib"]
    clock = Clock()
    budget = 2 * sum(LAUNCHES.values())  # launches per second
    p = EbpfCudaProbe(libraries=[lib], launch_sampling=0.1, sampling_period=10.0, clock=clock,
                      exact_launch_rate=budget, young_seconds=0)
    p.start()
    try:
        a = drivers(fake_cuda_private["driver"])
        p.collect()
        a.go()  # its launches within the next second: half the budget
        for _ in range(3):
            clock.t += 1.0
            samples = p.collect()
            assert _launch_installed(a.pid, lib) == [True, True]  # a window longer than 1 s of 10
        rate = {s.labels["what"]: s.value for s in samples if s.metric == "gpuwatch.ebpf.launch.rate"}
        assert rate == {"measured": 0.0, "budget": budget}  # none in the last second
        p.exact_launch_rate = 0  # now every rate is too costly: the window closes
        clock.t += 1.0
        p.collect()
        assert _launch_installed(a.pid, lib) == [False, True]
        clock.t += 8.0
        p.collect()  # off for 9 s of each 10
        assert _launch_installed(a.pid, lib) == [False, True]
        clock.t += 1.0
        p.collect()
        assert _launch_installed(a.pid, lib) == [True, True]
    finally:
        p.shutdown()


def test_a_new_process_turns_every_launch_on_at_its_first_call(fake_cuda_private, drivers):
    """Above the budget, a process's first CUDA call turns the launch probes on at once (not at the
    next collection), for young_seconds: what a server captures at its start is seen whole."""
    lib = fake_cuda_private["lib"]
    clock = Clock()
    p = EbpfCudaProbe(libraries=[lib], launch_sampling=0.1, sampling_period=10.0, clock=clock,
                      exact_launch_rate=0, young_seconds=120)
    p.start()
    try:
        p.collect()
        clock.t += 1.0
        p.collect()
        ld = p.loader
        assert not ld.launches_on
        d = drivers(fake_cuda_private["driver"])
        d.go()  # its first CUDA call
        deadline = time.monotonic() + 5
        while not ld.launches_on:
            assert time.monotonic() < deadline, "a first CUDA call did not turn the launch probes on"
            time.sleep(0.01)
        clock.t += 100.0
        p.collect()
        assert ld.launches_on  # within its first 120 s
        clock.t += 30.0
        p.collect()
        assert not ld.launches_on
    finally:
        p.shutdown()


def test_a_library_appearing_and_going_is_attached_and_detached(fake_cuda, tmp_path, drivers):
    """System-wide scan: a copy of libcuda in a directory of its own (a container's copy) is
    attached at the rescan after a process maps it, and detached at the rescan after the last
    process that mapped it exited and the file is gone; the other libcuda stays."""
    copy_dir = tmp_path / "container"
    copy_dir.mkdir()
    for name in ("libcuda.so.1", "driver"):
        shutil.copy(fake_cuda["lib" if name.startswith("lib") else "driver"], copy_dir / name)
    os.chmod(copy_dir / "driver", 0o755)
    clock = Clock()
    host = drivers()  # maps the first libcuda
    p = EbpfCudaProbe(rescan_interval=10.0, apis=("cuMemAlloc_v2", "cuLaunchKernel"), clock=clock)
    p.start()
    links = _probe_fds()
    try:
        paths = lambda: {lib["path"] for lib in p.attached()}  # noqa: E731
        assert fake_cuda["lib"] in paths()
        env = dict(os.environ, LD_LIBRARY_PATH=str(copy_dir))
        # the copied driver's rpath names the original directory: LD_LIBRARY_PATH does not win over
        # DT_RPATH, so load the copy by preloading it
        env["LD_PRELOAD"] = str(copy_dir / "libcuda.so.1")
        import subprocess

        from tests.ebpf.conftest import Driver
        proc = subprocess.Popen([str(copy_dir / "driver")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env)
        c = Driver.__new__(Driver)
        c.proc = proc
        c.pid = int(proc.stdout.readline().split()[1])
        clock.t += 10.0
        p.collect()  # the rescan
        assert str(copy_dir / "libcuda.so.1") in {os.path.realpath(x) for x in paths()} or \
            any(x.endswith("/container/libcuda.so.1") for x in paths())
        assert _probe_fds() == links + 3  # its links: return probes, entries, launch entries
        c.go()
        assert p.snapshot(c.pid)["apis"]["cuMemAlloc_v2"]["calls"] == EXPECTED["cuMemAlloc_v2"][0]
        c.finish()
        shutil.rmtree(copy_dir)
        clock.t += 10.0
        p.collect()
        assert not any("container" in x for x in paths()) and fake_cuda["lib"] in paths()
        assert _probe_fds() == links
        host.go()
        assert p.snapshot(host.pid)["apis"]["cuMemAlloc_v2"]["calls"] == EXPECTED["cuMemAlloc_v2"][0]
    finally:
        p.shutdown()


NOP_PROGRAM = bytes.fromhex("b700000000000000" "9500000000000000")  # r0 = 0; exit: counts nothing


def _planted(where, mode_dir: int, mode_file: int) -> str:
    """A copy of the real compiled object under its own name, its programs replaced by ones that
    count nothing: what someone who may write in the cache would plant to blind the probe."""
    import base64
    import json

    from gpuwatch.probes.ebpf import compiler
    compiler.compiled()  # the run's own cache holds the real object now
    key = compiler.cache_key(compiler.bpf_text())
    with open(os.path.join(os.environ["GPUWATCH_BPF_CACHE"], f"{key}.json")) as f:
        data = json.load(f)
    for prog in data["programs"].values():
        prog["insns"], prog["maps"] = base64.b64encode(NOP_PROGRAM).decode(), []
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, f"{key}.json")
    with open(path, "w") as f:
        json.dump(data, f)
    os.chmod(path, mode_file)
    os.chmod(where, mode_dir)
    return path


@pytest.mark.parametrize("mode_dir,mode_file,why", [(0o777, 0o600, "others may write in it"),
                                                    (0o700, 0o666, "others may write it")])
def test_a_planted_compiled_object_is_never_loaded(fake_cuda, drivers, tmp_path, monkeypatch, caplog,
                                                   mode_dir, mode_file, why):
    """A cache anyone else may write is input like any other: the probe compiles its own and
    counts exactly, and says why once."""
    where = str(tmp_path / "cache")
    _planted(where, mode_dir, mode_file)
    monkeypatch.setenv("GPUWATCH_BPF_CACHE", where)
    d = drivers()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid)
    with caplog.at_level("WARNING", logger="gpuwatch.ebpf"):
        p.start()
    try:
        assert not p.loader.cached
        d.go()
        assert _calls(p.snapshot(d.pid)) == EXPECTED
    finally:
        p.shutdown()
    assert why in caplog.text


def test_the_planted_object_would_blind_a_probe_that_trusted_it(fake_cuda, drivers, tmp_path, monkeypatch):
    """The attack above is real: the same object in a cache only root may write (as if root had
    written it) is loaded, and the probe then counts nothing. Keep the cache root's alone."""
    where = str(tmp_path / "cache")
    _planted(where, 0o700, 0o600)
    monkeypatch.setenv("GPUWATCH_BPF_CACHE", where)
    d = drivers()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid)
    p.start()
    try:
        assert p.loader.cached
        d.go()
        assert p.snapshot(d.pid)["apis"] == {}
    finally:
        p.shutdown()


def test_out_of_memory_from_the_driver_is_an_event_once(fake_cuda, drivers):
    """driver.c's five 1 GiB cuMemAlloc_v2 calls fail with CUDA_ERROR_OUT_OF_MEMORY: one
    "cuda.oom" event says so (the runner scores it against the leak forecast, agent/oom.py)."""
    d = drivers()
    p = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, driver_names=False)
    p.start()
    try:
        p.collect()
        assert p.events() == []
        d.go()
        p.collect()
        events = p.events()
        assert [(e.kind, e.attrs["pid"], e.attrs["api"], e.attrs["errors"]) for e in events] == \
            [("cuda.oom", str(d.pid), "cuMemAlloc_v2", 5)]
        assert events[0].attrs["process"] == "driver"
        p.collect()
        assert p.events() == []  # counted once
    finally:
        p.shutdown()


def test_symbols_read_while_loading_are_used_only_for_the_same_file(fake_cuda, fake_nccl, tmp_path, caplog):
    """Loader(prefetch=[path]) reads a library's symbols while the kernel verifies the programs.
    attach() takes them only for the file they were read from (device, inode): what it attaches is
    what a fresh read gives; a path replaced since (another inode) is read again; a file that is
    no ELF attaches nothing and says so, as without the prefetch."""
    from gpuwatch.probes.ebpf import loader

    def attached(ld: loader.Loader, path: str) -> tuple:
        lib = ld.attach(path)
        return lib.nccl, sorted(lib.attached), lib.uprobes

    path = str(tmp_path / "libcuda.so.1")
    shutil.copy(fake_cuda["lib"], path)
    plain = loader.Loader()
    try:
        want = attached(plain, path)
    finally:
        plain.close()
    assert want[0] is False and "cuLaunchKernel" in want[1] and want[2] > 0

    ld = loader.Loader(prefetch=[path])
    try:
        assert attached(ld, path) == want
    finally:
        ld.close()

    ld = loader.Loader(prefetch=[path])
    try:
        if ld._prefetch is not None:
            ld._prefetch.join()  # read: the libcuda's symbols are kept for its inode
        shutil.copy(fake_nccl["lib"], tmp_path / "new")
        os.replace(tmp_path / "new", path)  # the path is another file now
        nccl, names, uprobes = attached(ld, path)
        assert nccl and "ncclAllReduce" in names and "cuLaunchKernel" not in names and uprobes > 0
    finally:
        ld.close()

    (tmp_path / "junk").write_bytes(b"not an ELF file" * 100)
    os.replace(tmp_path / "junk", path)
    ld = loader.Loader(prefetch=[path])
    try:
        with caplog.at_level("WARNING", logger="gpuwatch.ebpf"):
            assert attached(ld, path) == (False, [], 0)
        assert "is not a readable ELF file" in caplog.text
    finally:
        ld.close()


@pytest.mark.parametrize("prefetch", [True, False], ids=["returns linked while loading", "linked at attach"])
def test_a_process_gone_before_its_links_is_said_once_either_way(fake_cuda, prefetch):
    """With the return probes linked while the entry program is verified, a traced process that
    no longer exists is still the one clear error at attach(), and nothing stays attached."""
    import subprocess

    from gpuwatch.agent.api import ProbeUnavailable
    from gpuwatch.probes.ebpf import loader

    gone = subprocess.Popen(["true"])
    gone.wait()
    ld = loader.Loader(pid=gone.pid, prefetch=[fake_cuda["lib"]] if prefetch else ())
    try:
        with pytest.raises(ProbeUnavailable, match=f"process {gone.pid} does not exist"):
            ld.attach(fake_cuda["lib"])
        assert ld.libraries == {} and ld._early == {}
    finally:
        ld.close()


def test_return_probes_linked_while_loading_go_with_close_when_never_attached(fake_cuda_private, drivers):
    """A probe whose start fails between the load and attach() (a bad events file, say) closes its
    Loader: the return probes linked early for the library named are detached with it."""
    from gpuwatch.probes.ebpf import loader
    from tests.ebpf.test_ebpf_cuda import _first_byte

    lib = fake_cuda_private["lib"]
    d = drivers(fake_cuda_private["driver"])
    ld = loader.Loader(prefetch=[lib])
    try:
        assert ld._early, "the return probes were not linked while loading"
        assert _first_byte(d.pid, lib, "cuMemAlloc_v2") == 0xCC  # a return probe: the int3 is at the entry
    finally:
        ld.close()
    assert ld._early == {}
    assert _first_byte(d.pid, lib, "cuMemAlloc_v2") != 0xCC
