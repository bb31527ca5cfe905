"""One table of precision modes and the policy object the training step uses.

The loop never branches on dtype: everything a mode means is its PRECISION_MODES row, and what a
run of it promises (`PrecisionPolicy.promise()`, checked by amp_lab/audit/) is read from there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from amp_lab.choices import PrecisionName
from amp_lab.config import ConfigError, PrecisionConfig

DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The lab's short name of a dtype: fp32, fp16, bf16, fp8 (else torch's own, e.g. int64)."""
    return DTYPE_NAMES.get(dtype, _torch_name(dtype))


def _torch_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype, without the module: bfloat16, float32."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Promise:
    """What a run of a mode promises about every step; amp_lab/audit/ checks its first step."""

    compute: str  # the GEMMs' dtype outside precision.fp32_modules: fp32 | tf32 | fp16 | bf16 | fp8
    params: str  # the model's weights as stored (BatchNorm's stay fp32 in the pure modes)
    masters: str  # the weights the optimizer updates: fp32, or the 16-bit weights themselves
    state: str  # the optimizer's moments: optim.state_dtype
    loss: str  # the loss backward starts from
    scaler: bool  # a dynamic loss scaler scales the loss before backward

    def describe(self) -> dict[str, str | bool]:
        return asdict(self)


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast, ops run in the weights' fp32
    dynamic_scaling: bool  # needs a dynamic loss scale (fp16's 5-bit exponent underflows)
    tf32: bool  # let fp32 matmuls/convolutions use TF32 tensor cores (CUDA, Ampere+)
    summary: str
    param_dtype: torch.dtype = torch.float32  # the model's weights (pure modes: 16-bit)
    fp8: bool = False  # Linear layers run float8 matmuls (torchao), see precision/fp8.py
    reports_mfu: bool = True  # False: no MFU, the peak FLOP/s of mixed fp8/bf16 is ill-defined

    @property
    def matmul_dtype(self) -> str:
        """The dtype autocast or the TF32 switch runs matmuls in: fp32 | tf32 | fp16 | bf16."""
        if self.autocast_dtype is not None:
            return dtype_name(self.autocast_dtype)
        return "tf32" if self.tf32 else "fp32"


PRECISION_MODES = {
    mode.name: mode
    for mode in [
        PrecisionMode("fp32", None, False, False, "fp32 everywhere, TF32 off: the true baseline"),
        PrecisionMode("tf32", None, False, True, "fp32 weights, TF32 matmuls and convolutions"),
        PrecisionMode(
            "fp16", torch.float16, True, False, "fp16 autocast with dynamic loss scaling"
        ),
        PrecisionMode(
            "fp16_noscale",
            torch.float16,
            False,
            False,
            "fp16 autocast without loss scaling (small gradients underflow)",
        ),
        PrecisionMode(
            "bf16",
            torch.bfloat16,
            False,
            False,
            "bf16 autocast (fp32's exponent range: no scaler needed)",
        ),
        PrecisionMode(
            "bf16_pure",
            torch.bfloat16,
            False,
            False,
            "bf16 weights; fp32 master copy in the optimizer, or rounded updates",
            param_dtype=torch.bfloat16,
        ),
        PrecisionMode(
            "fp16_pure",
            torch.float16,
            True,
            False,
            "fp16 weights, fp32 master copy in the optimizer, dynamic loss scaling (apex O2)",
            param_dtype=torch.float16,
        ),
        PrecisionMode(
            "fp8",
            torch.bfloat16,
            False,
            False,
            "float8 Linear matmuls (torchao) on top of bf16 autocast",
            fp8=True,
            reports_mfu=False,
        ),
    ]
}


def _check_device_runs(mode: PrecisionMode, device: torch.device) -> None:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if mode.tf32 and major < 8:
            raise ConfigError(
                f"precision={mode.name} needs an Ampere or newer GPU; use fp32 or fp16"
            )
        if mode.autocast_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(False):
            raise ConfigError(
                f"precision={mode.name} needs an Ampere or newer GPU; use fp16 (with scaler)"
            )
        return
    if mode.tf32:
        raise ConfigError(
            f"precision={mode.name} needs an NVIDIA GPU (TF32 is a tensor-core "
            f"format); on {device.type} use fp32, bf16 or fp16"
        )
    if mode.autocast_dtype is not None and not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"autocast is not available on {device.type}; use precision=fp32")


