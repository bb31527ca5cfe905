"""Two captures of the same batch and weights, compared module by module against the bands:
the errors and flags of docs/diagnostics.md, "`amp_lab numerics`"."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from amp_lab.tools.numerics.bands import (
    FLAG_FACTOR,
    bands,
    near_overflow,
    subnormal,
    weight_grad_band,
)
from amp_lab.tools.numerics.capture import Capture, Entry

AMPLIFIERS = 5  # how many of the strongest amplifiers the report names


def errors(test: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Relative errors of `test` against `ref` and their shares of non-finite elements (fp32
    arithmetic: the errors measured are above 1e-7, far above fp32's own rounding)."""
    t, r = test.flatten(), ref.flatten()
    share_t, share_r = _nonfinite_share(t), _nonfinite_share(r)
    if share_t or share_r:  # the elements finite in both (masking copies: only when needed)
        both = torch.isfinite(t) & torch.isfinite(r)
        t, r = t[both], r[both]
    shares = {"nonfinite": share_t, "ref_nonfinite": share_r}
    if t.numel() == 0:
        return {"norm": math.inf, "max": math.inf, **shares, "max_abs": math.inf}
    diff = t - r
    return {
        "norm": _ratio(float(diff.norm()), float(r.norm())),
        "max": _ratio(float(diff.abs().max()), float(r.abs().max())),
        **shares,
        "max_abs": float(t.abs().max()) if not share_t else _finite_max(test),
    }


def _nonfinite_share(t: torch.Tensor) -> float:
    """The share of inf/nan elements; a finite sum (one reduction) shows there are none."""
    if bool(torch.isfinite(t.sum())):
        return 0.0
    return 1.0 - float(torch.isfinite(t).float().mean())


def _ratio(error: float, scale: float) -> float:
    """error / scale; an error where the scale (the reference, a band) is 0 is infinite, none 0."""
    if scale:
        return error / scale
    return math.inf if error else 0.0


def _finite_max(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else math.inf


def flag(row: dict[str, Any], compute: str, scale: float = 1.0) -> str | None:
    """Why a row leaves its band, or None (`scale`: the loss scale of a gradient)."""
    if row["ref_nonfinite"] > 0:
        return None  # the reference fails here too: not the precision's doing
    if row["nonfinite"] > 0:
        return "non-finite"
    if near_overflow(row["max_abs"], row["dtype"], compute):
        return "near overflow"
    if row["norm"] > FLAG_FACTOR * row["band"]:
        return "subnormal" if subnormal(row["max_abs"], row["dtype"], scale) else "out of band"
    return None


def _row(
    index: int, entry: Entry, ref: torch.Tensor, band: float, compute: str, scale: float = 1.0
) -> dict[str, Any]:
    name, dtype, tensor = entry
    if tensor.shape != ref.shape:
        raise ValueError(f"{name}: shapes differ between the two builds")
    row: dict[str, Any] = {"index": index, "module": name, "dtype": dtype.replace("torch.", "")}
    row.update(errors(tensor, ref), band=band)
    row["ratio"] = _ratio(row["norm"], band)
    row["flag"] = flag({**row, "dtype": dtype}, compute, scale)
    return row


def _aligned(test: list[Entry], ref: list[Entry], phase: str) -> None:
    if [e[0] for e in test] != [e[0] for e in ref]:
        raise ValueError(f"the two builds ran different modules in the {phase} pass")


def forward_rows(test: Capture, ref: Capture) -> list[dict[str, Any]]:
    """One row per forward call, with its input's error."""
    _aligned(test.forward, ref.forward, "forward")
    rows = []
    for i, (entry, band) in enumerate(zip(test.forward, bands(test.roundings))):
        row = _row(i, entry, ref.forward[i][2], band, test.compute)
        given, ref_given = test.inputs[i], ref.inputs[i]
        row["input_norm"] = None
        if given is not None and ref_given is not None:
            row["input_norm"] = errors(given, ref_given)["norm"]
        rows.append(row)
    return rows


def backward_rows(test: Capture, ref: Capture) -> list[dict[str, Any]]:
    """One row per input gradient, in backward order; the band goes on from the forward's."""
    _aligned(test.backward, ref.backward, "backward")
    depth, coarsest = sum(u > 0 for u in test.roundings), max(test.roundings, default=0.0)
    leaf_u = {name: u for (name, _, _), u in zip(test.forward, test.roundings) if u}
    steps = [leaf_u.get(name, 0.0) for name, _, _ in test.backward]
    grad_bands = bands(steps, depth, coarsest)
    return [
        _row(i, entry, ref.backward[i][2], band, test.compute, test.scale)
        for i, (entry, band) in enumerate(zip(test.backward, grad_bands))
    ]


def param_rows(test: Capture, ref: Capture) -> list[dict[str, Any]]:
    """One row per module owning parameters, in backward order, with its gradient's `terms`."""
    # a weight's gradient comes after every forward rounding and about as many backward ones
    depth, coarsest = sum(u > 0 for u in test.roundings), max(test.roundings, default=0.0)
    owners: dict[str, list[str]] = {}
    for name in test.params:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    rows = []
    for i, (module, names) in enumerate(reversed(owners.items())):
        test_g = torch.cat([test.params[n].flatten() for n in names])
        ref_g = torch.cat([ref.params[n].flatten() for n in names])
        terms = max(test.terms[n] for n in names)
        grad_band = weight_grad_band(coarsest, 2 * depth, terms)
        row = _row(i, (module, "torch.float32", test_g), ref_g, grad_band, test.compute)
        rows.append({**row, "terms": terms})
    return rows


def amplifiers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The forward calls that grow the error they are given the most (output / input error > 1),
    among those given at least a tenth of their band (one given none only adds its rounding)."""
    grown = [
        {"module": r["module"], "index": r["index"], "gain": r["norm"] / r["input_norm"]}
        for r in rows
        if r["input_norm"]
        and r["input_norm"] >= 0.1 * r["band"]
        and r["input_norm"] < r["norm"] < math.inf  # grown, and measurable
    ]
    return sorted(grown, key=lambda a: -a["gain"])[:AMPLIFIERS]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) of the logits' softmax over the batch, in fp64."""
    log_p, log_q = (torch.log_softmax(t.double(), -1) for t in (p_logits, q_logits))
    return float(F.kl_div(log_q, log_p, reduction="batchmean", log_target=True))


def outputs(test: Capture, ref: Capture) -> dict[str, float]:
    """At the output: the logits' KL(ref || test), top-1 agreement and the loss difference."""
    logits = errors(test.logits, ref.logits)
    return {
        "logit_kl": kl(ref.logits, test.logits),
        "top1_agreement": float((test.logits.argmax(-1) == ref.logits.argmax(-1)).double().mean()),
        "loss_diff": test.loss - ref.loss,
        "logits_norm": logits["norm"],
        "logits_nonfinite": logits["nonfinite"],
    }


def first_flagged(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["flag"]), None)
