"""The in-process agent's record pipeline on records recorded on the H200.

tests/fixtures/cupti-h200.json holds CUPTI activity records of tests/gpu/cupti_workload.py
(GPUWATCH_RUN_RECORD) and the kernel variants with theoretical occupancy the agent reported at
the end of the run, computed there from the device's attributes; tests/fixtures/occupancy-h200.json
holds those attributes.
"""
import json
from collections import Counter

from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings
from gpuwatch.probes.cupti.occupancy import Device
from gpuwatch.probes.cupti.records import KERNEL_KINDS, KIND_MEMCPY, KIND_MEMSET, ActivityTables
from tests.conftest import ROOT

REC = json.loads((ROOT / "tests" / "fixtures" / "cupti-h200.json").read_text())
H200 = Device.from_attributes(json.loads((ROOT / "tests" / "fixtures" / "occupancy-h200.json").read_text())["device"])


def kernel_records():
    return [r for r in REC["records"] if r["kind"] in KERNEL_KINDS]


def test_kernels_fold_into_variants_with_exact_counts_and_times():
    t = ActivityTables()
    assert t.add_all(REC["records"]) == len(REC["records"])
    rows, other = t.kernel_rows()
    assert other == {"variants": 0, "launches": 0, "gpu_seconds": 0.0}
    by_name = Counter(r["name"] for r in kernel_records())
    assert {r["name"]: r["launches"] for r in rows} == dict(by_name)
    gemm = next(r for r in rows if r["name"].startswith("nvjet"))
    durations = [r["end"] - r["start"] for r in kernel_records() if r["name"] == gemm["name"]]
    assert gemm["gpu_seconds"] == sum(durations) / 1e9
    assert (gemm["min_seconds"], gemm["max_seconds"]) == (min(durations) / 1e9, max(durations) / 1e9)
    assert (gemm["block"], gemm["registers"], gemm["dynamic_shared_memory"]) == ([384, 1, 1], 168, 213188)
    assert rows == sorted(rows, key=lambda r: -r["gpu_seconds"])  # busiest first


def test_copies_and_sets_are_totalled_per_device_and_kind():
    t = ActivityTables()
    t.add_all(REC["records"])
    rows = {(c["device"], c["kind"]): c for c in t.copy_rows()}
    sets = [r for r in REC["records"] if r["kind"] == KIND_MEMSET]
    copies = [r for r in REC["records"] if r["kind"] == KIND_MEMCPY]
    assert rows[(0, "memset")]["count"] == len(sets) and rows[(0, "memset")]["bytes"] == sum(r["bytes"] for r in sets)
    assert sum(c["count"] for (d, k), c in rows.items() if k != "memset") == len(copies)


def test_variants_are_bounded_and_the_rest_folded():
    t = ActivityTables(max_variants=2)
    t.add_all(REC["records"])
    rows, other = t.kernel_rows()
    assert len(t.kernels) == 2
    assert sum(r["launches"] for r in rows) + other["launches"] == len(kernel_records())
    assert other["variants"] >= 1


def test_agent_report_gives_the_occupancy_the_agent_computed_on_the_h200():
    agent = InProcessAgent(Settings())
    agent.cupti = object()  # CUPTI "loaded": the report computes occupancy (no GPU here to ask)
    agent._devices[0] = H200
    agent._uuids[0] = REC["uuid"]
    agent.tables.add_all(REC["records"])
    report = agent.build_report()
    got = {k["name"]: (k["occupancy"], k["occupancy_limiter"], k["uuid"]) for k in report["kernels"]}
    for k in REC["agent_kernels"]:
        assert got[k["name"]] == (k["occupancy"], k["occupancy_limiter"], REC["uuid"]), k["name"]
    assert report["cupti"]["records"] == len(REC["records"])
