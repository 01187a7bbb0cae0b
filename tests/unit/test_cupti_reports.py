"""The daemon's side of the in-process agents: report checking, keeping, watching, samples."""
import copy
import os

import pytest

from gpuwatch.agent import metrics, wire
from gpuwatch.probes.cupti import reports as R
from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings
from gpuwatch.probes.process.identity import ProcessIdentity, identify, sanitise_process_name

UUID = "GPU-5a4c2d1e-0f6b-4c1d-9e2a-7b3c4d5e6f70"


def report(**over) -> dict:
    base = {
        "version": 1, "pid": 123, "process": "python3", "started": 1.0, "ts": 2.0,
        "cupti": {"state": "on", "reason": "", "mode": "sampled", "observed_seconds": 1.5, "records": 40,
                  "dropped": 0, "decode_seconds": 0.0001},
        "kernels": [
            {"name": "_Z6gemm_kv", "device": 0, "uuid": UUID, "launches": 20, "gpu_seconds": 0.004,
             "min_seconds": 0.0002, "max_seconds": 0.0002, "grid": [132, 1, 1], "block": [384, 1, 1],
             "registers": 168, "static_shared_memory": 0, "dynamic_shared_memory": 213188,
             "carveout": None, "occupancy": 0.1875, "occupancy_limiter": "shared_memory"},
            {"name": "add_kernel", "device": 0, "uuid": UUID, "launches": 1000, "gpu_seconds": 0.002,
             "min_seconds": 1e-6, "max_seconds": 3e-6, "grid": [1024, 1, 1], "block": [128, 1, 1],
             "registers": 16, "static_shared_memory": 0, "dynamic_shared_memory": 0, "carveout": None,
             "occupancy": 1.0, "occupancy_limiter": "warps"},
        ],
        "kernels_other": {"variants": 0, "launches": 0, "gpu_seconds": 0.0},
        "copies": [{"device": 0, "uuid": UUID, "kind": "htod", "count": 2, "bytes": 4096, "gpu_seconds": 1e-5}],
        "memory": [{"device": 0, "uuid": UUID, "allocated": 1 << 30, "reserved": 2 << 30, "ts": 2.0}],
    }
    base.update(over)
    return base


def parsed(**over) -> wire.CuptiReport:
    return wire.CuptiReport.parse(report(**over))


def _ident(pid: int, start_time: int, comm: str) -> ProcessIdentity:
    """A process as identity.identify names one (uids and root do not matter to the reports)."""
    return ProcessIdentity(pid, start_time, (0, 0, 0), sanitise_process_name(comm), "/")


IDS = {pid: _ident(pid, 1000 + pid, "python3") for pid in (7, 8, 4242, *range(100, 400))}
ON_GPU = {UUID: None}  # NVML knows the GPU but cannot list its processes: memory is self-reported


def store(view=ON_GPU, ids=IDS, **kw) -> R.InProcessReports:
    clock = kw.pop("wallclock", None)
    if clock is None:  # each report a second after the last: none is dropped as too frequent
        t = [1000.0]
        def clock():
            t[0] += 1.0
            return t[0]
    return R.InProcessReports(gpus=lambda: view, identify=ids.get, wallclock=clock, **kw)


def test_the_agents_own_report_parses():
    """What InProcessAgent.build_report produces is what the daemon accepts."""
    agent = InProcessAgent(Settings())
    agent.state, agent.reason = "unavailable", "no NVIDIA driver"
    me = identify(os.getpid())
    r, dropped = R.Report.build(wire.CuptiReport.parse(agent.build_report()), me, os.getuid(), 0.0, {})
    assert (r.pid, r.cupti.state, r.cupti.reason, r.kernels, dropped) == (
        os.getpid(), "unavailable", "no NVIDIA driver", (), {})
    assert r.start_time == int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])