def _check_options(mode: PrecisionMode, options: PrecisionConfig, device: torch.device) -> None:
    if mode.param_dtype == torch.float16 and not options.master_weights:
        raise ConfigError(
            "precision=fp16_pure needs precision.master_weights=true (fp16 updates "
            "round away); use bf16_pure for training without master weights"
        )
    if mode.param_dtype != torch.float32 and options.fp32_modules:
        raise ConfigError(
            f"precision.fp32_modules keeps modules in fp32 over fp32 weights, but "
            f"precision={mode.name} stores every weight in 16 bits; use "
            f"{'bf16' if mode.param_dtype == torch.bfloat16 else 'fp16'} with "
            "precision.fp32_modules"
        )
    if (
        mode.param_dtype != torch.float32
        and options.master_weights
        and options.update_rounding != "nearest"
    ):
        raise ConfigError(
            f"precision.update_rounding={options.update_rounding} applies to the "
            "16-bit weights themselves; set precision.master_weights=false"
        )
    if mode.fp8:
        from amp_lab.precision.fp8 import check_fp8_device  # lazy: torchao is an optional extra

        check_fp8_device(device, options.fp8_emulate)


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: PrecisionMode
    device: torch.device
    options: PrecisionConfig = field(default_factory=PrecisionConfig, compare=False)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to the mode's dtype, or a disabled one for fp32."""
        dtype = self.mode.autocast_dtype
        return torch.autocast(
            self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None
        )

    def describe(self) -> dict:
        """The mode, the device, where the weights live and how they are updated."""
        mode, opt = self.mode, self.options
        info: dict = {
            "name": mode.name,
            "autocast_dtype": _torch_name(mode.autocast_dtype) if mode.autocast_dtype else None,
            "dynamic_scaling": mode.dynamic_scaling,
            "tf32": mode.tf32,
            "device": str(self.device),
            "param_dtype": _torch_name(mode.param_dtype),
            "reports_mfu": mode.reports_mfu,
        }
        if mode.param_dtype != torch.float32:
            info["master_weights"] = opt.master_weights
            info["update_rounding"] = "nearest" if opt.master_weights else opt.update_rounding
        if mode.fp8:
            info["fp8_recipe"], info["fp8_emulate"] = opt.fp8_recipe, opt.fp8_emulate
        return info

    def promise(self, state_dtype: str, dynamic_scaling: bool) -> Promise:
        """What this mode promises, given the run's state dtype and resolved dynamic scaling."""
        mode = self.mode
        low_weights = mode.param_dtype != torch.float32
        return Promise(
            compute="fp8" if mode.fp8 else mode.matmul_dtype,
            params=dtype_name(mode.param_dtype),
            # no masters: the optimizer updates the 16-bit weights (rounded from an fp32 step)
            masters=dtype_name(mode.param_dtype)
            if low_weights and not self.options.master_weights
            else "fp32",
            state=state_dtype,
            loss="fp32",  # components/loss.py: 16-bit log-softmax loses small probabilities
            scaler=dynamic_scaling,
        )

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> Callable[[], None]:
        """The mode's weights for the built model and optimizer; returns the before-unscale hook."""
        if self.mode.fp8:
            from amp_lab.precision.fp8 import convert_to_fp8  # lazy: torchao is an optional extra
            from amp_lab.precision.fp32_modules import matching_modules

            opt = self.options
            kept = matching_modules(model, opt.fp32_modules)
            convert_to_fp8(model, opt.fp8_recipe, opt.fp8_emulate, kept)
        dtype = self.mode.param_dtype
        if dtype == torch.float32:
            return lambda: None
        from amp_lab.precision.master_weights import MasterWeights, RoundedUpdates

        if self.options.master_weights:
            return MasterWeights(model, optimizer, dtype).copy_grads_in
        RoundedUpdates(model, optimizer, dtype, self.options.update_rounding)
        return lambda: None


def _set_tf32(enabled: bool) -> None:
    # An fp32 baseline must really be fp32: TF32 keeps only 10 mantissa bits in matmuls.
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    # set at import by torch.backends.cudnn, but absent from its type stubs
    torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]


def resolve_precision(
    name: str, device: torch.device, options: PrecisionConfig | None = None
) -> PrecisionPolicy:
    """Look the mode up, check the device can run it and set the backend's TF32 switches."""
    mode = PRECISION_MODES[name]
    options = options or PrecisionConfig(name=PrecisionName(name))
    _check_device_runs(mode, device)
    _check_options(mode, options, device)
    _set_tf32(mode.tf32)
    return PrecisionPolicy(mode, device, options)
