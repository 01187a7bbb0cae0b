"""The reference workload's Triton kernels under the interpreter (TRITON_INTERPRET=1), against
NumPy float64, and the answer check (probes/baseline/check.py). On a GPU the same kernels are
checked against float64 on every run (tests/gpu/baseline_check.py: 130/130 on the H200)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it then

import math  # noqa: E402

import pytest  # noqa: E402

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gpuwatch.probes.baseline import check, kernels  # noqa: E402

# Triton 3.6's interpreter converts one-element arrays with int(): NumPy 2.2 warns (2.3 refuses).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def gelu_tanh64(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def inputs(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = (torch.randn(k, n, generator=g) / k ** 0.5).bfloat16()
    bias = (0.5 * torch.randn(n, generator=g)).bfloat16()
    return a, b, bias


def reference(a, b, bias, gelu=True):
    x = a.double().numpy() @ b.double().numpy() + bias.double().numpy()
    return gelu_tanh64(x) if gelu else x


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (70, 50, 96), (33, 100, 40), (128, 96, 200)])
def test_fused_gemm_bias_gelu_matches_float64_within_one_bf16_ulp(m, n, k):
    # Shapes off the 32-tiles: the masks on M, N and the K tail are exercised.
    a, b, bias = inputs(m, n, k)
    out = kernels.gemm_bias_gelu(a, b, bias, config=kernels.SMALL)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = reference(a, b, bias)
    err = np.abs(out.double().numpy() - ref) / (check.REL_TOL * np.abs(ref) + check.ABS_TOL)
    assert err.max() < 1.0, err.max()
    # Not a tautology: the same kernel without its epilogue is off by GELU's difference.
    plain = kernels.gemm_bias_gelu(a, b, bias, config=kernels.SMALL, gelu=False).double().numpy()
    assert np.abs(plain - reference(a, b, bias, gelu=False)).max() < 0.05
    assert np.abs(plain - ref).max() > 0.1


def test_grouped_tile_order_covers_every_tile():
    # GROUP_M > the number of row tiles and several column tiles: every output element is written.
    a, b, bias = inputs(96, 160, 32)
    out = torch.full((96, 160), float("nan"), dtype=torch.bfloat16)
    kernels.gemm_bias_gelu(a, b, bias, out=out, config=kernels.GemmConfig(32, 32, 32, 8, 4, 1))
    assert not torch.isnan(out).any()


def test_bad_shapes_are_refused_with_the_shapes():
    a, b, bias = inputs(32, 32, 32)
    with pytest.raises(ValueError, match="a \\(32, 32\\), b \\(16, 32\\)"):
        kernels.gemm_bias_gelu(a, b[:16], bias)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemm_bias_gelu(a, b, bias[:8])


def test_copy_kernel_copies_every_element():
    src = torch.randn(10_000)
    dst = torch.zeros_like(src)
    kernels.copy(src, dst, block=1024)  # 10,000 is not a multiple of the block: the tail is masked
    assert torch.equal(src, dst)


def test_check_passes_a_right_answer_and_catches_a_flipped_bit():
    a, b, bias = inputs(96, 128, 64, seed=3)
    out = kernels.gemm_bias_gelu(a, b, bias, config=kernels.SMALL)
    clean = check.check(a, b, bias, out, tiles=4, tile=32, seed=5)
    assert clean.ok and clean.elements == 4 * 32 * 32 and clean.max_error_ratio < 1.0
    r, c = clean.tiles[0]
    out.view(torch.int16)[r + 3, c + 4] ^= 1 << 12  # a mantissa bit near the exponent
    dirty = check.check(a, b, bias, out, tiles=4, tile=32, seed=5)
    assert not dirty.ok and dirty.mismatches >= 1 and dirty.digest != clean.digest


def test_a_flip_outside_the_sampled_tiles_still_changes_the_digest():
    a, b, bias = inputs(64, 64, 32)
    out = kernels.gemm_bias_gelu(a, b, bias, config=kernels.SMALL)
    before = check.digest(out)
    out.view(torch.int16)[63, 63] ^= 1  # the lowest mantissa bit: inside any tolerance
    assert check.digest(out) != before


def test_nan_is_a_mismatch_and_tiles_are_seeded():
    a, b, bias = inputs(64, 64, 32)
    out = kernels.gemm_bias_gelu(a, b, bias, config=kernels.SMALL)
    out[:, :] = float("nan")
    assert check.check(a, b, bias, out, tiles=2, tile=16).mismatches == 2 * 16 * 16
    assert check.tile_corners(1000, 1000, 64, 8, seed=1) == check.tile_corners(1000, 1000, 64, 8, seed=1)
    assert check.tile_corners(1000, 1000, 64, 8, seed=1) != check.tile_corners(1000, 1000, 64, 8, seed=2)