def test_pid_name_and_time_come_from_the_server_not_the_report():
    s = store(wallclock=lambda: 5000.0)
    s.accept(parsed(pid=1, process="nvidia-smi", ts=4e9, started=4e9), pid=4242, uid=0)
    r = s.get(4242)
    assert s.get(1) is None and (r.pid, r.process, r.received, r.start_time) == (4242, "python3", 5000.0, 5242)


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(version=2), "version: must be an integer from 1 to 1, got 2"),
    (lambda r: r["cupti"].update(state="dancing"), "cupti.state: must be one of"),
    (lambda r: r["kernels"][0].update(launches=-1), "kernels[0].launches: must be an integer"),
    (lambda r: r["kernels"][0].update(launches=10**308), "kernels[0].launches: must be an integer"),
    (lambda r: r["kernels"][0].update(gpu_seconds=float("nan")), "kernels[0].gpu_seconds"),
    (lambda r: r["kernels"][1].update(occupancy=1.5), "kernels[1].occupancy: must be a number from 0 to 1"),
    (lambda r: r["kernels"][0].update(block=[1, 2]), "kernels[0].block: must be a list of 3 entries"),
    (lambda r: r.update(kernels=[{}] * 201), "kernels: must have at most 200 entries"),
    (lambda r: r.update(memory="lots"), "memory: must be a list"),
    (lambda r: r["memory"][0].update(allocated="1G"), "memory[0].allocated: must be an integer"),
    (lambda r: r["memory"][0].update(ts=4e10), "memory[0].ts: must be a number"),
    (lambda r: r.update(cupti=None), "cupti: must be a JSON object"),
    (lambda r: r["memory"][0].update(frameworks=["mxnet"]), "memory[0].frameworks[0]: must be one of torch, "
                                                                "cupy, jax"),
    (lambda r: r["memory"][0].update(frameworks=["torch"] * 4), "memory[0].frameworks: must have at most 3"),
    (lambda r: r.update(oom={"count": 1, "framework": "torch", "how": "uncaught", "message": "rm -rf"}),
     "oom.message: is not a field of this message"),  # no free text: the daemon words the event
    (lambda r: r.update(oom={"count": 0, "framework": "torch", "how": "uncaught"}), "oom.count: must be an integer "
                                                                                      "from 1 to 4294967296"),
    (lambda r: r.update(oom={"count": 1, "framework": "mxnet", "how": "uncaught"}), "oom.framework: must be one of"),
    (lambda r: r.update(oom={"count": 1, "framework": "jax", "how": "caught"}), "oom.how: must be one of allocator, "
                                                                               "uncaught"),
    (lambda r: r.update(oom={"count": 1, "framework": "cupy", "how": "uncaught", "requested_bytes": 2**51}),
     "oom.requested_bytes: must be an integer from 0 to 1125899906842624"),
    (lambda r: r.update(oom={"count": 1, "framework": "torch", "how": "allocator", "device": 1024}),
     "oom.device: must be an integer from 0 to 1023"),
    (lambda r: r.update(oom={"framework": "torch", "how": "allocator"}), "oom.count: is required"),
])
def test_bad_reports_are_refused_by_the_wire_type_with_the_reason(mutate, message):
    bad = copy.deepcopy(report())
    mutate(bad)
    with pytest.raises(wire.WireError, match=message.replace("[", r"\[").replace("(", r"\(")):
        wire.CuptiReport.parse(bad)


def test_watching_a_process_asks_it_for_continuous_kernels():
    now = [100.0]
    s = store(clock=lambda: now[0])
    assert s.accept(parsed(), pid=7, uid=0) == {"detail_seconds": 0}
    s.watch(s.get(7), seconds=10)
    now[0] += 4
    assert s.accept(parsed(), pid=7, uid=0) == {"detail_seconds": 6.0}
    now[0] += 7
    assert s.accept(parsed(), pid=7, uid=0) == {"detail_seconds": 0}


def test_reports_of_exited_processes_are_dropped():
    ids = dict(IDS)
    t = [1000.0]
    s = store(ids=ids, wallclock=lambda: t[0])
    s.accept(parsed(), pid=7, uid=0)
    s.accept(parsed(), pid=8, uid=0)
    del ids[8]
    t[0] += R.STALE - 1
    assert {r.pid for r in s.current()} == {7, 8}  # kept a while for trace summaries
    t[0] += 2
    assert {r.pid for r in s.current()} == {7}
    t[0] += R.KEEP_AFTER_EXIT
    assert s.current() == []  # alive but silent


def test_a_reused_pid_is_a_new_process():
    ids = dict(IDS)
    s = store(ids=ids)
    s.accept(parsed(), pid=7, uid=1001)
    assert s.get(7).uid == 1001
    del ids[7]
    assert s.get(7).uid == 1001  # gone: its last report stays readable a while
    ids[7] = _ident(7, 99999, "bash")  # pid 7 reused by another user's process
    assert s.get(7) is None  # never the former owner's report, nor refused for it
    s.accept(parsed(), pid=7, uid=1002)
    assert (s.get(7).uid, s.get(7).process, s.get(7).start_time) == (1002, "bash", 99999)


