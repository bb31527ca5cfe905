"""Where the precisions part ways: the builds of `--vs fp32` and `--vs compiled`, each one
batch through the same weights (capture.py), compared module by module (compare.py)."""

from __future__ import annotations

import math
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from amp_lab.config import ConfigError
from amp_lab.run import Run
from amp_lab.tools import probe
from amp_lab.tools.numerics import compare
from amp_lab.tools.numerics.bands import FLAG_FACTOR, GRAD_TERMS, HEADROOM, SPREAD
from amp_lab.tools.numerics.capture import Batch, Capture, capture, first_batch
from amp_lab.tools.numerics.weight_drift import drift

REFERENCE = ["precision=fp32", "pitfall=none", "trainer.compile=off"]
# compiled error below this share of eager's (against fp32): computed wider than labelled
UPCAST = 0.25


def built(overrides: list[str], into: Path, steps: int = 1) -> AbstractContextManager[Run]:
    """The run of `overrides` (`steps` steps of it, no audit), closed after use."""
    return probe.built(probe.settings(overrides, "audit=off", f"trainer.max_steps={steps}"), into)


def _capture(
    overrides: list[str], into: Path, batch: Batch | None, ref: Run | None, hooks: bool
) -> tuple[Run, Capture]:
    """One build's pass on `batch` (default: its own first), with `ref`'s weights if given."""
    with built(overrides, into) as run:
        if ref is not None:  # the very same weights, whatever each build's dtype
            run.model.load_state_dict(ref.model.state_dict())
        return run, capture(run, batch or first_batch(run), hooks)


def comparison(test: Capture, ref: Capture) -> dict[str, Any]:
    """Module-by-module comparison of `test` against `ref`, with its first flagged rows."""
    forward = compare.forward_rows(test, ref) if test.forward else []
    backward = compare.backward_rows(test, ref) if test.backward else []
    params = compare.param_rows(test, ref)
    return {
        "loss_scale": test.scale,
        "output": compare.outputs(test, ref),
        "first_out_of_band": {
            "forward": compare.first_flagged(forward),
            "backward": compare.first_flagged(backward) or compare.first_flagged(params),
        },
        "amplifiers": compare.amplifiers(forward),
        "forward": forward,
        "backward": backward,
        "params": params,
    }


def vs_fp32(overrides: list[str], modes: list[str], work: Path, steps: int) -> dict[str, Any]:
    """Each mode against fp32 on the same batch and weights (and over `steps` training steps)."""
    ref_run, ref = _capture([*overrides, *REFERENCE], work / "fp32", None, None, True)
    batch = first_batch(ref_run)
    found: dict[str, Any] = {}
    for mode in modes:
        mine = [*overrides, f"precision={mode}"]
        _, test = _capture(mine, work / mode, batch, ref_run, True)
        found[mode] = comparison(test, ref)
        if steps:
            with (
                built([*overrides, *REFERENCE], work / "fp32_steps", steps) as ref_steps,
                built(mine, work / f"{mode}_steps", steps) as test_steps,
            ):
                found[mode]["drift"] = drift(ref_steps, test_steps, steps)
    return {"modes": found}


def vs_compiled(overrides: list[str], mode: str, work: Path) -> dict[str, Any]:
    """`mode` eager and `mode` under trainer.compile=model, each against fp32."""
    ref_run, ref = _capture([*overrides, *REFERENCE], work / "fp32", None, None, True)
    batch = first_batch(ref_run)
    mine = [*overrides, f"precision={mode}"]
    _, eager = _capture([*mine, "trainer.compile=off"], work / "eager", batch, ref_run, True)
    _, compiled = _capture(
        [*mine, "trainer.compile=model"], work / "compiled", batch, ref_run, False
    )
    compiled.roundings, compiled.terms = eager.roundings, eager.terms  # the same bands
    eager_cmp, compiled_cmp = comparison(eager, ref), comparison(compiled, ref)
    return {
        "modes": {mode: eager_cmp, f"{mode} compiled": compiled_cmp},
        "compiled_flags": compiled_flags(eager_cmp, compiled_cmp),
    }


