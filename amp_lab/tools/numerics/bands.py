"""The error a precision is expected to add, module by module (docs/diagnostics.md, "The
expected band"): with u a dtype's unit roundoff, n the rounding leaves so far (forward, backward),

    band = SPREAD * max(u_i, i <= n) * sqrt(1 + log2(n))

A weight gradient summing T products gets depth 2n's band times sqrt(1 + T / GRAD_TERMS). A
module leaves its band when its norm-wise error exceeds FLAG_FACTOR x band.
"""

from __future__ import annotations

import math

import torch

# the dtypes with a band of their own, as str(tensor.dtype) spells them; any other counts as fp32
LOW = ("torch.float16", "torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2")
# Measured on test_vit and test_convnext (docs/diagnostics.md): a healthy module's norm-wise
# error sits at 0.6-1.4 u, so SPREAD = 1 makes the band an envelope, not a derivation.
SPREAD = 1.0
# A rounding 16x coarser than labelled (float8 e4m3 inside bf16, bf16 inside fp16) leaves the
# band (measured: 3.1x); the healthy spread between modules (0.8x forward, 1.1x backward) does not.
FLAG_FACTOR = 2.0
# An output past this share of the largest value of its dtype or of the run's compute dtype is
# flagged even in band: the next reduction over it (a matmul, q.k, a sum of squares) overflows.
HEADROOM = 0.25
# A gradient whose T products cancel errs as sqrt(T) x its depth's band (measured on
# test_convnext's LayerNorm weights, docs/diagnostics.md); below GRAD_TERMS products it does not.
GRAD_TERMS = 64


def unit_roundoff(dtype: str) -> float:
    """2^-(mantissa bits + 1), half the gap between 1 and the next number (fp32's beside LOW)."""
    return _finfo(dtype if dtype in LOW else "float32").eps / 2


def band(u: float, depth: int) -> float:
    """The band after `depth` rounding modules whose coarsest had unit roundoff u."""
    return SPREAD * u * math.sqrt(1 + math.log2(max(depth, 1)))


def weight_grad_band(u: float, depth: int, terms: int) -> float:
    """The band of a weight's gradient whose elements each sum `terms` products."""
    return band(u, depth) * math.sqrt(1 + terms / GRAD_TERMS)


def bands(roundings: list[float], depth: int = 0, u: float = 0.0) -> list[float]:
    """The band after each rounding in turn (unit roundoff, 0: none), from `depth` of coarsest u."""
    out = []
    for step in roundings:
        depth, u = depth + (step > 0), max(u, step)
        out.append(band(u, depth))
    return out


def subnormal(max_abs: float, dtype: str, scale: float) -> bool:
    """A 16-bit tensor whose max (at its loss scale) is within 2^10 of its dtype's least normal."""
    return dtype in LOW and max_abs * scale < _finfo(dtype).tiny * 2.0**10


def _finfo(dtype: str) -> torch.finfo:
    return torch.finfo(getattr(torch, dtype.replace("torch.", "")))


def near_overflow(max_abs: float, dtype: str, compute: str) -> bool:
    """max |x| within HEADROOM of the largest value of `dtype` or of the run's `compute` dtype."""
    largest = min(_finfo(dtype).max, _finfo(compute).max)
    return math.isfinite(max_abs) and max_abs > HEADROOM * largest
