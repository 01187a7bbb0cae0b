"""The daemon's side of the in-process agents: report checking, keeping, watching, samples."""
import copy
import os

import pytest

from gpuwatch.agent import metrics
from gpuwatch.probes.cupti import reports as R
from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings

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


def test_the_agents_own_report_parses():
    """What InProcessAgent.build_report produces is what the daemon accepts."""
    agent = InProcessAgent(Settings())
    agent.state, agent.reason = "unavailable", "no NVIDIA driver"
    r = R.Report.parse(agent.build_report(), pid=os.getpid(), received=0.0)
    assert (r.pid, r.state, r.reason, r.kernels) == (os.getpid(), "unavailable", "no NVIDIA driver", ())


def test_pid_comes_from_the_caller_not_the_report():
    store = R.InProcessReports()
    store.accept(report(pid=1), pid=4242)
    assert store.get(1) is None and store.get(4242).pid == 4242


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(version=2), "report version 2 is not supported"),
    (lambda r: r["cupti"].update(state="dancing"), "cupti.state 'dancing' is not one of"),
    (lambda r: r["kernels"][0].update(launches=-1), "kernels[0].launches must be a non-negative number"),
    (lambda r: r["kernels"][0].update(gpu_seconds=float("nan")), "kernels[0].gpu_seconds"),
    (lambda r: r["kernels"][1].update(occupancy=1.5), "kernels[1].occupancy must be a ratio"),
    (lambda r: r["kernels"][0].update(block=[1, 2]), "kernels[0].block must be three non-negative integers"),
    (lambda r: r.update(kernels=[{}] * 201), "kernels has 201 entries, at most 200"),
    (lambda r: r.update(memory="lots"), "memory must be a list"),
    (lambda r: r["memory"][0].update(allocated="1G"), "memory.allocated must be a non-negative number"),
    (lambda r: r.update(cupti=None), "report.cupti must be an object"),
])
def test_bad_reports_are_refused_with_the_reason_and_change_nothing(mutate, message):
    store = R.InProcessReports()
    store.accept(report(), pid=7)
    bad = copy.deepcopy(report())
    mutate(bad)
    with pytest.raises(R.ReportError, match=message.replace("[", r"\[").replace("(", r"\(")):
        store.accept(bad, pid=7)
    assert store.get(7).kernels[1].launches == 1000 and store.refused == 1


def test_watching_a_process_asks_it_for_continuous_kernels():
    now = [100.0]
    store = R.InProcessReports(clock=lambda: now[0])
    assert store.accept(report(), pid=7) == {"detail_seconds": 0}
    store.watch(7, seconds=10)
    now[0] += 4
    assert store.accept(report(), pid=7) == {"detail_seconds": 6.0}
    now[0] += 7
    assert store.accept(report(), pid=7) == {"detail_seconds": 0}


def test_reports_of_exited_processes_are_dropped():
    alive = {7: True, 8: True}
    store = R.InProcessReports(alive=lambda pid: alive[pid])
    store.accept(report(), pid=7)
    store.accept(report(), pid=8)
    alive[8] = False
    assert {r.pid for r in store.current()} == {7, 8}  # kept a while for trace summaries
    store._reports[8] = store._reports[8].__class__(**{**store._reports[8].__dict__, "received": 0.0})
    assert {r.pid for r in store.current()} == {7}


def series(samples, name):
    return {tuple(sorted(s.labels.items())) + ((("gpu", s.resource),) if s.resource else ()): s.value
            for s in samples if s.metric == name}


