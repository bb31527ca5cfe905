"""The precision coverage of a step: the share of its GEMM FLOPs in each dtype, the modules that
ran outside the promised dtype and why, and the headline a user reads:
'bf16: 97.1% of GEMM FLOPs in bf16; fp32: head (2.9%, fp32_modules)'.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from amp_lab.audit.promises import SHOWN, Expected, expected_dtype, module_label


def _pct(share: float) -> str:
    """A share as a percentage that never shows a small remainder as 0.0% or 100.0%."""
    if 0 < share < 0.001:
        return "<0.1%"
    if 0.999 < share < 1:
        return ">99.9%"
    return f"{share:.1%}"


def coverage(
    gemm_flops: dict[tuple[str, str], int], exp: Expected, fp8: dict[str, Any] | None
) -> dict[str, Any]:
    """The share of GEMM FLOPs per dtype, the modules outside the promised dtype with why, and
    the headline: 'bf16: 97.1% of GEMM FLOPs in bf16; fp32: head (2.9%, fp32_modules)'."""
    total, promised = sum(gemm_flops.values()), exp.promise.compute
    by_dtype: Counter[str] = Counter()
    others: dict[str, Counter[str]] = defaultdict(Counter)
    for (module, dtype), flops in gemm_flops.items():
        by_dtype[dtype] += flops
        if dtype != promised:
            others[dtype][module] += flops
    share = {dtype: flops / total for dtype, flops in by_dtype.most_common()} if total else {}
    outside: list[dict[str, Any]] = []
    headline = f"{exp.mode}: {_pct(share.get(promised, 0.0))} of GEMM FLOPs in {promised}"
    if promised == "fp8" and fp8 and fp8.get("emulated"):
        headline += " (emulated)"
    for dtype in sorted(others, key=lambda d: -by_dtype[d]):
        parts = []
        for module, flops in others[dtype].most_common():
            want, why = expected_dtype(module, exp, fp8)
            reason = why if want == dtype else f"expected {want}"
            outside.append(
                {"dtype": dtype, "module": module, "share": flops / total, "reason": reason}
            )
            parts.append(f"{module_label(module)} ({_pct(flops / total)}, {reason})")
        more = f", {len(parts) - SHOWN} more" if len(parts) > SHOWN else ""
        headline += f"; {dtype}: {', '.join(parts[:SHOWN])}{more}"
    return {
        "flops": dict(by_dtype),
        "share": share,
        "outside_promised": outside,
        "headline": headline if total else f"{exp.mode}: no matmul or convolution ran",
    }
