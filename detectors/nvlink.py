"""NVLink findings per GPU and link: error counters rising, a link that was up going down.

From the NVML probe's gpuwatch.gpu.nvlink.errors {link, type} and gpuwatch.gpu.nvlink.up {link}.
Counters are read as their increase over a window, summing rises and ignoring drops, so a driver
reload (counters back to 0) or an agent restart is never a finding. A link that was never up in
the history (not cabled, disabled) is not a finding either: only one seen up and now down.

Pure: observe(history) reads series and returns findings.
"""
from __future__ import annotations

from typing import Iterable

from gpuwatch.agent.api import Detector, Finding
from gpuwatch.agent.history import History, Series
from gpuwatch.agent.metrics import GPU_NVLINK_ERRORS, GPU_NVLINK_UP
from gpuwatch.agent.registry import DetectorEntry

KIND_ERRORS = "nvlink_errors"
KIND_DOWN = "nvlink_down"

# Counter types judged, in words. dl_crc is what per-link field values give (what `nvidia-smi
# nvlink -e` calls CRC Errors); dl_crc_flit and dl_crc_data come from older drivers' per-call reads.
ERROR_WORDS = {
    "dl_recovery": "recovery errors",
    "dl_replay": "replay errors",
    "dl_crc": "CRC errors",
    "dl_crc_flit": "flit CRC errors",
    "dl_crc_data": "data CRC errors",
}
# A recovery is the link retraining: traffic stopped on it. The others are retried transfers.
CRITICAL_TYPES = frozenset({"dl_recovery"})


class NvlinkDetector(Detector):
    name = "nvlink"
    interval = 10.0
    kinds = (KIND_ERRORS, KIND_DOWN)
    needs = ("nvml",)

    def __init__(self, window: float = 600.0) -> None:
        self.window = window  # a rise stays a finding this long

    def observe(self, history: History) -> Iterable[Finding]:
        now = history.newest(GPU_NVLINK_UP, GPU_NVLINK_ERRORS)
        if now is None:
            return []
        return self._down(history.select(GPU_NVLINK_UP)) + self._errors(history.select(GPU_NVLINK_ERRORS), now)

    def _down(self, up: list[Series]) -> list[Finding]:
        out = []
        for s in up:
            gpu, link, pts = s.gpu, s.labels.get("link", ""), s.points
            if s.latest != 0:
                continue
            was_up = [t for t, v in pts if v == 1]
            if not was_up:
                continue
            went_down = next(t for t, v in pts if t > was_up[-1])
            out.append(Finding(KIND_DOWN, gpu, "critical",
                               f"GPU {gpu} NVLink {link} went down (up until {was_up[-1]:.0f}): traffic over it "
                               f"now takes the other links or PCIe; check `nvidia-smi nvlink -s` and the kernel "
                               f"log for XID 74, then reset the GPU or drain the node",
                               {"id": f"{link}:down", "link": link, "last_up": was_up[-1], "down_since": went_down},
                               ts=pts[-1][0]))
        return out

    def _errors(self, errors: list[Series], now: float) -> list[Finding]:
        since = now - self.window
        rose: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        for s in errors:
            kind, link = s.labels.get("type"), s.labels.get("link", "")
            if kind not in ERROR_WORDS:
                continue
            n = s.increase(since)
            if n > 0:
                span = min(self.window, now - s.points[0][0]) or self.window
                rose.setdefault((s.gpu, link), {})[kind] = (n, n / span)
        out = []
        for (gpu, link), by_kind in sorted(rose.items()):
            kinds = sorted(by_kind, key=list(ERROR_WORDS).index)
            severity = "critical" if CRITICAL_TYPES & set(kinds) else "warning"
            words = ", ".join(f"{ERROR_WORDS[k]} +{by_kind[k][0]:.0f} ({by_kind[k][1] * 60:.2g}/min)" for k in kinds)
            out.append(Finding(KIND_ERRORS, gpu, severity,
                               f"GPU {gpu} NVLink {link}: {words} in the last {self.window / 60:.0f} min: a "
                               f"degrading link retries (slows every collective over it) before it fails; "
                               f"watch `nvidia-smi nvlink -e`, reseat or RMA if it keeps rising",
                               {"id": f"{link}:errors", "link": link,
                                "increase": {k: by_kind[k][0] for k in kinds},
                                "rate_per_second": {k: by_kind[k][1] for k in kinds},
                                "window_seconds": self.window}, ts=now))
        return out


DETECTOR = DetectorEntry(NvlinkDetector.name, "", NvlinkDetector.kinds, 70, lambda ctx: NvlinkDetector())