def compiled_flags(eager: dict[str, Any], compiled: dict[str, Any]) -> list[dict[str, Any]]:
    """What the compiled step does that its eager twin does not: non-finite values in one only,
    an error far below eager's (computed in higher precision than labelled), rows out of band."""
    pairs = [
        ("logits", eager["output"]["logits_nonfinite"], compiled["output"]["logits_nonfinite"])
    ]
    pairs += [
        (e["module"], e["nonfinite"], c["nonfinite"])
        for e, c in zip(eager["params"], compiled["params"])
    ]
    flags: list[dict[str, Any]] = []
    for side, mine, other in (("eager", 1, 2), ("compiled", 2, 1)):  # non-finite in one only
        if only := [p[0] for p in pairs if p[mine] and not p[other]]:
            flags.append(
                {"kind": f"non-finite in {side} only", "where": only[0], "count": len(only)}
            )
    e_err, c_err = eager["output"]["logits_norm"], compiled["output"]["logits_norm"]
    if math.isfinite(e_err) and c_err < UPCAST * e_err:
        flags.append(
            {
                "kind": "computed wider than labelled",
                "where": "logits",
                "eager_error": e_err,
                "compiled_error": c_err,
            }
        )
    flags += [
        {"kind": "out of band", "where": r["module"], "ratio": r["ratio"]}
        for r in compiled["params"]
        if r["flag"] == "out of band"
    ]
    return flags


def find(
    overrides: list[str], vs: str, also: list[str], out: Path | None = None, steps: int = 0
) -> dict:
    """The comparison the command asks for (ConfigError when it cannot be made)."""
    mode = probe.settings(overrides).precision.name
    if vs == "fp32" and mode == "fp32" and not also:
        raise ConfigError(
            "precision=fp32 is the reference itself; name the mode to test, e.g. "
            "amp_lab numerics precision=bf16 --vs fp32"
        )
    with tempfile.TemporaryDirectory(prefix="amp_lab_numerics_", dir=out) as work:
        if vs == "compiled":
            result = vs_compiled(overrides, str(mode), Path(work))
        else:
            modes = [m for m in dict.fromkeys([str(mode), *also]) if m != "fp32"]
            result = vs_fp32(overrides, modes, Path(work), steps)
    bands = {
        "band": "SPREAD * max(u so far) * sqrt(1 + log2(rounding modules so far))",
        "weight_grad_band": "band after all of forward and as much backward "
        "* sqrt(1 + terms / GRAD_TERMS)",
        "spread": SPREAD,
        "grad_terms": GRAD_TERMS,
        "flag_factor": FLAG_FACTOR,
        "headroom": HEADROOM,
    }
    return {"overrides": overrides, "precision": str(mode), "vs": vs, "bands": bands, **result}


def fp32_candidates(found: dict[str, Any], limit: int = 5) -> list[str]:
    """Modules worth keeping in fp32, best first: the first non-finite, the out-of-band ones by how
    far out, the strongest amplifiers; none when no module left its band. A 'near overflow' one
    is left out: the GEMM reading its output casts it down, and that GEMM turns non-finite."""
    forward = found["forward"]
    if not any(r["flag"] in ("non-finite", "out of band") for r in forward):
        return []
    broke = [r["module"] for r in forward if r["flag"] == "non-finite"][:1]
    out = sorted((r for r in forward if r["flag"] == "out of band"), key=lambda r: -r["ratio"])
    ranked = [*broke, *(r["module"] for r in out), *(a["module"] for a in found["amplifiers"])]
    return list(dict.fromkeys(ranked))[:limit]


def for_doctor(overrides: list[str], mode: str) -> dict[str, Any]:
    """What the doctor keeps of `mode` (scaled) against fp32: first flagged, output, candidates."""
    mine = find([*overrides, f"precision={mode}", "scaler.enabled=true"], "fp32", [])["modes"][mode]
    first = {
        phase: row and {k: row[k] for k in ("module", "flag", "norm", "ratio", "nonfinite")}
        for phase, row in mine["first_out_of_band"].items()
    }
    return {
        "first_out_of_band": first,
        "output": mine["output"],
        "fp32_candidates": fp32_candidates(mine),
    }
