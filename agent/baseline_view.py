"""How `gpuwatch baseline show` and `baseline run` print runs: a table and a small terminal plot.
Pure: takes run dicts (as stored by probes/baseline/probe.py), returns text and rich tables."""
from __future__ import annotations

import time

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], low: float | None = None, high: float | None = None) -> str:
    """One character per value, scaled between low and high (default: the values' own range)."""
    if not values:
        return ""
    lo = min(values) if low is None else low
    hi = max(values) if high is None else high
    if hi <= lo:
        return BARS[len(BARS) // 2] * len(values)
    return "".join(BARS[round((min(max(v, lo), hi) - lo) / (hi - lo) * (len(BARS) - 1))] for v in values)


def own_ratio(run: dict, metric: str = "gemm_flop_per_cycle") -> float | None:
    return run.get("verdict", {}).get("metrics", {}).get(metric, {}).get("own_ratio")


def plot(runs: list[dict]) -> list[str]:
    """Lines for a terminal: the fused kernel's FLOP/cycle over the runs, against the baseline."""
    values = [r["gemm_flop_per_cycle"] for r in runs if r.get("gemm_flop_per_cycle")]
    if len(values) < 2:
        return []
    ratios = [x for x in (own_ratio(r) for r in runs) if x is not None]
    lo, hi = min(values), max(values)
    lines = [f"fused GEMM, FLOP per SM cycle, oldest to newest ({len(values)} runs): {lo:,.0f} .. {hi:,.0f}",
             "  " + sparkline(values)]
    if ratios:
        lines.append(f"  against its own baseline: {sparkline(ratios, 0.9, 1.05)}  (scale 0.90 .. 1.05; "
                     f"newest {ratios[-1]:.3f})")
    return lines


def table(runs: list[dict]):
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("Time", "GPU", "Result", "Fused TFLOP/s", "vs cuBLAS", "vs unfused", "FLOP/cycle", "vs own",
                "Copy TB/s", "SM MHz", "Power W", "Temp C", "Throttle", "Check"):
        t.add_column(col, justify="left" if col in ("Time", "GPU", "Result", "Throttle", "Check") else "right")
    for r in runs:
        c = r.get("conditions", {})
        res = r.get("result", "")
        color = {"ok": "green", "wrong": "red"}.get(res, "yellow")
        ratio = own_ratio(r)
        chk = r.get("check", {})
        t.add_row(time.strftime("%m-%d %H:%M", time.localtime(r.get("ts", 0))), f"{r.get('gpu', '')}",
                  f"[{color}]{res}[/{color}]", f"{r['gemm_flops_per_second']['fused'] / 1e12:.0f}",
                  f"{r['fused_vs_cublas']:.1%}", f"{r['fused_speedup_vs_unfused']:.2f}x",
                  f"{r['gemm_flop_per_cycle']:,.0f}" if r.get("gemm_flop_per_cycle") else "-",
                  f"{ratio:.3f}" if ratio is not None else "-",
                  f"{r['memory_bytes_per_second'] / 1e12:.2f}", f"{c.get('sm_clock_mhz', 0):.0f}",
                  f"{c.get('power_watts', 0):.0f}", f"{c.get('temperature_celsius', 0):.0f}",
                  ",".join(c.get("throttle_reasons", [])) or "-",
                  "ok" if chk.get("ok") else f"[red]{chk.get('mismatches', '?')} wrong[/red]")
    return t
