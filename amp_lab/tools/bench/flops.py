"""FLOPs of a training step (the audit's GEMM counter: matmuls, convolutions and attention, not
element-wise ops or the optimizer, as usual) and the device peaks that turn them into MFU: FLOPs
per step x steps per second / the device's dense peak for the matmul dtype."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from amp_lab.audit.gemm_flops import GemmFlops
from amp_lab.components.loss import loss_fn

TFLOPS = 1e12

# Dense peak TFLOP/s per device and compute dtype, from NVIDIA's datasheets (SXM parts unless the
# name says PCIe). The first pattern that matches torch.cuda.get_device_name() wins, so specific
# names come first; `\bL4\b` keeps the L40 out of the L4 row.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H200", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}),
    (r"H100.*PCIe", {"fp32": 51.2, "tf32": 378.0, "fp16": 756.5, "bf16": 756.5}),
    (r"H100", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0}),
]


def device_name(device: torch.device) -> str:
    """The GPU's marketing name, or the CPU's model name when there is no GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):  # Linux names the CPU model in /proc/cpuinfo
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if found:
            return found.group(1).strip()
    return "cpu"


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of this device for `dtype` (fp32 | tf32 | fp16 | bf16), or None."""
    if device.type != "cuda":
        return None  # no meaningful tensor-core peak on a CPU
    name = torch.cuda.get_device_name(device)
    peaks = next((peaks for pattern, peaks in PEAK_TFLOPS if re.search(pattern, name)), {})
    return peaks[dtype] * TFLOPS if dtype in peaks else None


def train_step_flops(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
) -> int:
    """FLOPs of one forward + backward pass on this batch, under the run's autocast (a pure
    16-bit model cannot take fp32 images without it); the gradients are cleared after."""
    counter = GemmFlops(model)
    with counter.tracking_modules(), counter:
        with autocast or contextlib.nullcontext():
            logits = model(images)
        loss_fn(logits, labels).backward()
    model.zero_grad(set_to_none=True)
    return sum(counter.flops.values())


def mfu(flops_per_step: int, step_s: float, peak: float | None) -> float | None:
    """Achieved FLOP/s over the peak, or None without a peak."""
    if peak is None or step_s <= 0:
        return None
    return flops_per_step / step_s / peak
