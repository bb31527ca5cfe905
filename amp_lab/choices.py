"""The values of the schema's choice fields, one Enum per field.

OmegaConf validates an Enum field at compose (`precision.name=fp17` fails there, naming the
choices). Every member is its own name as a string: `cfg.precision.name == "fp16"` holds, and
json, f-strings and W&B see the plain string.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A choice field's values; a member compares, hashes, formats and serialises as its string."""

    def __str__(self) -> str:
        return str(self.value)


class DatasetName(Choice):
    digits = "digits"
    synthetic = "synthetic"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    imagefolder = "imagefolder"


class Decode(Choice):  # where data=imagefolder's JPEG files are decoded and augmented
    cpu = "cpu"  # PIL and timm's transforms in the loader workers (the default)
    device = "device"  # workers read the bytes; one batched decode_jpeg on the training device
    gpu = "gpu"  # `device`, refused unless the training device is CUDA


class PrecisionName(Choice):  # one member per row of precision/modes.py's PRECISION_MODES
    fp32 = "fp32"
    tf32 = "tf32"
    fp16 = "fp16"
    fp16_noscale = "fp16_noscale"
    bf16 = "bf16"
    bf16_pure = "bf16_pure"
    fp16_pure = "fp16_pure"
    fp8 = "fp8"


class UpdateRounding(Choice):
    nearest = "nearest"
    stochastic = "stochastic"
    kahan = "kahan"


class Fp8Recipe(Choice):  # torchao's Float8LinearRecipeName values
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class ScalerKind(Choice):
    dynamic = "dynamic"
    static = "static"
    hysteresis = "hysteresis"


class LRRule(Choice):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class WarmupType(Choice):
    linear = "linear"
    cosine = "cosine"


class Schedule(Choice):
    cosine = "cosine"
    onecycle = "onecycle"
    constant = "constant"
    step = "step"


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ClipMode(Choice):
    norm = "norm"
    value = "value"


class CompileMode(Choice):
    """What `trainer.compile` compiles; true and false (the field's old values) mean model and
    off (TrainerConfig's start-up check turns the field into a CompileMode)."""

    off = "off"  # eager
    model = "model"  # torch.compile(model): its forward and the backward AOTAutograd derives
    step = "step"  # the model as above, and the optimizer step: torch.compile(optimizer.step)


class Strategy(Choice):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class FsdpDtype(Choice):  # fsdp.param_dtype / fsdp.reduce_dtype; auto: from the precision mode
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LoggerMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class DiagnosticsMode(Choice):
    off = "off"
    light = "light"
    full = "full"


class AuditMode(Choice):  # what a broken precision promise does (amp_lab/audit/)
    stop = "stop"  # one line naming the promise and the modules, exit code 2
    warn = "warn"  # a warning; the run trains on
    off = "off"  # no audit


class PitfallName(Choice):
    none = "none"
    no_scaler_update = "no_scaler_update"
    update_every_microbatch = "update_every_microbatch"
    clip_before_unscale = "clip_before_unscale"
    half_model = "half_model"
    loss_in_low_precision = "loss_in_low_precision"


class Interpolation(Choice):  # timm.data.create_transform's resize interpolation
    model = "model"  # the model's pretrained config (bilinear when it has none)
    bilinear = "bilinear"
    bicubic = "bicubic"
    nearest = "nearest"
    random = "random"


class MixupMode(Choice):  # timm.data.Mixup: one lambda per batch, per pair or per sample
    batch = "batch"
    pair = "pair"
    elem = "elem"


class EraseMode(Choice):  # timm.data.RandomErasing's fill
    pixel = "pixel"  # per-pixel normal noise (timm's train.py default, DeiT)
    const = "const"  # zeros
    rand = "rand"  # one normal value per channel
