"""GPU health findings from the reference workload's verdicts (probes/baseline/verdict.py judges
each run): slower than its own past, below its SKU, wrong answers.
"""
from __future__ import annotations

from typing import Iterable

from gpuwatch.agent.api import Detector, Finding
from gpuwatch.agent.history import History
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
        for metric in ("gpuwatch.baseline.relative_throughput", "gpuwatch.baseline.wrong_answers",
                       "gpuwatch.baseline.threshold"):
            for (_, gpu, labels), pts in history.series(metric, since=float("inf")):
                if pts:
                    latest[(metric, gpu, tuple(sorted(labels)))] = (pts[-1][1], pts[-1][0], dict(labels))
        findings = []
        for (metric, gpu, _), (value, ts, labels) in latest.items():
            if metric == "gpuwatch.baseline.wrong_answers" and value > 0:
                findings.append(Finding(KIND_WRONG, gpu, "critical",
                                        f"GPU {gpu} computed wrong answers in the reference workload "
                                        f"({value:.0f} wrong elements or a changed output on unchanged software): "
                                        "silent data corruption; drain it and run the vendor's diagnostics",
                                        {"wrong_elements": value}, ts))
            if metric != "gpuwatch.baseline.relative_throughput":
                continue
            what, ref = labels.get("workload", ""), labels.get("reference", "")
            if ref == "own":
                thr = latest.get(("gpuwatch.baseline.threshold", gpu, tuple(sorted(labels.items()))))
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