def test_probe_exports_colors_kernels_and_agent_health():
    store = R.InProcessReports()
    store.accept(report(), pid=7)
    samples = R.InProcessProbe(store, demangle=lambda names: {n: n for n in names}).collect()
    for s in samples:
        metrics.get(s.metric)  # every sample is a registered metric
    proc = (("pid", "7"), ("process", "python3"))
    assert series(samples, "gpuwatch.process.gpu.memory.allocated") == {proc + (("gpu", UUID),): float(1 << 30)}
    assert series(samples, "gpuwatch.process.gpu.memory.reserved") == {proc + (("gpu", UUID),): float(2 << 30)}
    k = series(samples, "gpuwatch.process.kernel.launches")
    assert k == {(("kernel", "_Z6gemm_kv"),) + proc: 20.0, (("kernel", "add_kernel"),) + proc: 1000.0}
    mean = series(samples, "gpuwatch.process.kernel.mean_duration")
    assert mean[(("kernel", "_Z6gemm_kv"),) + proc] == pytest.approx(0.0002)
    occ = series(samples, "gpuwatch.process.kernel.theoretical_occupancy")
    assert occ[(("kernel", "_Z6gemm_kv"),) + proc] == 0.1875
    states = series(samples, "gpuwatch.cupti.state")
    assert states[proc + (("state", "on"),)] == 1.0 and sum(states.values()) == 1.0
    assert series(samples, "gpuwatch.cupti.observed") == {proc: 1.5}


def test_grid_blocks_are_the_product_of_all_three_dimensions_and_the_smallest_of_a_names_variants():
    base = report()["kernels"][1]
    kernels = [dict(base, name="z_only", grid=[1, 1, 4]), dict(base, name="y_only", grid=[1, 3, 1]),
               dict(base, name="one", grid=[1, 1, 1]), dict(base, name="cube", grid=[2, 3, 5]),
               # two variants of one name: the smallest grid is kept; an empty (0-block) grid is no grid
               dict(base, name="varied", grid=[8, 2, 1]), dict(base, name="varied", grid=[3, 1, 1]),
               dict(base, name="varied", grid=[0, 1, 1]), dict(base, name="empty", grid=[0, 7, 7])]
    store = R.InProcessReports()
    store.accept(report(kernels=kernels), pid=7)
    samples = R.InProcessProbe(store, demangle=lambda names: {n: n for n in names}).collect()
    blocks = {dict(k)["kernel"]: v for k, v in series(samples, "gpuwatch.process.kernel.grid_blocks").items()}
    assert blocks == {"z_only": 4.0, "y_only": 3.0, "one": 1.0, "cube": 30.0, "varied": 3.0}


def test_busy_processes_and_kernels_are_capped_and_the_rest_folded():
    store = R.InProcessReports()
    many = [dict(report()["kernels"][1], name=f"k{i}", gpu_seconds=float(i + 1), launches=i + 1) for i in range(15)]
    store.accept(report(kernels=many), pid=7)
    for pid in range(100, 100 + R.MAX_PROCESSES):
        store.accept(report(), pid=pid)
    samples = R.InProcessProbe(store, demangle=lambda names: {n: n for n in names}).collect()
    launches = series(samples, "gpuwatch.process.kernel.launches")
    mine = {dict(k)["kernel"]: v for k, v in launches.items() if dict(k)["pid"] == "7"}
    assert len(mine) == R.KERNELS_PER_PROCESS + 1
    assert mine["other"] == sum(range(1, 6))  # the five least busy of 15
    assert launches[(("kernel", "other"), ("pid", "other"), ("process", "other"))] == 1020.0  # one process folded


@pytest.mark.parametrize("name, label", [("python3", "python3"), ("\x1b[31mevil\n", "__31mevil_"),
                                         ("my job (1)", "my_job__1_"), ("", "unknown"), ("pt_main_thread", "pt_main_thread")])
def test_the_process_name_a_client_sends_is_named_as_the_other_probes_name_it(name, label):
    from gpuwatch.probes.nvml.probe import sanitise_process_name

    r = R.Report.parse(report(process=name), pid=7, received=2.0)
    assert r.process == label and (not name or r.process == sanitise_process_name(name))


def test_kernel_names_from_a_client_are_made_printable():
    bad = report()
    bad["kernels"][0]["name"] = "void k<\"x\">(float*)\n\x1b[2J\udcff"
    r = R.Report.parse(bad, pid=7, received=2.0)
    assert r.kernels[0].name == 'void k<"x">(float*)??[2J?' or r.kernels[1].name == 'void k<"x">(float*)??[2J?'
