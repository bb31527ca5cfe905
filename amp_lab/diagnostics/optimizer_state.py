"""Adam's second moment in the dtype it is stored in, and the largest update it allows, at probes.

A moment below its storage dtype's smallest subnormal is stored as 0, and the step becomes
lr * m / eps (docs/amp_pitfalls.md §3): a probe counts the zero and subnormal `exp_avg_sq`
entries and each weight matrix's update-to-weight ratio, on the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from amp_lab.components.fsdp import local, square_norms, sum_over_shards


def _zero_and_subnormal(v: torch.Tensor) -> torch.Tensor:
    """[zero, subnormal] counts of one second-moment tensor, in its storage dtype."""
    codes = getattr(v, "codes", None)
    if codes is not None:  # torchao OptimState8bit/4bit/Fp8: codes (x a block scale)
        zero = (v.dequantize() == 0).sum()
        stored = codes if codes.is_floating_point() else None  # int codes have no subnormals
    else:
        zero, stored = (v == 0).sum(), v
    if stored is None:
        return torch.stack([zero, torch.zeros_like(zero)])
    tiny = torch.finfo(stored.dtype).tiny  # smallest normal number of the storage dtype
    magnitude = stored.float().abs()
    return torch.stack([zero, ((magnitude > 0) & (magnitude < tiny)).sum()])


def _moment_counts(moments: list[torch.Tensor]) -> torch.Tensor:
    """[zero, subnormal] totals: plain moments in one flat pass per dtype, torchao's one by one."""
    flat: dict[torch.dtype, list[torch.Tensor]] = {}
    rows = []
    for v in moments:
        if getattr(v, "codes", None) is None:
            flat.setdefault(v.dtype, []).append(v.reshape(-1))
        else:
            rows.append(_zero_and_subnormal(v))
    rows += [_zero_and_subnormal(torch.cat(parts)) for parts in flat.values()]
    return torch.stack(rows).sum(0)


def probe_state(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Device tensors for one probe step: second-moment counts and per-weight update ratios
    (`before` and `delta` this rank's part of `params`; FSDP's shards summed over `group`)."""
    moments = [s["exp_avg_sq"] for s in optimizer.state.values() if "exp_avg_sq" in s]
    probe: dict[str, Any] = {}
    if moments:
        counts = _moment_counts([local(v) for v in moments])
        probe["v_counts"] = sum_over_shards(counts, group)
        probe["v_size"] = sum(v.numel() for v in moments)  # a DTensor's: the whole tensor's
    # matrices of 4096+ values (as torchao quantises): a bias, norm or token's ratio says nothing
    keep = [i for i, w in enumerate(params) if w.dim() >= 2 and w.numel() >= 4096]
    if keep:
        squares = torch.stack([square_norms([t[i].float() for i in keep]) for t in (delta, before)])
        norms, weights = sum_over_shards(squares, group).sqrt()
        probe["ratios"] = norms / weights.clamp_min(1e-30)
        probe["ratio_index"] = keep
    return probe


def read_state_probe(probe: dict[str, Any] | None, names: list[str]) -> dict[str, Any]:
    """`diag/` keys of a probe (one host read): shares of the second moment, largest ratio."""
    if not probe:
        return {}
    record: dict[str, Any] = {}
    if "v_counts" in probe:
        zero, subnormal = probe["v_counts"].tolist()
        record["diag/v_zero_share"] = zero / probe["v_size"]
        record["diag/v_subnormal_share"] = subnormal / probe["v_size"]
    if "ratios" in probe:
        ratios = probe["ratios"].tolist()
        top = max(range(len(ratios)), key=lambda i: nan_as_inf(ratios[i]))  # nan: the largest
        record["diag/max_update_ratio"] = ratios[top]
        record["diag/max_update_ratio_param"] = names[probe["ratio_index"][top]]
    return record


def nan_as_inf(value: float) -> float:
    """A sort key under which nan is the largest value."""
    return math.inf if value != value else value
