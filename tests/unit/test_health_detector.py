"""GPU health judging (detectors/health.py) on runs recorded on the H200
(tests/fixtures/baseline-h200.json: 130 undisturbed runs, then runs beside a competing process)."""
import copy
import json
import os

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors import health
from gpuwatch.probes.baseline.probe import samples_of

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "baseline-h200.json")


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        return json.load(f)


def judged(runs):
    past = []
    for r in runs:
        r = dict(r, verdict=health.judge(r, past))
        past.append(r)
    return past


def test_130_undisturbed_h200_runs_raise_nothing(recorded):
    runs = judged(recorded["runs"])
    assert len(runs) == 130
    assert [i for i, r in enumerate(runs) if r["verdict"]["slower"] or r["verdict"]["wrong"]
            or r["verdict"]["below_sku"]] == []
    v = runs[-1]["verdict"]["metrics"]["gemm_flop_per_cycle"]
    assert v["own_ratio"] == pytest.approx(1.0, abs=0.03) and 0.9 <= v["threshold"] <= 0.97
    assert v["sku_ratio"] == pytest.approx(1.0, abs=0.05)  # the SKU expectation is this GPU's median
    # The first runs build the baseline: no own-history judgement before min_history runs.
    assert runs[3]["verdict"]["metrics"]["gemm_flop_per_cycle"]["own_ratio"] is None


def test_a_competing_process_is_flagged_on_its_first_run(recorded):
    history = recorded["runs"]
    by_share = {(p["spin_us"], p["period_us"]): p["runs"] for p in recorded["planted"]}
    for share in ((10.0, 4000.0), (25.0, 2000.0)):  # 3.9 % and 8.1 % slower raw, 10-18 % per SM cycle
        first = by_share[share][0]
        assert first["raw_ratio"] < 0.97
        assert health.judge(first["run"], history)["slower"], share


def test_a_wrong_answer_or_a_changed_digest_is_silent_data_corruption(recorded):
    history = recorded["runs"]
    same_seed = next(r for r in reversed(history) if r["seed"] == 0)
    bad = copy.deepcopy(same_seed)
    bad["check"]["ok"], bad["check"]["mismatches"] = False, 3
    assert health.judge(bad, history)["wrong"]
    flipped = copy.deepcopy(same_seed)
    flipped["check"]["digest"] += 1  # a low bit inside the tolerance: only the digest sees it
    v = health.judge(flipped, history)
    assert v["wrong"] and v["digest_changed"]
    other_seed = copy.deepcopy(next(r for r in reversed(history) if r["seed"] == 1))
    assert not health.judge(other_seed, [r for r in history if r["seed"] != 1])["wrong"]  # other inputs


def test_new_software_starts_a_new_baseline_and_slow_runs_do_not_join_it(recorded):
    history = recorded["runs"]
    upgraded = copy.deepcopy(history[-1])
    upgraded["versions"]["driver"] = "590.1"
    upgraded["gemm_flop_per_cycle"] *= 0.8
    v = health.judge(upgraded, history)
    assert not v["slower"] and v["baseline_runs"] == 0  # nothing comparable yet...
    assert v["below_sku"]  # ...but the SKU's expectation still holds it to account
    slow = [dict(copy.deepcopy(r), gemm_flop_per_cycle=r["gemm_flop_per_cycle"] * 0.8,
                 verdict={"slower": True}) for r in history[-20:]]
    v = health.judge(history[-1], history + slow)
    assert v["baseline_runs"] == 20 and not v["slower"]  # judged against the normal runs before them


def test_another_kernel_config_or_shape_is_not_held_to_the_skus_number(recorded):
    run = copy.deepcopy(recorded["runs"][-1])
    run["config"]["num_stages"] = 3
    assert health.judge(run, [])["metrics"]["gemm_flop_per_cycle"]["sku_ratio"] is None
    run = copy.deepcopy(recorded["runs"][-1])
    run["shape"] = [8192, 14336, 4096]
    assert health.judge(run, [])["metrics"]["gemm_flop_per_cycle"]["sku_ratio"] is None


def history_of(run: dict) -> History:
    h = History()
    h.append(samples_of(run, 1_800_000_000.0))
    return h


def test_the_detector_turns_the_latest_verdict_into_findings(recorded):
    history = recorded["runs"]
    ok = dict(history[-1], ts=1.0, verdict=health.judge(history[-1], history[:-1]))
    assert list(health.HealthDetector().observe(history_of(ok))) == []

    planted = next(p for p in recorded["planted"] if (p["spin_us"], p["period_us"]) == (10.0, 4000.0))["runs"][0]["run"]
    slow = dict(planted, ts=1.0, verdict=health.judge(planted, history))
    found = {(f.kind, f.attrs["workload"]): f for f in health.HealthDetector().observe(history_of(slow))}
    f = found[(health.KIND_SLOWER, "gemm")]  # the copy kernel may be slowed too: a finding of its own
    assert {k for k, _ in found} == {health.KIND_SLOWER}
    assert f.resource == planted["uuid"] and "slower than its own baseline" in f.summary
    assert f.attrs["ratio"] < f.attrs["threshold"]

    bad = copy.deepcopy(history[-1])
    bad["check"].update(ok=False, mismatches=7)
    wrong = dict(bad, ts=1.0, verdict=health.judge(bad, history[:-1]))
    kinds = {f.kind for f in health.HealthDetector().observe(history_of(wrong))}
    assert kinds == {health.KIND_WRONG}

    low = copy.deepcopy(history[-1])
    low["gemm_flop_per_cycle"] *= 0.7
    below = dict(low, ts=1.0, verdict=health.judge(low, []))  # no history: only the SKU judges
    (f,) = health.HealthDetector().observe(history_of(below))
    assert f.kind == health.KIND_BELOW_SKU and f.attrs["ratio"] == pytest.approx(0.7, abs=0.03)


def test_the_detector_needs_nothing_when_no_run_was_made():
    h = History()
    h.append([Sample("hw.power", 100.0, "GPU-x", {}, 1.0)])
    assert list(health.HealthDetector().observe(h)) == []
