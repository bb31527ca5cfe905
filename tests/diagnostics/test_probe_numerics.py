"""The probes' fast reductions equal their plain definitions on awkward values.

A probe step reads every activation, gradient and second moment, so its reductions are written
for speed (one min/max reduction for max |x|, the fp32 exponent bits for the log2 histogram,
running counts for per-tensor shares, one flat pass over the moments). Each is checked here
against the obvious formula on values that include zeros, fp16 subnormals, fp32 subnormals,
powers of two at the bin edges, inf and nan.
"""

from __future__ import annotations

import math

import pytest
import torch

from amp_lab.diagnostics.grad_numerics import (
    FP16_MIN_NORMAL,
    HIST_HIGH,
    HIST_LOW,
    grad_stats,
)
from amp_lab.diagnostics.module_probe import _max_abs
from amp_lab.diagnostics.optimizer_state import _moment_counts, _zero_and_subnormal


def _awkward(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-45, 20, (n,), generator=g))
    special = [0.0, -0.0, 2.0**-24, 2.0**-14, 2.0**-40, 2.0**-41, 2.0**23, 1e-40, -3.5e-8]
    # fp16's rounding edges: half the smallest subnormal (a tie: to 0) and just above it (up to
    # 2^-24), the top of the subnormals and the tie under the smallest normal (up to 2^-14)
    special += [2.0**-25, -(2.0**-25) * 1.001, 2.0**-14 - 2.0**-24, 2.0**-14 - 2.0**-25]
    k = min(n, len(special))
    x[:k] = torch.tensor(special[:k])
    return x


def _grads() -> list[torch.Tensor]:
    return [_awkward(n, seed).reshape(-1, 1) for seed, n in enumerate((37, 1, 500, 4096, 12))]


@pytest.mark.parametrize("scale", [1.0, 65536.0, 1000.0])
def test_per_tensor_counts_and_the_histogram_match_their_definitions(scale):
    grads = _grads()
    counts, hist = grad_stats(grads, torch.tensor(scale))
    for i, g in enumerate(grads):
        a = g.abs().reshape(-1)
        h, hs = a.half(), (a * scale).half()  # what fp16 makes of them: torch's own rounding
        expected = [
            (a == 0).sum(),
            ((a > 0) & (h == 0)).sum(),
            ((h > 0) & (h < FP16_MIN_NORMAL)).sum(),
            ((a > 0) & (hs == 0)).sum(),
            ((hs > 0) & (hs < FP16_MIN_NORMAL)).sum(),
        ]
        assert counts[:, i].tolist() == [float(e) for e in expected]
    flat = torch.cat([g.reshape(-1) for g in grads]).abs()
    reference = torch.zeros(HIST_HIGH - HIST_LOW)
    for value in flat.tolist():
        if value > 0 and math.isfinite(value):
            k = math.floor(math.log2(value)) - HIST_LOW
            if 0 <= k < len(reference):
                reference[k] += 1
    assert torch.equal(hist, reference)
    assert hist[0] > 0 and hist[-1] > 0, "both edge bins are exercised"


def test_inf_and_nan_gradients_stay_out_of_the_histogram():
    g = torch.tensor([1.0, math.inf, -math.inf, math.nan, 0.5])
    _, hist = grad_stats([g], torch.tensor(1.0))
    assert hist.sum() == 2 and hist[0 - HIST_LOW] == 1 and hist[-1 - HIST_LOW] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "values",
    [[1.0, -3.0, 2.0], [-0.0, 0.0], [1.0, math.inf], [-math.inf, 2.0], [1.0, math.nan, -7.0]],
)
def test_max_abs_is_the_inf_norm_in_fp32(dtype, values):
    t = torch.tensor(values, dtype=dtype).reshape(1, -1)
    got = _max_abs(t)
    want = torch.linalg.vector_norm(t, math.inf, dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, want) or (got.isnan() and want.isnan())


def test_moment_counts_in_one_pass_equal_the_counts_one_by_one():
    moments = [_awkward(n, seed).abs() for seed, n in enumerate((100, 3, 2048))]
    moments += [m.to(torch.bfloat16) for m in moments] + [moments[0].half()]
    one_by_one = torch.stack([_zero_and_subnormal(v) for v in moments]).sum(0)
    assert torch.equal(_moment_counts(moments), one_by_one)
    assert one_by_one[0] > 0 and one_by_one[1] > 0, "zeros and subnormals are exercised"
