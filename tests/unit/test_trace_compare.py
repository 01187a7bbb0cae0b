"""bench/trace_compare.py's reading of what each tool saw (the GPU run itself is tests/gpu/compare_check.sh)."""
from __future__ import annotations

import pytest

from tests.conftest import load_script

tc = load_script("trace_compare", "bench")

TRUTH = {"tritons": 300, "matmuls": 50, "graph_replays": 97, "graph_kernels": 291, "expand_bytes": 1 << 30,
         "reserved_growth_bytes": 1 << 30}


@pytest.mark.parametrize("name, kind", [
    ("gw_cover_kernel", "triton"),
    ("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "cublas"),  # what cuBLAS ran on the H200
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "cublas"),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4EZZZNS0_15sin_kernel_cudaERNS_18TensorIteratorBaseE", "graph"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)", "graph"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>", "other"),
    ("", "other"),
])
def test_kernel_names_are_told_apart(name, kind):
    assert tc.kind_of(name) == kind


def test_a_trace_summary_becomes_a_coverage_row():
    summary = {"apis": {"cuLaunchKernelEx": {"calls": 350}, "cuLaunchKernel": {"calls": 1},
                        "cuGraphLaunch": {"calls": 97}, "cuMemCreate": {"calls": 52, "bytes": 52 * 20 << 20},
                        "cuMemMap": {"calls": 52, "bytes": 52 * 20 << 20}, "cuCtxGetDevice": {"calls": 0}},
               "kernels": [{"name": "gw_cover_kernel", "launches": 300},
                           {"name": "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "launches": 50},
                           {"name": None, "launches": 1}]}
    row = tc.cover_row("trace", dict(TRUTH), summary)
    assert row["kernels"] == {"triton": 300, "cublas": 50, "other": 1}
    assert row["graph_launches"] == 97
    assert row["expand_bytes_seen"] == 52 * 20 << 20
    assert "cuCtxGetDevice" not in row["apis"]  # only what was called
    assert row["truth"]["graph_kernels"] == 291
    assert tc.launches_of(summary) == 351


def test_the_profiler_and_the_agent_rows():
    prof = {"profiler": {"kernels": {"gw_cover_kernel": 300, "nvjet_sm90_x": 50, "sin_kernel_cuda": 97,
                                     "cos_kernel_cuda": 97, "exp_kernel_cuda": 97},
                         "apis": {"cudaGraphLaunch": 97, "cudaLaunchKernel": 2}}, **TRUTH}
    row = tc.cover_row("profiler", prof, None)
    assert row["kernels"] == {"triton": 300, "cublas": 50, "graph": 291}
    assert row["graph_launches"] == 97 and row["expand_bytes_seen"] is None
    agent = {"agent": {"kernels": {"gw_cover_kernel": 300, "sin_kernel_cuda": 97}, "state": "on"},
             "agent_memory_while_held": [{"device": 0, "reserved": 3 << 30, "allocated": 1 << 30}], **TRUTH}
    row = tc.cover_row("run-continuous", agent, None)
    assert row["kernels"] == {"triton": 300, "graph": 97}
    assert row["expand_bytes_seen"] == 3 << 30 and row["graph_launches"] is None
    assert tc.cover_row("trace", TRUTH, None) == {"tool": "trace", "error": "no trace summary"}
