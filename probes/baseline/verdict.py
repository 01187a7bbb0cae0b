"""The verdict on a reference-workload run: slower than its own past, below its SKU, wrong.

A run (probes/baseline/workload.py) measures the fused GEMM's throughput per SM clock cycle
(FLOP/cycle: the clock a power cap or a warm GPU sets is thermal's business, not a slower GPU)
and the copy kernel's bytes/s, and checks the answer. Judging, per GPU:

  own history   the median of the last `history` normal runs of the same shape, kernel config and
                software (a driver or Triton upgrade starts a new baseline), spread = 1.4826 x MAD;
                a run is slower when it falls below the median by more than max(k x spread,
                min_drop) (min_drop_memory for the copy) — noise is measured, not assumed. One
                run cannot resolve 3 % on the H200 without false alarms (1 in 26 warm runs fell
                5 % below the median), so a run judged slower brings up to `retakes` more runs
                (probes/baseline/probe.py) and the GPU is judged on the median of them all
                (figure()): the numbers are in docs/baseline.md.
  SKU           EXPECTED[name] holds what a healthy GPU of that model reaches (measured, with
                the date, docs/baseline.md); below floor x that is a finding from the first run.
  wrong         any sampled element beyond tolerance, or a changed output digest on unchanged
                software: silent data corruption, critical.

Pure: judge() takes the run and the past runs; the baseline probe judges each run it takes, and
detectors/health.py turns its latest verdict samples into findings. Nothing here does I/O. In the core
(docs/ARCHITECTURE.md): the probe and the detector both read HealthSettings.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence


# What a healthy GPU of each model reaches with the default run (8192^3) and kernel config, by
# NVML's name: medians of 130 runs on the H200, 2026-11-30 (docs/baseline.md). The config is part of
# the expectation: another tile shape does other work per cycle.
EXPECTED: dict[str, dict] = {
    "NVIDIA H200": {"config": {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8, "num_warps": 8,
                               "num_stages": 4},
                    "gemm_flop_per_cycle": 420_582.0, "memory_bytes_per_second": 4.011e12},
}


@dataclass
class HealthSettings:
    # Defaults from 31 warm runs on the H200, 2026-12-04 (docs/baseline.md has the arithmetic):
    # FLOP/cycle spread 0.91 %, copy 0.19 %.
    history: int = 20              # recent normal runs that make the baseline
    min_history: int = 5           # runs before the own-history judgement starts
    k_spread: float = 2.5          # slower by more than k x the robust spread...
    min_drop: float = 0.015        # ...and by at least this fraction (FLOP per SM cycle)
    min_drop_memory: float = 0.01  # the same for the copy's bytes/s
    retakes: int = 2               # more runs taken when one is judged slower (the probe takes them)
    sku_floor: float = 0.85        # below this fraction of the SKU's expectation


@dataclass
class Verdict:
    metric: str               # "gemm_flop_per_cycle" or "memory_bytes_per_second"
    value: float              # the median over the run and its retakes (figure())
    runs: int                 # how many runs that value is the median of
    own_median: float | None  # None: not enough history yet
    own_spread: float | None  # relative (spread / median)
    own_ratio: float | None   # value / own_median
    threshold: float | None   # own_ratio below this is slower
    sku_expected: float | None
    sku_ratio: float | None
    sku_floor: float

    @property
    def slower(self) -> bool:
        return self.own_ratio is not None and self.threshold is not None and self.own_ratio < self.threshold

    @property
    def below_sku(self) -> bool:
        return self.sku_ratio is not None and self.sku_ratio < self.sku_floor


def software_key(run: dict) -> tuple:
    """Runs are comparable when these match: shape, kernel config, software."""
    v = run.get("versions", {})
    return (tuple(run.get("shape", ())), tuple(sorted(run.get("config", {}).items())),
            v.get("torch"), v.get("triton"), v.get("driver"))


def is_normal(run: dict) -> bool:
    """A run that may join the baseline: it ran, was right, and was not judged slower."""
    return bool(run.get("check", {}).get("ok")) and not run.get("verdict", {}).get("slower")


METRICS = ("gemm_flop_per_cycle", "memory_bytes_per_second")
RETAKE_FIELDS = ("gemm_flop_per_cycle", "memory_bytes_per_second", "held_seconds", "seed")


def retake_of(run: dict) -> dict:
    """What a run taken again keeps of itself, inside the first run's record ("retakes")."""
    out = {k: run[k] for k in RETAKE_FIELDS if k in run}
    check = run.get("check", {})
    out["check"] = {k: check[k] for k in ("ok", "mismatches", "digest") if k in check}
    return out


def runs_of(run: dict) -> list[dict]:
    """The run and the runs taken again after it."""
    return [run] + [r for r in run.get("retakes", ()) if isinstance(r, dict)]


def figure(run: dict, metric: str) -> float | None:
    """The median of `metric` over the run and its retakes (the run's own value when there are none)."""
    values = [r[metric] for r in runs_of(run) if r.get(metric) is not None]
    return statistics.median(values) if values else None


def judge(run: dict, past: Sequence[dict], s: HealthSettings | None = None,
          expected: dict[str, dict] | None = None) -> dict:
    """The verdict on `run` given this GPU's past runs (oldest first). JSON-able."""
    s = s or HealthSettings()
    expected = EXPECTED if expected is None else expected
    key = software_key(run)
    same = [r for r in past if software_key(r) == key and is_normal(r)][-s.history:]
    sku = expected.get(run.get("name", ""))
    if sku is None or tuple(run.get("shape", ())) != (8192, 8192, 8192) or sku.get("config") != run.get("config"):
        sku = None
    verdicts = {}
    for metric in METRICS:
        value = figure(run, metric)
        if value is None:
            continue
        values = [v for v in (figure(r, metric) for r in same) if v]
        median = spread = ratio = threshold = None
        if len(values) >= s.min_history:
            median = statistics.median(values)
            spread = 1.4826 * statistics.median(abs(v - median) for v in values) / median
            ratio = value / median
            drop = s.min_drop_memory if metric == "memory_bytes_per_second" else s.min_drop
            threshold = 1.0 - max(s.k_spread * spread, drop)
        exp = sku.get(metric) if sku else None
        verdicts[metric] = Verdict(metric, value, sum(1 for r in runs_of(run) if r.get(metric) is not None), median, spread,
                                   ratio, threshold, exp, value / exp if exp else None, s.sku_floor)
    # The same inputs (seed) on the same software give bit-identical outputs; every retake is checked too.
    digest_changed = False
    for r in runs_of(run):
        digests = {p["check"]["digest"] for p in same
                   if "digest" in p.get("check", {}) and p.get("seed") == r.get("seed")}
        digest_changed |= bool(digests) and r.get("check", {}).get("digest") not in digests
    wrong = not all(r.get("check", {}).get("ok", False) for r in runs_of(run)) or digest_changed
    return {
        "slower": any(v.slower for v in verdicts.values()),
        "below_sku": any(v.below_sku for v in verdicts.values()),
        "wrong": wrong, "digest_changed": digest_changed, "baseline_runs": len(same),
        "metrics": {m: vars(v) for m, v in verdicts.items()},
    }
