"""The leak detector on series recorded on the H200 (tests/fixtures/leak-h200-series.json, made by
tests/gpu/leak_record.py): what a real agent exported each second while a steady training loop ran
under `gpuwatch run` and, 20 s in, a tensor leak of 2 GiB/min ran until its real OOM. Judged every
10 s as the daemon does: the leak is white, seen within 90 s, its forecast within 20 % of the OOM
that came; the training loop never raises a finding."""
import json
import os

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.agent.history import History
from gpuwatch.detectors.leak import WHITE, LeakDetector

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "leak-h200-series.json")


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as f:
        return json.load(f)


def test_a_recorded_tensor_leak_is_white_early_with_a_close_forecast_and_training_is_quiet(recorded):
    pids = recorded["pids"]
    ev = {e["event"]: e["t"] for e in recorded["programs"]}
    by_ts: dict[float, list[Sample]] = {}
    for ts, metric, gpu, pid, process, value in recorded["points"]:
        labels = {"pid": pid, "process": process} if pid else {}
        by_ts.setdefault(ts, []).append(Sample(metric, value, gpu, labels, ts))
    h, detector = History(), LeakDetector()
    first, steady_findings, next_judgement = None, [], None
    for ts in sorted(by_ts):
        h.append(by_ts[ts])
        if next_judgement is None or ts >= next_judgement:
            next_judgement = ts + detector.interval
            for f in detector.observe(h):
                if f.attrs["pid"] == pids["steady"]:
                    steady_findings.append(f)
                elif f.attrs["pid"] == pids["white"] and first is None:
                    first = f
    assert steady_findings == []
    assert first is not None, "the recorded leak was never seen"
    assert first.attrs["color"] == WHITE
    assert first.ts - ev["leak_start"] <= 90, first.ts - ev["leak_start"]
    actual = ev["oom"] - first.ts
    assert first.attrs["time_to_oom_seconds"] == pytest.approx(actual, rel=0.2), (first.attrs, actual)
