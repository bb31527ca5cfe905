"""The judge of the audit: what the observed step computed in, against what the mode promised.

Every GEMM has a dtype it should run in, decided by its module: fp32 inside
`precision.fp32_modules`, float8 in a Linear that fp8 converted, the autocast dtype elsewhere under
autocast, fp32 (or TF32) without it. A breach is one promise the step did not keep, as the one
line a user reads.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

from amp_lab.precision.fp32_modules import within
from amp_lab.precision.modes import Promise

FP32_MODULES = "fp32_modules"
CONVERTED = "converted to fp8"
SHOWN = 4  # modules named per line; the rest are counted
FULL_PRECISION = ("fp32", "tf32")  # GEMM dtypes that do not count as low precision


@dataclass(frozen=True)
class Expected:
    """What a run expects of its step, beyond the mode's Promise."""

    mode: str  # precision.name
    promise: Promise
    matmul: str  # the dtype autocast (or fp32 / TF32) runs a GEMM in: mode.matmul_dtype
    fp32_compute: str  # an fp32 GEMM's dtype under this mode: tf32 or fp32
    fp32_modules: list[str]  # the model's modules precision.fp32_modules names
    ema: str | None  # the EMA's promised dtype; None without an EMA
    fsdp: dict[str, str] | None  # the FSDP plan's param_dtype / reduce_dtype


class Breach(NamedTuple):
    promise: str  # the setting or mode whose promise broke
    line: str  # what the user reads


def _broken(setting: str, promised: str, but: str, key: str | None = None) -> Breach:
    """'SETTING promises PROMISED, but BUT', the breach of `key` (default: the setting)."""
    return Breach(key or setting, f"{setting} promises {promised}, but {but}")


def module_label(module: str) -> str:
    """A module's name as a line shows it (the root module is '')."""
    return "(model)" if module == "" else module


def _names(modules: list[str]) -> str:
    shown = ", ".join(module_label(m) for m in modules[:SHOWN])
    return shown + (f" and {len(modules) - SHOWN} more" if len(modules) > SHOWN else "")


def expected_dtype(module: str, exp: Expected, fp8: dict[str, Any] | None) -> tuple[str, str]:
    """The dtype a GEMM of `module` should run in, and why."""
    if within(module, exp.fp32_modules):
        return exp.fp32_compute, FP32_MODULES
    if exp.promise.compute == "fp8":
        if fp8 and module in fp8["converted"]:
            return "fp8", CONVERTED
        left = (fp8 or {}).get("left", {}).get(module)
        return exp.matmul, f"not converted: {left}" if left else "not a Linear"
    return exp.matmul, "no autocast" if exp.matmul in FULL_PRECISION else "autocast"


def _gemm_breaches(
    gemm_flops: dict[tuple[str, str], int], exp: Expected, fp8: dict[str, Any] | None
) -> list[Breach]:
    wrong: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for module, dtype in gemm_flops:  # each (module, dtype) once
        want, why = expected_dtype(module, exp, fp8)
        if dtype != want:
            wrong[(why, want, dtype)].append(module)
    breaches = []
    for (why, want, dtype), modules in wrong.items():
        mods, mode = _names(sorted(modules)), f"precision={exp.mode}"
        if why == FP32_MODULES:
            breach = _broken(
                "precision.fp32_modules", f"{want} GEMMs in {mods}", f"they ran in {dtype}"
            )
        elif why == CONVERTED:
            breach = _broken(mode, f"float8 GEMMs in the converted {mods}", f"they ran in {dtype}")
        else:
            breach = _broken(mode, f"{want} GEMMs", f"{mods} ran them in {dtype}")
        breaches.append(breach)
    return breaches


def _fp8_breaches(
    gemm_flops: dict[tuple[str, str], int], exp: Expected, fp8: dict[str, Any] | None
) -> list[Breach]:
    if exp.promise.compute != "fp8":
        return []
    converted = (fp8 or {}).get("converted", {})
    eligible = [m for m, why in (fp8 or {}).get("left", {}).items() if why.startswith("eligible")]
    if not converted:
        ran = f"no Linear was converted: the step ran in {exp.matmul}"
        return [_broken("precision=fp8", "float8 GEMMs", ran)]
    breaches = []
    if eligible:
        not_converted = f"{_names(eligible)} were not converted"
        breaches.append(_broken("precision=fp8", "float8 for every eligible Linear", not_converted))
    if not any(dtype == "fp8" for _, dtype in gemm_flops):
        breaches.append(_broken("precision=fp8", "float8 GEMMs", "none ran in fp8"))
    return breaches


