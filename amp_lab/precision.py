"""One table of precision modes and the policy object the training step uses.

The loop never branches on dtype: it asks the policy for an autocast context and gets a loss
scaler from scaling.py. Everything a mode means lives in the PRECISION_MODES table.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from amp_lab.config import ConfigError


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast, ops run in the weights' fp32
    dynamic_scaling: bool  # needs a dynamic loss scale (fp16's 5-bit exponent underflows)
    tf32: bool  # let fp32 matmuls/convolutions use TF32 tensor cores (CUDA, Ampere+)
    summary: str


PRECISION_MODES = {
    mode.name: mode
    for mode in [
        PrecisionMode("fp32", None, False, False, "fp32 everywhere, TF32 off: the true baseline"),
        PrecisionMode("tf32", None, False, True, "fp32 weights, TF32 matmuls and convolutions"),
        PrecisionMode("fp16", torch.float16, True, False,
                      "fp16 autocast with dynamic loss scaling"),
        PrecisionMode("fp16_noscale", torch.float16, False, False,
                      "fp16 autocast without loss scaling (small gradients underflow)"),
        PrecisionMode("bf16", torch.bfloat16, False, False,
                      "bf16 autocast (fp32's exponent range: no scaler needed)"),
    ]
}


def resolve_device(requested: str) -> torch.device:
    """auto picks CUDA when present; asking for CUDA without one is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu")
    return torch.device(requested)


def _check_device_runs(mode: PrecisionMode, device: torch.device) -> None:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if mode.tf32 and major < 8:
            raise ConfigError(f"precision={mode.name} needs an Ampere or newer GPU; "
                              "use fp32 or fp16")
        if mode.autocast_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(False):
            raise ConfigError("precision=bf16 needs an Ampere or newer GPU; use fp16 (with scaler)")
        return
    if mode.tf32:
        raise ConfigError(f"precision={mode.name} needs an NVIDIA GPU (TF32 is a tensor-core "
                          f"format); on {device.type} use fp32, bf16 or fp16")
    if mode.autocast_dtype is not None and not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"autocast is not available on {device.type}; use precision=fp32")


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: PrecisionMode
    device: torch.device

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to the mode's dtype, or a disabled one for fp32."""
        dtype = self.mode.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype or torch.bfloat16,
                              enabled=dtype is not None)

    def describe(self) -> dict:
        return {
            "name": self.mode.name,
            "autocast_dtype": str(self.mode.autocast_dtype).replace("torch.", "")
            if self.mode.autocast_dtype else None,
            "dynamic_scaling": self.mode.dynamic_scaling,
            "tf32": self.mode.tf32,
            "device": str(self.device),
        }


def _set_tf32(enabled: bool) -> None:
    # An fp32 baseline must really be fp32: TF32 keeps only 10 mantissa bits in matmuls.
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def resolve_precision(name: str, device: torch.device) -> PrecisionPolicy:
    """Look the mode up, check the device can run it and set the backend's TF32 switches."""
    if name not in PRECISION_MODES:
        raise ConfigError(f"precision={name!r} is unknown; use one of {sorted(PRECISION_MODES)}")
    mode = PRECISION_MODES[name]
    _check_device_runs(mode, device)
    _set_tf32(mode.tf32)
    return PrecisionPolicy(mode, device)
