"""gpuwatch / GPU health baselines: the reference workload's runs on each GPU."""
from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders.dashboard import Row
from gpuwatch.probes.baseline.verdict import HealthSettings

from .common import (
    GPU, Q, build_dashboard, by_gpu, dashed_line, datasource_var, gpu_var, increase, node_var, sel, stat, steps,
    table, ts, with_index,
)


def dashboard() -> grafana.Dashboard:
    own = sel("gpuwatch.baseline.relative_throughput", reference="own")
    sku_floor = HealthSettings().sku_floor
    gemm = "gpuwatch.baseline.gemm.throughput"
    return build_dashboard(
        "gpuwatch-baselines", "gpuwatch / GPU health baselines",
        "The reference workload's runs on each GPU over time (docs/baseline.md): FLOP per SM cycle of the "
        "fused GEMM, throughput against cuBLAS, copy bandwidth, each GPU against its own history and its "
        "model, and wrong answers (silent data corruption).",
        [datasource_var(), node_var(), gpu_var()],
        [
            Row("Latest runs"),
            stat("Wrong answers", Q(f'sum({sel("gpuwatch.baseline.wrong_answers")})', needs="baseline"))
            .unit("none").span(6).thresholds(steps("green", (1, "red")))
            .description("Output elements of the latest runs beyond tolerance of the float64 reference "
                         "(plus 1 per changed digest): above 0 is silent data corruption."),
            stat("Slower than their own baseline",
                 Q(f'count({own} < {sel("gpuwatch.baseline.threshold")}) or vector(0)')).unit("none").span(6)
            .thresholds(steps("green", (1, "red")))
            .description("GPU and workload pairs whose latest run fell below the threshold of "
                         "their own history."),
            stat("Below their model",
                 Q(f'count({sel("gpuwatch.baseline.relative_throughput", reference="sku")} '
                   f'< {sku_floor}) or vector(0)')).unit("none").span(6).thresholds(steps("green", (1, "red")))
            .description(f"Latest runs below {sku_floor:.0%} of what a healthy GPU of the model reaches."),
            stat("Oldest latest run",
                 Q(f'time() - min({sel("gpuwatch.baseline.last_run.timestamp")})',
                   needs="baseline")).unit("s").span(6).thresholds(steps("green", (86400, "orange")))
            .description("Time since the least recently checked GPU's latest run (every 6 h on idle GPUs by "
                         "default)."),
            table("Latest run per GPU",
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.gemm.efficiency"))), needs="baseline"),
                  Q(with_index(by_gpu(sel(gemm, kernel="fused"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.memory.throughput"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.relative_throughput", reference="own",
                                          workload="gemm"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.relative_throughput", reference="sku",
                                          workload="gemm"))), needs="baseline"),
                  Q(with_index(by_gpu(sel("gpuwatch.baseline.wrong_answers"))), needs="baseline"),
                  columns={"A": ("FLOP per cycle", "short"), "B": ("fused GEMM", "flops"), "C": ("copy", "Bps"),
                           "D": ("GEMM vs own", "percentunit"), "E": ("GEMM vs model", "percentunit"),
                           "F": ("wrong answers", "none")}).span(24).height(6)
            .description("vs own: against the median of the GPU's recent normal runs (from its sixth run "
                         "on); vs model: against what a healthy GPU of its model reaches."),
            Row("Over time"),
            ts("Fused kernel FLOP per SM cycle",
               Q(with_index(sel("gpuwatch.baseline.gemm.efficiency")), GPU,
                 needs="baseline")).unit("short")
            .description("What the health judgement compares: throughput per SM clock cycle, so a GPU that "
                         "merely runs at a lower clock is not taken for a slower one."),
            ts("Against its own baseline and its model",
               Q(with_index(sel("gpuwatch.baseline.relative_throughput")), GPU + " {{workload}} vs {{reference}}",
                 needs="baseline"),
               Q(with_index(sel("gpuwatch.baseline.threshold")), GPU + " {{workload}} threshold", needs="baseline"))
            .unit("percentunit").min(0).override_by_regexp(" threshold$", dashed_line())
            .description("Latest run / median of the GPU's recent normal runs (own), or / what a healthy GPU "
                         "of the model reaches (sku). Below the threshold: slower."),
            ts("GEMM throughput by kernel", Q(with_index(sel(gemm)), GPU + " {{kernel}}", needs="baseline"))
            .unit("flops").min(0),
            ts("Fused kernel against cuBLAS",
               Q(with_index(f'{sel(gemm, kernel="fused")} / ignoring(kernel) {sel(gemm, kernel="cublas")}'), GPU,
                 needs="baseline")).unit("percentunit").min(0),
            ts("Copy bandwidth", Q(with_index(sel("gpuwatch.baseline.memory.throughput")), GPU, needs="baseline"))
            .unit("Bps").min(0).description("A 1 GiB device-to-device copy, bytes read + written per second."),
            table("Runs in range by result",
                  Q(with_index(f'sum by (instance, gpu, result) ({increase("gpuwatch.baseline.runs")})'),
                    needs="baseline"),
                  columns={"A": ("runs", "none")})
            .description("ok, slower, below_sku, wrong (judged), skipped (the GPU was busy), failed."),
        ])