def _weight_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    promise, mode, breaches = exp.promise, f"precision={exp.mode}", []
    if promise.params == "fp32":
        low = [n for n, p in facts["params"].items() if p["dtype"] != "fp32"]
        if low:
            dtypes = ",".join(sorted({facts["params"][n]["dtype"] for n in low}))
            modules = sorted({n.rpartition(".")[0] for n in low})  # a weight's module
            breaches.append(
                _broken(mode, "fp32 weights", f"those of {_names(modules)} are {dtypes}")
            )
    if promise.masters == "fp32":
        for i, group in enumerate(facts["optimizer"]["groups"]):
            low_masters = {d: n for d, n in group["param_dtypes"].items() if d != "fp32"}
            if low_masters:
                held = ", ".join(f"{n} {d}" for d, n in low_masters.items())
                updates = f"the optimizer's param group {i} updates {held} tensors"
                breaches.append(_broken(mode, "fp32 master weights", updates))
    return breaches


def _state_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    want = exp.promise.state
    # torchao keeps small tensors (norms, biases) in fp32 by design
    allowed = {want} if want in ("fp32", "bf16", "fp16") else {want, "fp32"}
    wrong: dict[str, Counter[str]] = defaultdict(Counter)
    found = Counter[str]()
    for group in facts["optimizer"]["groups"]:
        for key, kinds in group["state"].items():
            for kind, n in kinds.items():
                found[kind] += n
                if kind not in allowed:
                    wrong[key][kind] += n
    if not found or (want in found and not wrong):
        return []
    held = ", ".join(f"{key} in {','.join(sorted(k))}" for key, k in wrong.items())
    but = f"it holds {held}" if wrong else "every state tensor is fp32"
    setting = f"optim.state_dtype={want}"
    return [_broken(setting, f"{want} optimizer state", but, key="optim.state_dtype")]


def _step_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    promise, mode, breaches = exp.promise, f"precision={exp.mode}", []
    loss = facts["loss"]["dtype"]
    if loss is not None and loss != promise.loss:
        at_backward = f"the loss in {promise.loss} at backward"
        breaches.append(_broken(mode, at_backward, f"it was {loss}", key="loss"))
    scaler = facts["scaler"]
    if promise.scaler:
        why = (
            "its GradScaler is disabled"
            if not scaler["enabled"]
            else "its scaler holds a fixed scale"
            if scaler["class"] == "StaticGradScaler"
            else "the loss was not scaled before backward"
            if not scaler["scaled_loss"]
            else None
        )
        if why:
            breaches.append(_broken(mode, "a dynamic loss scaler", why, key="scaler"))
    # a scale fixed at 1 (fp32, bf16), or a loss never scaled (model.half() drops the scaler):
    # clipping before unscale_ clips the unscaled gradients
    fixed_at_1 = scaler["class"] == "StaticGradScaler" and scaler["scale"] == 1
    scaled = scaler["scaled_loss"] and not fixed_at_1
    if scaler["enabled"] and scaler["unscaled_before_clip"] is False and scaled:
        clipped = "they were clipped before unscale_"
        at_clip = "unscaled gradients at clipping"
        breaches.append(_broken("the loss scaler", at_clip, clipped, key="scaler"))
    if exp.ema is not None and facts["ema"] is not None and facts["ema"] != [exp.ema]:
        holds = f"it holds {','.join(facts['ema'])}"
        breaches.append(_broken("trainer.ema", f"an {exp.ema} EMA", holds))
    return breaches


def _fsdp_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    if exp.fsdp is None:
        return []
    breaches = []
    for unit in facts.get("fsdp") or []:
        # exp.fsdp: param_dtype and reduce_dtype, as each unit records them
        lost = [f"{k}={unit[k]}" for k in exp.fsdp if unit[k] not in (exp.fsdp[k], None)]
        computed = [d for d in unit["computed_with"] if d != "fp32"]  # BatchNorm's stay fp32
        if exp.fsdp["param_dtype"] != "fp32" and computed != [exp.fsdp["param_dtype"]]:
            lost.append(f"computed with {','.join(unit['computed_with']) or 'nothing'}")
        if lost:
            dtypes = ", ".join(f"{key}={dtype}" for key, dtype in exp.fsdp.items())
            has = f"{unit['unit']} has {', '.join(lost)}"
            breaches.append(_broken("fsdp", f"{dtypes} in every unit", has))
    return breaches


def held_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    """The promises on what the run holds (weights, masters, optimizer state) that it broke:
    judged from `params` and `optimizer` alone, so before a step too."""
    return [*_weight_breaches(facts, exp), *_state_breaches(facts, exp)]


def breaches(
    gemm_flops: dict[tuple[str, str], int], facts: dict[str, Any], exp: Expected
) -> list[Breach]:
    """Every promise the observed step broke, one Breach each."""
    fp8 = facts.get("fp8")
    return [
        *_fp8_breaches(gemm_flops, exp, fp8),
        *_gemm_breaches(gemm_flops, exp, fp8),
        *held_breaches(facts, exp),
        *_step_breaches(facts, exp),
        *_fsdp_breaches(facts, exp),
    ]
