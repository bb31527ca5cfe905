"""What the run's parts hold after its first step, read from the objects themselves: the weights
and their gradients, the optimizer's state and master weights, the scaler, the TF32 switches, the
fp8 layers, the FSDP units, the EMA and the compiled module. Plain JSON-able dicts, no judgement
(promises.py judges).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.amp import GradScaler

from amp_lab.audit.gemm_flops import tf32_switches
from amp_lab.precision.fp32_modules import within
from amp_lab.precision.master_weights import KAHAN_COMP
from amp_lab.precision.modes import dtype_name

# torchao.optim's block-quantised state tensors: their `dtype` is the one they dequantise to
LOW_BIT_STATE = {"OptimState8bit": "int8", "OptimState4bit": "int4", "OptimStateFp8": "fp8"}


def state_kind(value: torch.Tensor) -> str:
    """The dtype an optimizer-state tensor stores its values in."""
    return LOW_BIT_STATE.get(type(value).__name__, dtype_name(value.dtype))


def parameters(model: torch.nn.Module, grads: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per parameter: the storage dtype and the gradient dtype backward produced."""
    return {
        name: {"dtype": dtype_name(p.dtype), "grad": grads.get(name)}
        for name, p in model.named_parameters()
    }


def optimizer(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """Per param group: the weights' dtypes and each state key's dtypes; the fp32 masters."""
    own = {id(p) for p in model.parameters()}
    groups, masters = [], Counter[str]()
    for group in opt.param_groups:
        state: dict[str, Counter[str]] = {}
        for p in group["params"]:
            if id(p) not in own:
                masters[dtype_name(p.dtype)] += 1
            for key, value in opt.state.get(p, {}).items():
                # step counts are not moments; Kahan's compensation is bf16 by design
                if key in ("step", KAHAN_COMP) or not torch.is_tensor(value):
                    continue
                state.setdefault(key, Counter())[state_kind(value)] += 1
        groups.append(
            {
                "params": len(group["params"]),
                "param_dtypes": dict(Counter(dtype_name(p.dtype) for p in group["params"])),
                "state": {key: dict(kinds) for key, kinds in state.items()},
            }
        )
    return {
        "class": type(opt).__name__,
        "groups": groups,
        "master_weights": {"exist": bool(masters), "dtypes": dict(masters)},
    }


def scaler(scaler: GradScaler, scale: float | None, events: list[str]) -> dict[str, Any]:
    """The scaler's class, whether it is on, the scale the step used, and what it did to the loss
    and the gradients."""
    clipped = "clip" in events
    return {
        "class": type(scaler).__name__,
        "enabled": scaler.is_enabled(),
        "scale": scale,
        "scaled_loss": "scale" in events,
        "unscaled_before_clip": "unscale" in events[: events.index("clip")] if clipped else None,
    }


def tf32() -> dict[str, Any]:
    """The TF32 switches as the step ran with them."""
    return {**tf32_switches(), "float32_matmul_precision": torch.get_float32_matmul_precision()}


def fp8_layers(model: torch.nn.Module, fp32_modules: list[str]) -> dict[str, Any] | None:
    """The Linear layers fp8 converted (with their scaling) and those it left, with the filter's
    reason; None when torchao is absent or nothing is converted and fp8 was not asked."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return None
    from amp_lab.precision.fp8 import classifier, fp8_skip_reason

    head = classifier(model)
    converted, left, emulated = {}, {}, set()
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            cast = module.config.cast_config_input
            converted[name] = str(cast.scaling_granularity.value)
            emulated.add(bool(module.config.emulate))
        elif isinstance(module, torch.nn.Linear):
            reason = fp8_skip_reason(module, name, head, fp32_modules)
            left[name] = reason or "eligible, but not converted"
    return {
        "converted": converted,  # module -> scaling granularity (tensorwise | axiswise)
        "left": left,
        "emulated": emulated == {True} if emulated else None,
    }


def fsdp_units(model: torch.nn.Module, modules: dict[str, Any]) -> list[dict[str, Any]]:
    """Each FSDP2 unit: its MixedPrecisionPolicy, and the weights' dtype its modules computed
    with (the all-gathered parameters, as the forward saw them)."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        # FSDP2 has no public getter for a unit's policy
        policy = module._get_fsdp_state()._mp_policy
        inside = [
            seen.params for other, seen in modules.items() if seen.params and within(other, [name])
        ]
        units.append(
            {
                "unit": name or "(root)",
                "param_dtype": dtype_name(policy.param_dtype) if policy.param_dtype else None,
                "reduce_dtype": dtype_name(policy.reduce_dtype) if policy.reduce_dtype else None,
                "computed_with": sorted(set(",".join(inside).split(","))) if inside else [],
            }
        )
    return units


def ema(ema_module: torch.nn.Module | None) -> list[str] | None:
    """The dtypes the EMA's weights are kept in, or None without an EMA."""
    if ema_module is None:
        return None
    return sorted({dtype_name(p.dtype) for p in ema_module.parameters()})


def compiled(step_model: torch.nn.Module, mode: str, backend: str) -> dict[str, Any]:
    """trainer.compile as it runs: the step's module is torch.compile's wrapper or not."""
    is_compiled = isinstance(step_model, torch._dynamo.eval_frame.OptimizedModule)
    return {"mode": mode, "backend": backend if is_compiled else None, "compiled": is_compiled}
