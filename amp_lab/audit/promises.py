"""The judge of the audit: what the observed step computed in, against what the mode promised.

Every GEMM has a dtype it should run in, decided by its module: fp32 inside
`precision.fp32_modules`, float8 in a Linear that fp8 converted, the autocast dtype elsewhere under
autocast, fp32 (or TF32) without it. A breach is one promise the step did not keep, as the one
line a user reads.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Breach:
    promise: str  # the setting or mode whose promise broke
    line: str  # what the user reads

    def describe(self) -> dict[str, str]:
        return {"promise": self.promise, "line": self.line}


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
    if exp.matmul in FULL_PRECISION:
        return exp.matmul, "no autocast"
    return exp.matmul, "autocast"


def _gemm_breaches(
    gemm_flops: dict[tuple[str, str], int], exp: Expected, fp8: dict[str, Any] | None
) -> list[Breach]:
    wrong: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for module, dtype in gemm_flops:
        want, why = expected_dtype(module, exp, fp8)
        if dtype != want and module not in wrong[(why, want, dtype)]:
            wrong[(why, want, dtype)].append(module)
    breaches = []
    for (why, want, dtype), modules in wrong.items():
        mods = _names(sorted(modules))
        if why == FP32_MODULES:
            breaches.append(
                Breach(
                    "precision.fp32_modules",
                    f"precision.fp32_modules promises {want} GEMMs in {mods}, but they ran in "
                    f"{dtype}",
                )
            )
        elif why == CONVERTED:
            breaches.append(
                Breach(
                    f"precision={exp.mode}",
                    f"precision={exp.mode} promises float8 GEMMs in the converted {mods}, but "
                    f"they ran in {dtype}",
                )
            )
        else:
            breaches.append(
                Breach(
                    f"precision={exp.mode}",
                    f"precision={exp.mode} promises {want} GEMMs, but {mods} ran them in {dtype}",
                )
            )
    return breaches


def _fp8_breaches(
    gemm_flops: dict[tuple[str, str], int], exp: Expected, fp8: dict[str, Any] | None
) -> list[Breach]:
    if exp.promise.compute != "fp8":
        return []
    converted = (fp8 or {}).get("converted", {})
    eligible = [m for m, why in (fp8 or {}).get("left", {}).items() if why.startswith("eligible")]
    if not converted:
        return [
            Breach(
                "precision=fp8",
                "precision=fp8 promises float8 GEMMs, but no Linear was converted: the step ran "
                f"in {exp.matmul}",
            )
        ]
    breaches = []
    if eligible:
        breaches.append(
            Breach(
                "precision=fp8",
                f"precision=fp8 promises float8 for every eligible Linear, but {_names(eligible)} "
                "were not converted",
            )
        )
    if not any(dtype == "fp8" for _, dtype in gemm_flops):
        breaches.append(
            Breach("precision=fp8", "precision=fp8 promises float8 GEMMs, but none ran in fp8")
        )
    return breaches


def _weight_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    promise, breaches = exp.promise, []
    if promise.params == "fp32":
        low = [n for n, p in facts["params"].items() if p["dtype"] != "fp32"]
        if low:
            dtypes = sorted({facts["params"][n]["dtype"] for n in low})
            modules = sorted({n.rpartition(".")[0] for n in low})  # a weight's module
            breaches.append(
                Breach(
                    f"precision={exp.mode}",
                    f"precision={exp.mode} promises fp32 weights, but those of {_names(modules)} "
                    f"are {','.join(dtypes)}",
                )
            )
    if promise.masters == "fp32":
        for i, group in enumerate(facts["optimizer"]["groups"]):
            low_masters = {d: n for d, n in group["param_dtypes"].items() if d != "fp32"}
            if low_masters:
                held = ", ".join(f"{n} {d}" for d, n in low_masters.items())
                breaches.append(
                    Breach(
                        f"precision={exp.mode}",
                        f"precision={exp.mode} promises fp32 master weights, but the optimizer's "
                        f"param group {i} updates {held} tensors",
                    )
                )
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
    if not found:
        return []
    if wrong:
        held = ", ".join(f"{key} in {','.join(sorted(k))}" for key, k in wrong.items())
        return [
            Breach(
                "optim.state_dtype",
                f"optim.state_dtype={want} promises {want} optimizer state, but it holds {held}",
            )
        ]
    if want not in found:
        return [
            Breach(
                "optim.state_dtype",
                f"optim.state_dtype={want} promises {want} optimizer state, but every state "
                "tensor is fp32",
            )
        ]
    return []


def _step_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    promise, breaches = exp.promise, []
    loss = facts["loss"]["dtype"]
    if loss is not None and loss != promise.loss:
        breaches.append(
            Breach(
                "loss",
                f"precision={exp.mode} promises the loss in {promise.loss} at backward, but it "
                f"was {loss}",
            )
        )
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
            breaches.append(
                Breach("scaler", f"precision={exp.mode} promises a dynamic loss scaler, but {why}")
            )
    if scaler["enabled"] and scaler["unscaled_before_clip"] is False:
        breaches.append(
            Breach(
                "scaler",
                "the loss scaler promises unscaled gradients at clipping, but they were clipped "
                "before unscale_",
            )
        )
    if exp.ema is not None and facts["ema"] is not None and facts["ema"] != [exp.ema]:
        breaches.append(
            Breach(
                "trainer.ema",
                f"trainer.ema promises an {exp.ema} EMA, but it holds {','.join(facts['ema'])}",
            )
        )
    return breaches


def _fsdp_breaches(facts: dict[str, Any], exp: Expected) -> list[Breach]:
    if exp.fsdp is None:
        return []
    breaches = []
    for unit in facts.get("fsdp") or []:
        policy = {"param_dtype": unit["param_dtype"], "reduce_dtype": unit["reduce_dtype"]}
        lost = [
            f"{key}={policy[key]}" for key in policy if policy[key] not in (exp.fsdp[key], None)
        ]
        computed = [d for d in unit["computed_with"] if d != "fp32"]  # BatchNorm's stay fp32
        if exp.fsdp["param_dtype"] != "fp32" and computed != [exp.fsdp["param_dtype"]]:
            lost.append(f"computed with {','.join(unit['computed_with']) or 'nothing'}")
        if lost:
            breaches.append(
                Breach(
                    "fsdp",
                    f"fsdp promises param_dtype={exp.fsdp['param_dtype']}, reduce_dtype="
                    f"{exp.fsdp['reduce_dtype']} in every unit, but {unit['unit']} has "
                    f"{', '.join(lost)}",
                )
            )
    return breaches


def breaches(
    gemm_flops: dict[tuple[str, str], int], facts: dict[str, Any], exp: Expected
) -> list[Breach]:
    """Every promise the observed step broke, one Breach each."""
    fp8 = facts.get("fp8")
    return [
        *_fp8_breaches(gemm_flops, exp, fp8),
        *_gemm_breaches(gemm_flops, exp, fp8),
        *_weight_breaches(facts, exp),
        *_state_breaches(facts, exp),
        *_step_breaches(facts, exp),
        *_fsdp_breaches(facts, exp),
    ]
