"""Is the fused kernel's answer right? Sampled output tiles against a float64 reference computed
on the CPU (independent of the GPU under test), and a digest of the whole output.

Tolerance: |out - ref| <= 2**-7 * |ref| + 2**-12 per element. 2**-7 is one bf16 ulp relative to
the value (at most; half an ulp is what rounding to nearest can cost), 2**-12 absorbs fp32
accumulation error for values near zero. An error beyond it is a wrong answer: silent data
corruption when the software did not change. A flip of the lowest mantissa bit of a bf16 output
can hide inside the tolerance; the digest catches it on the next run of unchanged software,
because the kernel computes each element in a fixed order (bit-identical runs).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

REL_TOL = 2.0 ** -7
ABS_TOL = 2.0 ** -12


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@dataclass
class CheckResult:
    tiles: list[tuple[int, int]]  # top-left corners checked
    tile: int                     # tile edge
    elements: int                 # elements compared
    mismatches: int               # elements beyond the tolerance (NaN counts)
    max_error_ratio: float        # worst |out - ref| / tolerance (< 1 passes)
    digest: int                   # exact digest of the whole output (see digest())

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def as_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok)


def tile_corners(m: int, n: int, tile: int, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` tile corners, seeded: each run looks at other tiles, every run can be replayed."""
    rnd = random.Random(seed)
    return [(rnd.randrange(0, max(1, m - tile + 1)), rnd.randrange(0, max(1, n - tile + 1))) for _ in range(count)]


def digest(out: torch.Tensor) -> int:
    """Sum of the output's bits as int32 words, exact in int64 (one read of the output)."""
    flat = out.contiguous().view(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return int(flat.view(torch.int32).sum(dtype=torch.int64).item())


def check(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
          tiles: int = 8, tile: int = 64, seed: int = 0) -> CheckResult:
    """Compare `tiles` sampled tiles of out = gelu_tanh(a @ b + bias) with float64 on the CPU."""
    m, n = out.shape
    t = min(tile, m, n)
    corners = tile_corners(m, n, t, tiles, seed)
    bias64 = bias.detach().to("cpu", torch.float64)
    mismatches, worst, elements = 0, 0.0, 0
    for r, c in corners:
        x = a[r:r + t].to("cpu", torch.float64) @ b[:, c:c + t].to("cpu", torch.float64) + bias64[c:c + t]
        ref = gelu_tanh(x)
        got = out[r:r + t, c:c + t].to("cpu", torch.float64)
        ratio = (got - ref).abs() / (REL_TOL * ref.abs() + ABS_TOL)
        ratio = torch.nan_to_num(ratio, nan=math.inf)
        mismatches += int((ratio > 1.0).sum())
        worst = max(worst, float(ratio.max()))
        elements += ratio.numel()
    return CheckResult(corners, t, elements, mismatches, worst, digest(out))
