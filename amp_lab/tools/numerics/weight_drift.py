"""`amp_lab numerics --steps N`: the mode under test and fp32 train N steps from the same weights
and data order; where their weights part ways faster than rounding alone explains, a random
walk from step 1's difference per unit of update (docs/diagnostics.md, "`--steps N`"):

    envelope_k = b · sqrt(sum_{j<=k} (||Δw_j|| / ||w_j||)^2),  b = d_1 / (||Δw_1|| / ||w_1||)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from amp_lab.run import Run
from amp_lab.tools.numerics.bands import FLAG_FACTOR

LAYERS = 5  # modules named at the first step that grows too fast


def _owners(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    owners: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        owners.setdefault(name.rpartition(".")[0] or name, []).append(p)
    return owners


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in params])


def drift(ref: Run, test: Run, steps: int) -> dict[str, Any]:
    """Train both runs `steps` steps on the reference's batches; per step the weights' relative
    difference and its rounding envelope, overall and per module."""
    ref.sampler.set_epoch(0, 0)
    batches = ref.data.train_batches(ref.sampler)
    owners_r, owners_t = _owners(ref.model), _owners(test.model)
    variance = dict.fromkeys(["model", *owners_r], 0.0)
    per_update: dict[str, float] = {}  # b of each module and of the model, from step 1
    rows = []
    for k in range(1, steps + 1):
        batch = next(batches)
        before = {m: _flat(ps) for m, ps in owners_r.items()}
        for run in (ref, test):
            torch.manual_seed(run.settings.trainer.seed + k)  # the same dropout masks in both
            run.train_step([batch], step=k)
        row: dict[str, Any] = {"step": k, "modules": {}}
        totals = [0.0, 0.0, 0.0]  # over the model, squared: moved, weights, difference
        for m, ps in owners_r.items():
            w_r, w_t = _flat(ps), _flat(owners_t[m])
            norms = [float(t.norm()) for t in (w_r - before[m], w_r, w_t - w_r)]
            moved, norm, diff = norms
            row["modules"][m] = _entry(m, diff / norm, moved / norm, variance, per_update)
            totals = [total + n**2 for total, n in zip(totals, norms)]
        moved, norm, diff = totals
        row.update(
            _entry("model", math.sqrt(diff / norm), math.sqrt(moved / norm), variance, per_update)
        )
        rows.append(row)
    return {"steps": rows, **_first_faster(rows)}


def _entry(
    key: str, diff: float, moved: float, variance: dict[str, float], per_update: dict[str, float]
) -> dict[str, float]:
    """A module's (or the model's) difference this step and its envelope; step 1 sets its b."""
    if key not in per_update:
        per_update[key] = diff / moved if moved else 0.0
    variance[key] += (per_update[key] * moved) ** 2
    return {"diff": diff, "envelope": math.sqrt(variance[key])}


def _past(entry: dict[str, float]) -> float:
    """How far a difference is past its envelope (0 where step 1 gave no envelope to judge by)."""
    return entry["diff"] / entry["envelope"] if entry["envelope"] > 0 else 0.0


def _first_faster(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first step the model's weights part ways faster than rounding; its furthest modules."""
    for row in rows:
        if _past(row) > FLAG_FACTOR:
            past = {m: _past(e) for m, e in row["modules"].items()}
            ranked = sorted((m for m in past if past[m] > FLAG_FACTOR), key=lambda m: -past[m])
            return {"first_faster_step": row["step"], "first_layers": ranked[:LAYERS]}
    return {"first_faster_step": None, "first_layers": []}


def drift_lines(found: dict[str, Any]) -> list[str]:
    """The console lines of a drift."""
    lines = [
        f"  step {r['step']:>3}: weights apart {r['diff']:.2e} "
        f"(rounding alone: {r['envelope']:.2e})"
        for r in found["steps"]
    ]
    step = found["first_faster_step"]
    lines.append(
        "  weights part ways faster than rounding from step "
        f"{step}, first in: {', '.join(found['first_layers']) or 'the model as a whole'}"
        if step
        else "  weights stay within what rounding explains"
    )
    return lines
