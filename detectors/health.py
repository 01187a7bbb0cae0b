"""GPU health findings from the reference workload's verdicts (probes/baseline/verdict.py judges
each run): slower than its own past, below its SKU, wrong answers.
"""
from __future__ import annotations

from typing import Iterable

from gpuwatch.agent.api import Detector, Finding
from gpuwatch.agent.history import History
from gpuwatch.agent.metrics import BASELINE_RELATIVE_THROUGHPUT, BASELINE_THRESHOLD, BASELINE_WRONG_ANSWERS
from gpuwatch.agent.registry import DetectorEntry
from gpuwatch.probes.baseline.verdict import HealthSettings

KIND_SLOWER = "gpu_slower_than_baseline"
KIND_BELOW_SKU = "gpu_below_sku"
KIND_WRONG = "silent_data_corruption"


class HealthDetector(Detector):
    """Findings from the baseline probe's verdict samples (the latest run of each GPU)."""

    name = "health"
    kinds = (KIND_SLOWER, KIND_BELOW_SKU, KIND_WRONG)
    needs = ("baseline",)
    interval = 10.0
    settings = HealthSettings()

    def observe(self, history: History) -> Iterable[Finding]:
        latest = {}
        for metric in (BASELINE_RELATIVE_THROUGHPUT, BASELINE_WRONG_ANSWERS, BASELINE_THRESHOLD):
            for s in history.select(metric, since=float("inf")):
                if s:
                    latest[(metric, s.gpu, tuple(sorted(s.labels.items())))] = (s.latest, s.latest_ts, s.labels)
        findings = []
        for (metric, gpu, _), (value, ts, labels) in latest.items():
            if metric == BASELINE_WRONG_ANSWERS and value > 0:
                findings.append(Finding(KIND_WRONG, gpu, "critical",
                                        f"GPU {gpu} computed wrong answers in the reference workload "
                                        f"({value:.0f} wrong elements or a changed output on unchanged software): "
                                        "silent data corruption; drain it and run the vendor's diagnostics",
                                        {"wrong_elements": value}, ts))
            if metric != BASELINE_RELATIVE_THROUGHPUT:
                continue
            what, ref = labels.get("workload", ""), labels.get("reference", "")
            if ref == "own":
                thr = latest.get((BASELINE_THRESHOLD, gpu, tuple(sorted(labels.items()))))
                if thr is not None and value < thr[0]:
                    findings.append(Finding(KIND_SLOWER, gpu, "warning",
                                            f"GPU {gpu} is {1 - value:.1%} slower than its own baseline in the "
                                            f"{what} workload (per SM clock cycle; noise allows "
                                            f"{1 - thr[0]:.1%})",
                                            {"workload": what, "ratio": value, "threshold": thr[0]}, ts))
            elif ref == "sku" and value < self.settings.sku_floor:
                findings.append(Finding(KIND_BELOW_SKU, gpu, "warning",
                                        f"GPU {gpu} reaches {value:.0%} of what a healthy GPU of its model does "
                                        f"in the {what} workload (floor {self.settings.sku_floor:.0%})",
                                        {"workload": what, "ratio": value}, ts))
        return findings


DETECTOR = DetectorEntry(HealthDetector.name, "", HealthDetector.kinds, 40, lambda ctx: HealthDetector())
