"""The error a precision is expected to add, module by module: the divergence finder's bands.

The model (docs/diagnostics.md, "Where the precisions part ways"): every leaf module that rounds
its result to a low-precision dtype adds a relative error of about that dtype's unit roundoff u
(2^-11 fp16, 2^-8 bf16, 2^-4 float8 e4m3, 2^-3 e5m2, 2^-24 fp32). Normalisations and residual
streams keep a relative error from compounding layer over layer, so the band grows slowly with
the depth n (the rounding leaf modules run so far, forward then backward) and takes the coarsest
u met on the way (an error once made stays):

    band = SPREAD * max(u_i, i <= n) * sqrt(1 + log2(n))

Each element of a weight's gradient sums T products (T: its reduction length, batch x positions),
and a sum whose result cancels keeps its terms' errors: its band is that of depth 2n (all of
forward, about as much backward) times sqrt(1 + T / GRAD_TERMS).

A module's norm-wise error leaves its band when it exceeds FLAG_FACTOR x band.
"""

from __future__ import annotations

import math

import torch

# Unit roundoff 2^-(mantissa bits + 1): half the gap between 1 and the next number
UNIT_ROUNDOFF = {
    "fp32": 2.0**-24,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "fp8_e4m3": 2.0**-4,
    "fp8_e5m2": 2.0**-3,
}
TORCH_NAMES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}
# Measured on test_vit and test_convnext (docs/diagnostics.md): a healthy module's norm-wise
# error sits at 0.6-1.4 u (one rounding's RMS error is u/sqrt(3); a GEMM rounds its inputs and its
# output), so SPREAD = 1 makes the band an envelope, not a derivation.
SPREAD = 1.0
# Out of band above FLAG_FACTOR x band: a rounding 16x coarser than labelled (float8 e4m3 inside
# bf16, bf16 inside fp16) leaves it (measured: 3.1x); the healthy spread between modules (at
# most 0.8x forward, 1.1x backward) does not.
FLAG_FACTOR = 2.0
# An output whose max |x| passes this share of the largest value of its dtype or of the run's
# compute dtype (its consumer, a GEMM, casts it there) is flagged even if its error is in band:
# the next reduction over it (a matmul, attention's q.k, a sum of squares) overflows.
HEADROOM = 0.25
# A gradient whose T products cancel may err more than its depth's band: errors its terms share
# add up as T while the cancelling result grows as sqrt(T), so its relative error grows as
# sqrt(T). Measured (docs/diagnostics.md): test_convnext's LayerNorm weights reach 0.08-0.22 x
# sqrt(T) x the band of their depth (T = 1024 to 32768), its other weights and all of test_vit's
# 0.3-2x that band whatever T. Below GRAD_TERMS products the depth's band holds.
GRAD_TERMS = 64


def dtype_key(dtype: str) -> str:
    """The band table's name of a torch dtype as str(tensor.dtype) spells it."""
    return TORCH_NAMES.get(dtype, "fp32")


def band(u: float, depth: int) -> float:
    """The band of a tensor whose coarsest rounding so far had unit roundoff u, after `depth`
    rounding modules."""
    return SPREAD * u * math.sqrt(1 + math.log2(max(depth, 1)))


def weight_grad_band(u: float, depth: int, terms: int) -> float:
    """The band of a weight's gradient whose elements each sum `terms` products, after `depth`
    rounding modules whose coarsest had unit roundoff u."""
    return band(u, depth) * math.sqrt(1 + terms / GRAD_TERMS)


def bands(roundings: list[float], depth: int = 0, u: float = 0.0) -> list[float]:
    """The band after each of a sequence of roundings (their unit roundoffs in order, 0 for a
    module that rounds nothing), going on from `depth` roundings whose coarsest was `u`."""
    out = []
    for step in roundings:
        depth, u = depth + (step > 0), max(u, step)
        out.append(band(u, depth))
    return out


def subnormal(max_abs: float, dtype: str, scale: float) -> bool:
    """A 16-bit tensor (times the loss scale it was computed at) whose largest value is within
    2^10 of its dtype's smallest normal: its typical elements are subnormal, short of mantissa."""
    return dtype_key(dtype) != "fp32" and max_abs * scale < _finfo(dtype).tiny * 2.0**10


def _finfo(dtype: str) -> torch.finfo:
    """The finfo of a dtype as str(tensor.dtype) spells it (or its bare name)."""
    return torch.finfo(getattr(torch, dtype.replace("torch.", "")))


def near_overflow(max_abs: float, dtype: str, compute: str) -> bool:
    """max |x| within HEADROOM of the largest value of `dtype` or of the run's `compute` dtype."""
    largest = min(_finfo(dtype).max, _finfo(compute).max)
    return math.isfinite(max_abs) and max_abs > HEADROOM * largest