def test_reports_more_often_than_the_minimum_interval_are_dropped():
    t = [1000.0]
    s = store(wallclock=lambda: t[0])
    s.accept(parsed(), pid=7, uid=0)
    t[0] += R.MIN_REPORT_INTERVAL / 2
    assert s.accept(parsed(kernels=[]), pid=7, uid=0) == {"detail_seconds": 0}  # same reply: the client goes on
    assert len(s.get(7).kernels) == 2 and s.refused == {"too_often": 1}
    t[0] += R.MIN_REPORT_INTERVAL
    s.accept(parsed(kernels=[]), pid=7, uid=0)
    assert s.get(7).kernels == ()


def test_reporting_processes_are_capped_per_user_and_in_all(caplog):
    t = [1000.0]
    def clock():  # all within a minute: none is silent long enough to be forgotten
        t[0] += 0.21
        return t[0]
    s = store(wallclock=clock)
    for pid in range(100, 100 + R.MAX_REPORTERS_PER_USER):
        s.accept(parsed(), pid=pid, uid=1000)
    with pytest.raises(R.ReportError, match="16 processes of user 1000 already"):
        s.accept(parsed(), pid=300, uid=1000)
    s.accept(parsed(), pid=100, uid=1000)  # one already kept reports on
    with pytest.raises(R.ReportError):
        s.accept(parsed(), pid=301, uid=1000)
    assert s.refused == {"user_limit": 2}
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # once per cause
    for i, pid in enumerate(range(116, 116 + R.MAX_REPORTERS - R.MAX_REPORTERS_PER_USER)):
        s.accept(parsed(), pid=pid, uid=2000 + i // R.MAX_REPORTERS_PER_USER)
    s._identify = {**IDS, 999: _ident(999, 1, "python3")}.get
    with pytest.raises(R.ReportError, match="256 processes already"):
        s.accept(parsed(), pid=999, uid=5)
    assert s.refused["total_limit"] == 1 and len(s.current()) == R.MAX_REPORTERS


def test_a_process_that_is_gone_before_its_report_is_read_is_refused():
    with pytest.raises(R.ReportError, match="process 5 is gone"):
        store().accept(parsed(), pid=5, uid=0)


def test_memory_counts_only_for_gpus_nvml_knows_and_is_verified_only_where_nvml_lists_the_process():
    other = "GPU-00000000-0000-0000-0000-000000000001"
    listing = "GPU-00000000-0000-0000-0000-000000000002"
    view = {UUID: None, other: frozenset({7}), listing: frozenset({8})}
    mem = [dict(report()["memory"][0], uuid=u, allocated=n) for n, u in enumerate(
        [UUID, other, listing, "GPU-fake", "GPU-fake2", UUID], start=1)]
    mem[-1]["ts"] = 1.0  # an older entry for UUID than the first: the client's ts orders its own entries
    s = store(view=view)
    s.accept(parsed(memory=mem), pid=7, uid=0)
    got = {m.uuid: (m.allocated, m.verified) for m in s.get(7).memory}
    assert got == {UUID: (1, False), other: (2, True)}
    assert s.memory_refused == {"unknown_gpu": 2, "not_on_gpu": 1}


def test_nvml_view_says_where_it_can_vouch_for_a_process():
    from gpuwatch.agent.api import Sample

    def gpu(uuid, processes=None, pids=(), folded=False):
        out = [Sample("gpuwatch.gpu.up", 1.0, uuid, {}, 0.0)]
        if processes is not None:
            out.append(Sample("gpuwatch.gpu.processes", float(processes), uuid, {"type": "compute"}, 0.0))
        out += [Sample("gpuwatch.process.gpu.memory.usage", 1.0, uuid, {"pid": str(p), "process": "x"}, 0.0)
                for p in pids]
        if folded:
            out.append(Sample("gpuwatch.process.gpu.memory.usage", 1.0, uuid, {"pid": "other", "process": "other"}, 0.0))
        return out

    here = {1, 2, 3}.__contains__
    samples = (gpu("GPU-a", 2, (1, 2)) + gpu("GPU-unsupported") + gpu("GPU-folded", 20, (1, 2), folded=True)
               + gpu("GPU-uncharged", 2, (1,)) + gpu("GPU-elsewhere", 1, (425,)) + gpu("GPU-idle", 0)
               + [Sample("gpuwatch.process.gpu.memory.allocated", 1.0, "GPU-cupti", {"pid": "7"}, 0.0)])
    assert R.nvml_view(samples, exists=here) == {
        "GPU-a": frozenset({1, 2}), "GPU-unsupported": None, "GPU-folded": None, "GPU-uncharged": None,
        "GPU-elsewhere": None, "GPU-idle": frozenset()}


def series(samples, name):
    return {tuple(sorted(s.labels.items())) + ((("gpu", s.resource),) if s.resource else ()): s.value
            for s in samples if s.metric == name}


def probe_samples(s):
    return R.InProcessProbe(s, demangle=lambda names: {n: n for n in names}).collect()


def test_probe_exports_colors_kernels_and_agent_health():
    s = store(view={UUID: frozenset({7})}, wallclock=lambda: 5000.0)
    s.accept(parsed(), pid=7, uid=0)
    samples = probe_samples(s)
    for x in samples:
        metrics.get(x.metric)  # every sample is a registered metric
        # the time of receipt, not the client's (the probe's own counters: the time of collection)
        assert x.ts == 5000.0 or x.metric.endswith((".refused", ".events.dropped"))
    proc = (("pid", "7"), ("process", "python3"))
    assert series(samples, "gpuwatch.process.gpu.memory.allocated") == {proc + (("gpu", UUID),): float(1 << 30)}
    assert series(samples, "gpuwatch.process.gpu.memory.reserved") == {proc + (("gpu", UUID),): float(2 << 30)}
    assert series(samples, "gpuwatch.process.gpu.memory.allocated.self_reported") == {}
    k = series(samples, "gpuwatch.process.kernel.launches")
    assert k == {(("kernel", "_Z6gemm_kv"),) + proc: 20.0, (("kernel", "add_kernel"),) + proc: 1000.0}
    mean = series(samples, "gpuwatch.process.kernel.mean_duration")
    assert mean[(("kernel", "_Z6gemm_kv"),) + proc] == pytest.approx(0.0002)
    occ = series(samples, "gpuwatch.process.kernel.theoretical_occupancy")
    assert occ[(("kernel", "_Z6gemm_kv"),) + proc] == 0.1875
    states = series(samples, "gpuwatch.cupti.state")
    assert states[proc + (("state", "on"),)] == 1.0 and sum(states.values()) == 1.0
    assert series(samples, "gpuwatch.cupti.observed") == {proc: 1.5}
    assert series(samples, "gpuwatch.cupti.reports.refused")[(("reason", "too_often"),)] == 0.0


def test_self_reported_memory_has_metrics_of_its_own_that_the_leak_detector_does_not_read():
    from gpuwatch.detectors.leak import COLOR_METRICS

    s = store()  # NVML cannot list the GPU's processes
    s.accept(parsed(), pid=7, uid=0)
    samples = probe_samples(s)
    proc = (("pid", "7"), ("process", "python3"))
    assert series(samples, "gpuwatch.process.gpu.memory.allocated") == {}
    assert series(samples, "gpuwatch.process.gpu.memory.allocated.self_reported") == {
        proc + (("gpu", UUID),): float(1 << 30)}
    assert not {x.metric for x in samples} & set(COLOR_METRICS)


def test_grid_blocks_are_the_product_of_all_three_dimensions_and_the_smallest_of_a_names_variants():
    base = report()["kernels"][1]
    kernels = [dict(base, name="z_only", grid=[1, 1, 4]), dict(base, name="y_only", grid=[1, 3, 1]),
               dict(base, name="one", grid=[1, 1, 1]), dict(base, name="cube", grid=[2, 3, 5]),
               # two variants of one name: the smallest grid is kept; an empty (0-block) grid is no grid
               dict(base, name="varied", grid=[8, 2, 1]), dict(base, name="varied", grid=[3, 1, 1]),
               dict(base, name="varied", grid=[0, 1, 1]), dict(base, name="empty", grid=[0, 7, 7])]
    s = store()
    s.accept(parsed(kernels=kernels), pid=7, uid=0)
    blocks = {dict(k)["kernel"]: v for k, v in series(probe_samples(s), "gpuwatch.process.kernel.grid_blocks").items()}
    assert blocks == {"z_only": 4.0, "y_only": 3.0, "one": 1.0, "cube": 30.0, "varied": 3.0}


def test_busy_processes_and_kernels_are_capped_and_the_rest_folded():
    s = store()
    many = [dict(report()["kernels"][1], name=f"k{i}", gpu_seconds=float(i + 1), launches=i + 1) for i in range(15)]
    s.accept(parsed(kernels=many), pid=7, uid=0)
    for pid in range(100, 100 + R.MAX_PROCESSES):
        s.accept(parsed(), pid=pid, uid=pid)
    samples = probe_samples(s)
    launches = series(samples, "gpuwatch.process.kernel.launches")
    mine = {dict(k)["kernel"]: v for k, v in launches.items() if dict(k)["pid"] == "7"}
    assert len(mine) == R.KERNELS_PER_PROCESS + 1
    assert mine["other"] == sum(range(1, 6))  # the five least busy of 15
    other = (("pid", "other"), ("process", "other"))
    assert launches[(("kernel", "other"),) + other] == 1020.0  # one process folded
    # Its state, health and self-reported bytes folded too: per-process series stay bounded.
    assert {dict(k)["pid"] for k in series(samples, "gpuwatch.cupti.state")} == {
        "7", "other", *map(str, range(100, 100 + R.MAX_PROCESSES - 1))}
    assert series(samples, "gpuwatch.cupti.state")[other + (("state", "on"),)] == 1.0
    assert series(samples, "gpuwatch.process.gpu.memory.allocated.self_reported")[other + (("gpu", UUID),)] == 1 << 30


def test_verified_processes_are_never_folded_away_by_busier_claims():
    s = store(view={UUID: frozenset({7, 8})})
    busy = [dict(report()["kernels"][1], gpu_seconds=1e6)]
    for pid in range(100, 100 + R.MAX_PROCESSES + 5):
        s.accept(parsed(kernels=busy), pid=pid, uid=pid)  # not on the GPU: memory dropped
    s.accept(parsed(), pid=7, uid=0)
    s.accept(parsed(), pid=8, uid=0)
    samples = probe_samples(s)
    assert {dict(k)["pid"] for k in series(samples, "gpuwatch.process.gpu.memory.allocated")} == {"7", "8"}
    assert {"7", "8"} <= {dict(k)["pid"] for k in series(samples, "gpuwatch.process.kernel.launches")}


@pytest.mark.parametrize("comm, label", [("python3", "python3"), ("\x1b[31mevil\n", "__31mevil_"),
                                         ("my job (1)", "my_job__1_"), ("", "unknown"), ("pt_main_thread", "pt_main_thread")])
def test_the_process_is_named_by_its_comm_as_the_other_probes_name_it(comm, label):
    from gpuwatch.probes.nvml.probe import sanitise_process_name

    s = store(ids={7: _ident(7, 1, comm)})
    s.accept(parsed(process="nvidia-smi"), pid=7, uid=0)
    assert s.get(7).process == label == sanitise_process_name(comm)


def test_kernel_names_from_a_client_are_made_printable():
    bad = report()
    bad["kernels"][0]["name"] = "void k<\"x\">(float*)\n\x1b[2J\udcff"
    s = store()
    s.accept(wire.CuptiReport.parse(bad), pid=7, uid=0)
    assert s.get(7).kernels[0].name == 'void k<"x">(float*)??[2J?'


# -- out-of-memory errors the agents report ------------------------------------------------------

OOM = {"count": 1, "framework": "torch", "how": "allocator", "device": 0, "requested_bytes": 2 << 30, "ts": 1.0}


def test_a_reported_oom_becomes_one_event_in_the_daemon_s_words():
    now = [100.0]
    s = store(view={UUID: frozenset({7})}, clock=lambda: now[0], wallclock=lambda: 5000.0 + now[0])
    s.accept(parsed(oom=OOM, pid=1, process="init"), pid=7, uid=0)
    (ev,) = s.events()
    assert (ev.kind, ev.resource, ev.ts) == ("framework.oom", UUID, 5100.0)  # the device's verified GPU, our time
    assert dict(ev.attrs) == {"pid": "7", "process": "python3", "framework": "torch", "how": "allocator",
                              "device": 0, "requested_bytes": 2 << 30}
    assert s.events() == []  # drained
    now[0] += 1
    s.accept(parsed(oom=OOM), pid=7, uid=0)  # the same count again: the same OOM
    assert s.events() == []
    now[0] += R.OOM_EVENT_INTERVAL
    s.accept(parsed(oom=dict(OOM, count=2, how="uncaught", device=None, requested_bytes=None)), pid=7, uid=0)
    (ev,) = s.events()
    assert ev.resource == "" and ev.attrs["how"] == "uncaught" and ev.attrs["device"] is None  # no device: no GPU


def test_oom_events_are_rate_limited_per_process_and_bounded(monkeypatch):
    now = [100.0]
    s = store(clock=lambda: now[0])
    for n in range(1, 50):  # a client raising its count each report: one event a minute
        now[0] += 1
        s.accept(parsed(oom=dict(OOM, count=n)), pid=7, uid=0)
    assert len(s.events()) == 1
    now[0] += R.OOM_EVENT_INTERVAL
    s.accept(parsed(oom=dict(OOM, count=50)), pid=7, uid=0)
    assert len(s.events()) == 1
    monkeypatch.setattr(s.oom_events, "bound", 2)
    for pid in (100, 101, 102):
        s.accept(parsed(oom=OOM), pid=pid, uid=0)
    assert s.oom_events.dropped == 1 and len(s.events()) == 2
    gauge = {x.labels["probe"]: x.value for x in probe_samples(s) if x.metric == "gpuwatch.probe.events.dropped"}
    assert gauge == {"cupti": 1.0}


def test_an_oom_in_a_report_dropped_as_too_frequent_still_counts():
    """The report a dying program sends at exit may come right after its last one."""
    t = [1000.0]
    s = store(view={UUID: frozenset({7})}, wallclock=lambda: t[0])
    s.accept(parsed(), pid=7, uid=0)
    t[0] += R.MIN_REPORT_INTERVAL / 2
    s.accept(parsed(oom=OOM, memory=[]), pid=7, uid=0)
    assert s.refused == {"too_often": 1}
    (ev,) = s.events()
    assert ev.resource == UUID  # the device's GPU from the report kept before


def test_an_oom_names_a_gpu_only_where_nvml_lists_the_process():
    for view, gpu in (({UUID: None}, ""), ({UUID: frozenset({7})}, UUID)):
        s = store(view=view)
        s.accept(parsed(oom=OOM), pid=7, uid=0)
        assert [e.resource for e in s.events()] == [gpu]
    s = store(view={UUID: frozenset({7})})
    s.accept(parsed(oom=dict(OOM, device=3)), pid=7, uid=0)  # a device it reported no memory on
    assert [e.resource for e in s.events()] == [""]


def test_oom_state_goes_with_the_report_of_an_exited_process():
    ids = dict(IDS)
    t = [1000.0]
    s = store(ids=ids, wallclock=lambda: t[0])
    s.accept(parsed(oom=OOM), pid=8, uid=0)
    del ids[8]
    t[0] += R.STALE + 1
    assert s.current() == [] and s._ooms == {}
    assert [e.attrs["pid"] for e in s.events()] == ["8"]


def test_memory_entries_say_whose_allocators_they_sum():
    s = store(view={UUID: frozenset({7})})
    s.accept(parsed(memory=[{"device": 0, "uuid": UUID, "allocated": 5, "reserved": 9, "ts": 2.0,
                             "frameworks": ["cupy", "torch"]}]), pid=7, uid=0)
    (m,) = s.get(7).as_dict()["memory"]
    assert m == {"device": 0, "uuid": UUID, "allocated": 5, "reserved": 9, "self_reported": False,
                 "frameworks": ["cupy", "torch"]}


# --- a process on two GPUs, renumbered by CUDA_VISIBLE_DEVICES ------------------------------------

GPU_A = "GPU-0af39ec1-025b-b990-3dc9-475f5d35d110"  # NVML's GPU 0 (the lower PCI bus)
GPU_B = "GPU-8a3f1c2d-4e5f-6071-8293-a4b5c6d7e8f9"  # NVML's GPU 1


@pytest.fixture
def renumbered():
    """A real process started with CUDA_VISIBLE_DEVICES=1,0 (its ordinal 0 is NVML's GPU 1), and the
    daemon's resolution of its ordinals from /proc/PID/environ against two NVML GPUs."""
    import subprocess
    import sys

    from gpuwatch.probes.process.cuda_devices import NvmlGpu, read_cuda_environment, visible_uuids

    gpus = [NvmlGpu(GPU_B, "NVIDIA H200", "00000000:2A:00.0"), NvmlGpu(GPU_A, "NVIDIA H200", "00000000:18:00.0")]
    procs = []

    def start(environment):
        p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             env=environment, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        procs.append(p)
        return identify(p.pid)

    calls = []

    def devices(pid):
        calls.append(pid)
        return visible_uuids(read_cuda_environment(pid), gpus)

    yield start, devices, calls
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()


def two_gpu_store(who, devices, view):
    return store(view=view, ids={who.pid: who}, devices=devices)


def test_entries_without_a_uuid_are_named_from_the_processs_cuda_visible_devices(renumbered):
    start, devices, calls = renumbered
    who = start({"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    s = two_gpu_store(who, devices, {GPU_A: frozenset({who.pid}), GPU_B: frozenset({who.pid})})
    memory = [{"device": 0, "uuid": "", "allocated": 1 << 30, "reserved": 2 << 30, "ts": 2.0},
              {"device": 1, "uuid": "", "allocated": 3 << 30, "reserved": 4 << 30, "ts": 2.0}]
    for _ in range(3):
        s.accept(parsed(memory=memory), pid=who.pid, uid=0)
    got = {m.uuid: (m.device, m.allocated, m.verified) for m in s.get(who.pid).memory}
    assert got == {GPU_B: (0, 1 << 30, True), GPU_A: (1, 3 << 30, True)}  # ordinal 0 is NVML's GPU 1
    assert calls == [who.pid]  # its environment read once, not at every report


def test_a_uuid_the_process_gave_is_not_replaced_by_its_environment(renumbered):
    start, devices, calls = renumbered
    who = start({"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    s = two_gpu_store(who, devices, {GPU_A: frozenset({who.pid}), GPU_B: frozenset({who.pid})})
    # The program set CUDA_VISIBLE_DEVICES=0 itself before CUDA started: /proc still shows "1,0".
    s.accept(parsed(memory=[{"device": 0, "uuid": GPU_A, "allocated": 1 << 30, "reserved": 1 << 30}]),
             pid=who.pid, uid=0)
    assert [(m.uuid, m.device) for m in s.get(who.pid).memory] == [(GPU_A, 0)] and calls == []


def test_without_pci_bus_order_an_index_names_no_gpu_and_the_entry_is_dropped(renumbered):
    start, devices, _ = renumbered
    who = start({"CUDA_VISIBLE_DEVICES": "1,0"})  # CUDA's default order: fastest first
    s = two_gpu_store(who, devices, {GPU_A: frozenset({who.pid}), GPU_B: frozenset({who.pid})})
    s.accept(parsed(memory=[{"device": 0, "uuid": "", "allocated": 1 << 30, "reserved": 1 << 30}]),
             pid=who.pid, uid=0)
    assert s.get(who.pid).memory == () and s.memory_refused == {"unknown_gpu": 1}
    uuids = start({"CUDA_VISIBLE_DEVICES": "GPU-8a3f,GPU-0af3"})  # UUIDs need no order
    s = two_gpu_store(uuids, devices, {GPU_A: frozenset({uuids.pid}), GPU_B: frozenset({uuids.pid})})
    s.accept(parsed(memory=[{"device": 1, "uuid": "", "allocated": 1 << 30, "reserved": 1 << 30}]),
             pid=uuids.pid, uid=0)
    assert [m.uuid for m in s.get(uuids.pid).memory] == [GPU_A]


def test_an_oom_on_a_device_without_memory_entries_is_named_from_the_environment(renumbered):
    start, devices, _ = renumbered
    who = start({"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    now = [100.0]
    s = store(view={GPU_A: frozenset({who.pid}), GPU_B: frozenset()}, ids={who.pid: who}, devices=devices,
              clock=lambda: now[0])
    s.accept(parsed(oom=dict(OOM, device=1), memory=[]), pid=who.pid, uid=0)
    assert [e.resource for e in s.events()] == [GPU_A]  # its device 1 is NVML's GPU 0, which lists it
    now[0] += R.OOM_EVENT_INTERVAL
    s.accept(parsed(oom=dict(OOM, count=2, device=0), memory=[]), pid=who.pid, uid=0)
    assert [e.resource for e in s.events()] == [""]  # NVML's GPU 1, which does not list it: no GPU
