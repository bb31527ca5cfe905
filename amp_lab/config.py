"""Typed schemas for every config group, registered in Hydra's ConfigStore, plus start-up checks.

Each dataclass mirrors one folder of conf/. Hydra merges the YAML files into these schemas, so a
typo (`scaler.init_scal=1`) or a wrong type (`scaler.init_scale=abc`) fails before anything runs.
Choice fields are Enums, so an unknown value (`precision.name=fp17`) fails at compose too.
Cross-field checks live in `__post_init__`; they run once, in `validate()`, at start-up. Which
settings may change when a run resumes is field metadata (FREE_ON_RESUME) beside each field.
The schema holds every default; the YAML files under conf/ hold only what differs from it.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import Field, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from amp_lab.choices import (
    AuditMode,
    ClipMode,
    CompileMode,
    DatasetName,
    Decode,
    Device,
    DiagnosticsMode,
    EraseMode,
    Fp8Recipe,
    FsdpDtype,
    Interpolation,
    LoggerMode,
    LRRule,
    MixupMode,
    PitfallName,
    PrecisionName,
    ScalerKind,
    Schedule,
    Strategy,
    UpdateRounding,
    WarmupType,
)

CONF_DIR = Path(__file__).resolve().parent / "conf"  # shipped inside the package


class ConfigError(ValueError):
    """A bad setting, reported to the user as one line that says what to do."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


_BOUNDS: dict[str, Callable[[Any], bool]] = {  # the words of the message -> the test
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "> 0": lambda v: v > 0,
    "finite and > 0": lambda v: 0 < v < math.inf,
    "finite and > 1": lambda v: 1 < v < math.inf,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "between 0 and 1": lambda v: 0 < v < 1,
}


def _bound(section: Any, group: str, bound: str, *keys: str, hint: str = "") -> None:
    """Each key's value holds `bound` (a key of _BOUNDS), else `group.key=value must be ...`;
    None (an optional key left unset) holds every bound."""
    for key in keys:
        value = getattr(section, key)
        ok = value is None or _BOUNDS[bound](value)
        _require(ok, f"{group}.{key}={value} must be {bound}{hint}")


# Field metadata: this setting (or, on a group, the whole group) may differ between an
# interrupted run and its resume; none so marked changes the weights, the optimizer, the scaler,
# the LR schedule or the data order. Every other setting must match the checkpoint's.
FREE_ON_RESUME = {"free_on_resume": True}


@dataclass
class ModelConfig:
    """The timm model: any name `timm.create_model` knows (presets in conf/model/). Channels,
    classes and image size follow the data; weights are never downloaded."""

    name: str = "test_convnext"  # any timm model name; weights are never downloaded
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments
    channels_last: bool = False  # NHWC memory format: faster convolutions under AMP on GPUs
    drop_path_rate: float = 0.0  # stochastic depth: timm's drop_path_rate (0: the model's own)
    drop_rate: float = 0.0  # dropout before the classifier: timm's drop_rate (0: the model's own)

    def __post_init__(self) -> None:
        _bound(self, "model", "in [0, 1)", "drop_path_rate", "drop_rate")


@dataclass
class DataConfig:
    """The data set, its transforms and its loader: `digits` (scikit-learn's, shipped with it),
    `synthetic` (random tensors on the device), `cifar10`, `cifar100`, `imagefolder` (local
    files under `root`, never downloaded); timm's training transforms and mixup."""

    name: DatasetName = DatasetName.digits  # the data set (the group's options set the rest)
    # local data root (cifar10/cifar100/imagefolder)
    root: str | None = field(default=None, metadata=FREE_ON_RESUME)
    img_size: int = 32  # images are resized to img_size x img_size
    val_fraction: float = 0.2  # share held out for validation when the data has no val split
    # image data sets: timm's training transform (random-resized crop, flip, colour jitter and
    # the keys below); false: the evaluation transform (resize, centre crop) for training too
    augment: bool = False
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # random-resized-crop area
    hflip: float = 0.5  # horizontal-flip probability
    color_jitter: float = 0.4  # colour-jitter strength (0: off; off when auto_augment is set)
    # timm policy string: `rand-m9-mstd0.5-inc1` (RandAugment), `augmix-m5-w4-d2`,
    # `trivialaugment`, `original` (AutoAugment); None: off
    auto_augment: str | None = None
    re_prob: float = 0.0  # random-erasing probability (after normalisation)
    re_mode: EraseMode = EraseMode.pixel  # random-erasing fill
    re_count: int = 1  # random-erasing boxes per image
    interpolation: Interpolation = Interpolation.model  # resize interpolation
    crop_pct: float | None = None  # evaluation: resize to img_size / crop_pct, centre-crop
    # (None: the model's pretrained config, else timm's 0.875)
    # normalisation; None: the model's pretrained config, else the data set's own statistics
    mean: list[float] | None = None
    std: list[float] | None = None  # as mean
    # timm.data.Mixup on every training batch (any data set, digits included); with mixup or
    # cutmix on, the targets are soft and the loss is soft-target cross-entropy in fp32
    mixup_alpha: float = 0.0  # Beta(alpha, alpha) blend of two images; 0: off
    cutmix_alpha: float = 0.0  # Beta(alpha, alpha) box pasted from another image; 0: off
    mixup_prob: float = 1.0  # share of batches mixed at all
    mixup_switch_prob: float = 0.5  # with both on: share of mixed batches that use cutmix
    mixup_mode: MixupMode = MixupMode.batch  # one blend per batch, per pair or per element
    label_smoothing: float = 0.0  # target smoothing (inside the soft targets when mixing)
    # z-loss: this x mean(logsumexp(logits)^2) added to the training loss, which keeps the
    # output logits from drifting (PaLM, Wortsman et al. 2023 use 1e-4); 0: off
    z_loss: float = 0.0
    num_classes: int = 10  # synthetic only: classes
    channels: int = 3  # synthetic only: input channels
    num_samples: int = 2048  # synthetic only: samples kept on the device
    num_workers: int = 0  # DataLoader workers for on-disk data sets
    # imagefolder: where JPEGs are decoded; device/gpu: the workers only read the files, the
    # batch is decoded (torchvision.io.decode_jpeg) and cropped, flipped, jittered, normalised on
    # the training device (gpu: CUDA only)
    decode: Decode = Decode.cpu
    persistent_workers: bool = True  # keep workers alive across epochs (when num_workers > 0)
    # batches each worker loads ahead (when num_workers > 0)
    prefetch_factor: int = field(default=2, metadata=FREE_ON_RESUME)
    # page-locked host memory for faster copies (CUDA only)
    pin_memory: bool = field(default=True, metadata=FREE_ON_RESUME)
    # (num_workers and persistent_workers must match on resume: the workers seed the augmentation)

    def __post_init__(self) -> None:
        _require(self.img_size >= 8, f"data.img_size={self.img_size} is too small; use >= 8")
        _bound(self, "data", "between 0 and 1", "val_fraction")
        _bound(self, "data", ">= 0", "num_workers", "z_loss")
        _bound(self, "data", ">= 0", "mixup_alpha", "cutmix_alpha", hint=" (0: off)")
        _bound(self, "data", "in [0, 1]", "mixup_prob", "mixup_switch_prob", "hflip", "re_prob")
        _bound(self, "data", "in [0, 1)", "label_smoothing")
        _require(
            len(self.scale) == 2 and 0.0 < self.scale[0] <= self.scale[1] <= 1.0,
            f"data.scale={self.scale} must be [min, max] area shares, 0 < min <= max <= 1",
        )
        for key in ("mean", "std"):
            _require(
                getattr(self, key) is None or len(getattr(self, key)) == 3,
                f"data.{key}={getattr(self, key)} must hold 3 channel values (or null)",
            )
        _bound(self, "data", "in (0, 1]", "crop_pct", hint=" (or null: the model's)")
        # the keys only image files have (an empty policy string is off, as in timm)
        image_keys = [f"data.{k}" for k in ("auto_augment", "re_prob") if getattr(self, k)]
        if image_keys and self.name in ("digits", "synthetic"):
            raise ConfigError(
                f"{image_keys[0]} needs image files (cifar10, cifar100, imagefolder); "
                f"data={self.name} keeps its tensor path (mixup and label smoothing work there)"
            )
        # the device path decodes imagefolder's JPEGs only, without PIL policies or erasing
        unsupported = ([f"data={self.name}"] if self.name != "imagefolder" else []) + image_keys
        if self.decode != Decode.cpu and unsupported:
            raise ConfigError(
                f"data.decode={self.decode} decodes data=imagefolder's JPEGs with crop, flip "
                f"and colour jitter only, not {unsupported[0]}; use data.decode=cpu for it"
            )


@dataclass
class PrecisionConfig:
    """The precision mode (one row of amp_lab/precision/modes.py) and its options."""

    name: PrecisionName = PrecisionName.fp32  # the mode (docs/precision.md)
    # module-name patterns (fnmatch: `*norm*`, `head`, `*.attn`) run with autocast off, fp32 inputs
    fp32_modules: list[str] = field(default_factory=list)
    # bf16_pure/fp16_pure: the optimizer steps fp32 master copies of the 16-bit weights (apex O2)
    master_weights: bool = True
    # bf16_pure without master weights: how the fp32 update is written back into the bf16 weights
    update_rounding: UpdateRounding = UpdateRounding.nearest
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise  # fp8: the torchao recipe
    fp8_emulate: bool = False  # fp8: torchao's emulated float8 matmuls (any device; slow)


@dataclass
class ScalerConfig:
    """The loss scaler: torch's GradScaler (`dynamic`), a fixed scale (`static`) or DeepSpeed's
    `hysteresis`; on exactly when the precision mode needs it, unless `enabled` says otherwise."""

    init_scale: float = 65536.0  # 2**16; 32768 is gentler on early overflows
    growth_factor: float = 2.0  # scale *= growth_factor after growth_interval clean steps
    backoff_factor: float = 0.5  # scale *= backoff_factor on every overflow (skipped step)
    growth_interval: int = 2000  # clean steps before the scale grows; 5000 is more conservative
    enabled: bool | None = None  # None: dynamic loss scaling exactly when the precision needs it
    # dynamic: torch GradScaler | static: fixed at init_scale | hysteresis: Megatron/DeepSpeed
    kind: ScalerKind = ScalerKind.dynamic
    hysteresis: int = 2  # hysteresis: back off only on this many consecutive overflows
    min_scale: float = 1.0  # hysteresis: floor; a backoff due at the floor stops the run
    max_scale: float = 2.0**24  # hysteresis: growth stops here

    def __post_init__(self) -> None:
        # an infinite scale makes every scaled gradient inf: every step would be skipped
        scales = ("init_scale", "min_scale", "max_scale")
        _bound(self, "scaler", "finite and > 0", *scales, hint=" (e.g. 65536 = 2**16)")
        _bound(self, "scaler", ">= 1", "hysteresis", "growth_interval")
        _require(
            self.min_scale <= self.max_scale,
            f"scaler.min_scale={self.min_scale} must be <= scaler.max_scale={self.max_scale}",
        )
        _require(
            self.kind != "hysteresis" or self.min_scale <= self.init_scale <= self.max_scale,
            f"scaler.init_scale={self.init_scale} must lie between scaler.min_scale="
            f"{self.min_scale} and scaler.max_scale={self.max_scale}",
        )
        _bound(self, "scaler", "finite and > 1", "growth_factor")
        _bound(self, "scaler", "between 0 and 1", "backoff_factor")


@dataclass
class LRConfig:
    """The learning rate: its base, the batch-size rule, warmup and schedule (the schedule steps
    once per optimizer step)."""

    base: float = 1e-3  # learning rate at ref_batch, before scaling
    rule: LRRule = LRRule.none  # batch-size scaling (sqrt suits Adam-like optimizers)
    ref_batch: int = 256  # the global batch that `base` was tuned for
    scale: float = 1.0  # extra multiplier; 0.5-0.8 is the usual start when moving fp32 -> fp16
    warmup_steps: int = 0  # optimizer steps of warmup (wins over warmup_epochs when > 0)
    warmup_epochs: float = 0.0  # warmup length in epochs
    warmup_type: WarmupType = WarmupType.linear  # the LR's rise from warmup_init to the peak
    warmup_init: float = 0.0  # LR at step 0, as a fraction of the peak LR
    schedule: Schedule = Schedule.cosine  # after warmup
    min_factor: float = 0.0  # cosine/onecycle end at min_factor x peak
    step_every: int = 0  # step schedule: steps between decays (0: a third of the run)
    step_gamma: float = 0.1  # step schedule: decay factor

    def __post_init__(self) -> None:
        _bound(self, "lr", "> 0", "base", "scale")
        _bound(self, "lr", ">= 1", "ref_batch")
        _bound(self, "lr", ">= 0", "warmup_steps", "warmup_epochs")
        _bound(self, "lr", "in [0, 1]", "warmup_init", "min_factor")
        _bound(self, "lr", "in (0, 1]", "step_gamma")
        _bound(self, "lr", ">= 0", "step_every", hint=" (0: a third of the run)")


@dataclass
class OptimConfig:
    """The optimizer (timm's factory), its weight decay and the dtype of its state."""

    name: str = "adamw"  # adamw | sgd | any timm.optim.create_optimizer_v2 name
    weight_decay: float = 0.05  # decoupled for adamw; never applied to norms and biases
    momentum: float = 0.9  # sgd-like optimizers
    nesterov: bool = False  # sgd only
    fused: bool | None = None  # None: fused kernels when the optimizer has them
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra optimizer arguments
    # dtype the optimizer keeps its moments in: fp32 | bf16 | fp16 (reproduces the second-moment
    # cliff) | int8 | int4 | fp8 (torchao's block-quantised low-bit family); arithmetic is fp32
    state_dtype: str = "fp32"
    state_rounding: str = "nearest"  # bf16 moments: nearest | stochastic (unbiased) rounding
    block_size: int | None = None  # int8/int4/fp8: values per scale; None: torchao's (256/128)

    def __post_init__(self) -> None:
        _bound(self, "optim", ">= 0", "weight_decay")
        _require(
            self.state_dtype in STATE_DTYPES,
            f"optim.state_dtype={self.state_dtype!r} is unknown; use one of {STATE_DTYPES}",
        )
        _require(
            self.state_dtype == "fp32" or self.name in STATE_OPTIMIZERS,
            f"optim.state_dtype={self.state_dtype} exists for {STATE_OPTIMIZERS} only, not "
            f"optim.name={self.name}; use optim.state_dtype=fp32",
        )
        _require(
            self.state_rounding in ("nearest", "stochastic"),
            f"optim.state_rounding={self.state_rounding!r} is unknown; use nearest or stochastic",
        )
        _require(
            self.state_rounding == "nearest" or self.state_dtype == "bf16",
            f"optim.state_rounding=stochastic exists for optim.state_dtype=bf16 only, not "
            f"{self.state_dtype}",
        )
        _require(
            self.block_size is None or self.state_dtype in ("int8", "int4", "fp8"),
            f"optim.block_size applies to state_dtype int8, int4 or fp8, not "
            f"{self.state_dtype}; drop it",
        )
        _bound(self, "optim", ">= 1", "block_size")
        _require(
            self.state_dtype == "fp32" or not self.fused,
            f"optim.fused=true has no kernel for optim.state_dtype={self.state_dtype}; use "
            "optim.fused=null",
        )


STATE_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4", "fp8")
STATE_OPTIMIZERS = ("adamw", "adam")  # torchao.optim has these two in every low-bit dtype


@dataclass
class EmaConfig:
    """A model EMA (timm's ModelEmaV3), evaluated beside the model."""

    # timm's ModelEmaV3: ema = decay * ema + (1 - decay) * weights, every `every` optimizer
    # steps, evaluated beside the model (val/acc_ema); 0: no EMA
    decay: float = 0.0
    every: int = 1  # optimizer steps between EMA updates
    # The EMA is kept in fp32 whatever the weights' dtype: with decay 0.9999 each update moves
    # it by 1e-4 of (weights - ema), far below half a bf16 ulp of the weight, so a bf16 EMA
    # rounds every update away and stops moving. false reproduces that trap on purpose.
    fp32: bool = True

    def __post_init__(self) -> None:
        _bound(self, "trainer.ema", "in [0, 1)", "decay", hint=", e.g. 0.9999 (0: no EMA)")
        _bound(self, "trainer.ema", ">= 1", "every")


@dataclass
class TrainerConfig:
    """The run itself: device, seed, length, batch and accumulation, clipping, logging, evaluation,
    compilation, resume, parallel strategy and CPU threads."""

    # auto: CUDA when there is a GPU; cuda without one is a start-up error
    device: Device = field(default=Device.auto, metadata=FREE_ON_RESUME)
    seed: int = 0  # model init, data split and shuffling all follow it
    epochs: int = 10  # passes over the training data (unless max_steps)
    max_steps: int = 0  # optimizer steps; wins over epochs when > 0
    batch_size: int = 64  # per micro-batch; the global batch is batch_size x grad_accum
    grad_accum: int = 1  # micro-batches per optimizer step
    clip_grad: float = 0.0  # 0 disables clipping
    clip_mode: ClipMode = ClipMode.norm  # clip the total gradient norm, or each value
    log_every: int = 10  # optimizer steps between train logs (the only steps that sync)
    # optimizer steps between evaluations; 0: at the end of each epoch
    eval_every: int = field(default=0, metadata=FREE_ON_RESUME)
    # torch.compile: off | model (or true): the model's forward and backward | step: the model
    # and the optimizer step (docs/benchmarks.md). A string here so that the old true/false
    # still parse; the start-up check turns it into a CompileMode.
    compile: str = field(default="off", metadata=FREE_ON_RESUME)
    # torch.compile's backend: inductor generates kernels (a C++ compiler on CPU); aot_eager
    # traces the same graphs without generating code (quick; tests, debugging)
    compile_backend: str = field(default="inductor", metadata=FREE_ON_RESUME)
    # val accuracy for time-to-accuracy
    target_acc: float = field(default=0.9, metadata=FREE_ON_RESUME)
    # first steps left out of throughput (allocator, autotuning, compile)
    timing_warmup: int = field(default=3, metadata=FREE_ON_RESUME)
    progress: bool = field(default=True, metadata=FREE_ON_RESUME)  # rich progress bar (a tty)
    # continue from the run dir's newest good checkpoint; false: start fresh
    resume: bool = field(default=True, metadata=FREE_ON_RESUME)
    # ddp: DistributedDataParallel; fsdp: FSDP2 sharding (the fsdp group); world from torchrun/SLURM
    strategy: Strategy = Strategy.single
    # torch CPU threads; 0: $OMP_NUM_THREADS if set, else the CPUs this job was given
    # (SLURM_CPUS_PER_TASK, the CPU affinity mask) less the DataLoader workers
    threads: int = field(default=0, metadata=FREE_ON_RESUME)
    ema: EmaConfig = field(default_factory=EmaConfig)  # a model EMA (off by default)

    def __post_init__(self) -> None:
        _bound(self, "trainer", "> 0", "batch_size")
        _bound(self, "trainer", ">= 1", "grad_accum", "log_every")
        _bound(self, "trainer", ">= 0", "max_steps", hint=" (0: trainer.epochs decides)")
        _require(
            self.epochs >= 1 or self.max_steps >= 1,
            "set trainer.epochs or trainer.max_steps to at least 1",
        )
        _bound(self, "trainer", "in [0, 1]", "target_acc")
        _bound(self, "trainer", ">= 0", "clip_grad", "eval_every")
        _bound(self, "trainer", ">= 0", "threads", hint=" (0: auto)")
        # a str field reads YAML's true/false as "True"/"False": the old spellings of model/off
        text = str(self.compile).lower()
        text = {"true": "model", "false": "off"}.get(text, text)
        _require(
            text in CompileMode.__members__,
            f"trainer.compile={self.compile} is not one of off, model, step (or true, false)",
        )
        self.compile = CompileMode(text)


@dataclass
class FsdpConfig:
    """trainer.strategy=fsdp: FSDP2 (`fully_shard`) and its MixedPrecisionPolicy."""

    # module-name patterns (fnmatch: `blocks.*`, `stages.*`) each sharded as one unit, the root
    # last; empty: each of timm's transformer `blocks` or ConvNeXt/ResNet-style `stages`
    wrap: list[str] = field(default_factory=list)
    # free each unit's gathered parameters after its forward (all-gather again for backward):
    # less memory, one more all-gather per unit
    reshard_after_forward: bool = True
    # dtype the sharded fp32 parameters are all-gathered in for compute; auto: the mode's
    # autocast dtype (bf16 for bf16, fp16 for fp16), fp32 otherwise (docs/fsdp.md)
    param_dtype: FsdpDtype = FsdpDtype.auto
    # dtype of the gradient reduce-scatter; auto: fp32 (bf16 reduction destabilises large
    # worlds: pytorch issue 106395)
    reduce_dtype: FsdpDtype = FsdpDtype.auto


@dataclass
class LoggerConfig:
    """Weights & Biases: offline by default, never fatal and never a prompt (docs/tracking.md)."""

    mode: LoggerMode = LoggerMode.offline  # WANDB_MODE wins unless this is disabled
    project: str = "amp_lab"  # W&B project
    entity: str | None = None  # W&B team or user; None: the account's default entity
    group: str | None = None  # None: a sweep's own group (its folder's names and an id)
    tags: list[str] = field(default_factory=list)  # extra W&B tags (model and precision are added)


@dataclass
class CheckpointConfig:
    """Checkpoints: atomic files, resumed automatically; a stop signal checkpoints and stops."""

    enabled: bool = True  # write checkpoints: periodic ones and one on a stop signal
    every_steps: int = 0  # optimizer steps between periodic checkpoints; 0: off
    every_minutes: float = 10.0  # wall-clock minutes between periodic checkpoints; 0: off
    keep: int = 2  # newest checkpoints kept; an older one goes only once a newer one is complete
    # signals that ask the run to stop (submitit's pre-timeout/preemption signal, the USR1 of
    # `#SBATCH --signal=USR1@90`, SLURM's TERM, Ctrl-C): checkpoint at the next step boundary,
    # then hand the signal on to the previous handler
    signals: list[str] = field(default_factory=lambda: ["SIGUSR2", "SIGUSR1", "SIGTERM", "SIGINT"])

    def __post_init__(self) -> None:
        _bound(self, "checkpoint", ">= 0", "every_steps", "every_minutes")
        _bound(self, "checkpoint", ">= 1", "keep")
        for name in self.signals:
            _require(
                name in signal.Signals.__members__,
                f"checkpoint.signals: {name!r} is not a signal name; use e.g. SIGUSR2",
            )
            _require(
                name not in ("SIGKILL", "SIGSTOP"),
                f"checkpoint.signals: {name} cannot be caught; use e.g. SIGUSR2 or SIGTERM",
            )


@dataclass
class DiagnosticsConfig:
    """Numerics telemetry (docs/diagnostics.md): probes of fp16 headroom, gradient underflow and
    optimizer state, and non-finite attribution."""

    # light: probes every `every` steps, no per-step sync; full: hooks on every step (the exact
    # first non-finite module); off: only the run's counters and health
    mode: DiagnosticsMode = DiagnosticsMode.light
    # optimizer steps between headroom/underflow probes; 0: every log step. A probe step costs
    # about 1.8x a plain step (test_convnext on a CPU: hooks, a weight copy), so 100 keeps light
    # mode's overhead under 1%
    every: int = 100
    top_layers: int = 5  # layers named per probe (least fp16 headroom, most underflow)

    def __post_init__(self) -> None:
        _bound(self, "diagnostics", ">= 0", "every")


@dataclass
class HealthConfig:
    """The one judge's thresholds (amp_lab/health/): every verdict about a run, and about a run
    against its reference, is decided against these and nothing else (docs/diagnostics.md
    justifies each default)."""

    # -- one run: summary.json `health`, the console, the report's health, the doctor's probes
    skip_rate: float = 0.2  # unstable: more than this share of all steps skipped (and >= 2)
    # a skip burst: more than this share of the last `window` steps skipped, after the run's
    # first clean step (the scale settling from a high init_scale is not a burst)
    window_skip_rate: float = 0.5
    zero_grad_share: float = 0.5  # underflow: this share of gradient elements exactly zero
    rise: float = 0.25  # loss rises: the last steps' mean > (1 + this) x the first's
    min_drop: float = 0.01  # loss stalls: fell by less than this share of its start...
    min_steps: int = 100  # ...in a run of at least this many steps (short runs are noisy)
    min_scale: float = 1.0  # scale collapse: a dynamic loss scale below this
    window: int = 10  # steps (whole log windows) in the first and the final window
    # consecutive skipped steps (non-finite gradients: a scale at inf, a forward non-finite at
    # any scale) after which the run can no longer train: it stops, diverged
    max_bad_steps: int = 50
    # diverged, too: the mean of `window` steps fell more than `rise` below its start, then the
    # last `window` steps' mean gave back this share of that fall (a run that learned lost it)
    give_back: float = 0.5
    # -- early warnings: every step's figures, judged at each log step (docs/diagnostics.md)
    # a step's loss this many times the mean of the `window` steps before it
    loss_spike: float = 3.0
    grad_spike: float = 10.0  # a step's gradient norm this many times the mean before it
    # attention logits growing: a block's bound on q.k/sqrt(d), scale x max|q| x max|k| over its
    # tokens and heads, this high (every step; e^-50: a softmax one-hot in every float format);
    # of 20, 30, 40, 50, 100 and 200 the highest that warned >= 10 steps ahead of 80% of the
    # lead-time bench's seed-0 grid divergences (benchmarks/results/lead_time.md)
    attn_logit: float = 50.0
    # -- early warnings judged at probe steps (diagnostics.every)
    # outlier features: a block's output feature kurtosis this high (1: every feature alike)
    kurtosis: float = 20.0
    adam_rms: float = 5.0  # second moment lags: a weight matrix's RMS of g^2/v-hat this high
    erased_share: float = 0.5  # updates rounded away: this share of 16-bit updates left at 0
    # -- a run against its reference: the report's verdicts, the doctor's probes against fp32
    acc_pp: float = 1.0  # accuracy matches within this many percentage points
    loss_rel: float = 0.02  # final val loss matches within this share of the reference's
    # a difference is a finding only when this two-sided paired t-interval over the seeds
    # excludes zero (and it passes the threshold); it "matches" when the interval lies within
    # the threshold; else it is inconclusive
    confidence: float = 0.95
    speed_band: float = 0.05  # speed-ups within this band are "the same speed" (timer noise)
    memory_band: float = 0.05  # memory within this band is "the same memory"
    # the doctor: a probe deviates when its mean relative distance to fp32's loss passes this
    deviation: float = 0.15
    # the doctor: a probe stalls when its loss fell by less than this share of the baseline's
    # fall, where the fp32 baseline fell by more than base_drop over the same steps
    stall_share: float = 0.4
    base_drop: float = 0.04  # see stall_share

    def __post_init__(self) -> None:
        shares = ("zero_grad_share", "min_drop", "skip_rate", "window_skip_rate", "erased_share")
        _bound(self, "health", "in (0, 1]", *shares, "give_back")
        relative = ("rise", "acc_pp", "loss_rel", "deviation", "stall_share", "base_drop")
        _bound(self, "health", "finite and > 0", *relative, "attn_logit", "kurtosis", "adam_rms")
        _bound(self, "health", ">= 1", "min_steps", "window", "max_bad_steps")
        _bound(self, "health", "finite and > 1", "loss_spike", "grad_spike")
        _require(
            0.5 <= self.confidence < 1, f"health.confidence={self.confidence} must be in [0.5, 1)"
        )


@dataclass
class AuditConfig:
    """The precision audit (docs/precision.md): the first training step of each start (a
    resume included) is observed, and what it computed in is checked against the mode's
    promise; steps after it run without hooks."""

    # stop: a broken promise ends the run before it trains further, one line and exit code 2;
    # warn: a warning; off: no audit. A pitfall run breaks its promise on purpose: it warns.
    mode: AuditMode = AuditMode.stop


@dataclass
class ReportConfig:
    """How `amp_lab report` compares these runs where its command line does not say (a study's
    config sets them, so its sweep's report needs no options)."""

    by: str | None = None  # --by: the axis, e.g. optim.state_dtype (unset: precision)
    ref: str | None = None  # --ref: each group's reference on that axis


@dataclass
class PitfallConfig:
    """The pitfall lab: a classic AMP mistake reproduced on purpose (docs/diagnostics.md)."""

    # a classic AMP mistake reproduced on purpose (amp_lab/diagnostics/pitfalls.py)
    name: PitfallName = PitfallName.none


@dataclass
class FaultConfig:
    """Injected numerical faults for the pitfall lab (keys, no options)."""

    inf_grad_at_step: int = 0  # optimizer step (1-based) whose gradients get an inf; 0: never
    overflow_module: str | None = None  # module whose activations are multiplied by the factor
    overflow_factor: float = 1e6  # large enough that the module's fp16 output passes 65504
    loss_multiplier: float = 1.0  # < 1 shrinks the loss so fp16 gradients underflow
    # optimizer step (1-based) whose gradients are multiplied by grad_spike_factor; 0: never
    grad_spike_at_step: int = 0
    grad_spike_factor: float = 100.0  # a gradient spike Adam's second moment lags behind

    def __post_init__(self) -> None:
        _bound(self, "fault", ">= 0", "inf_grad_at_step", "grad_spike_at_step", hint=" (0: off)")
        _bound(self, "fault", "> 0", "overflow_factor", "loss_multiplier")


@dataclass
class AmpLabConfig:
    """Every group of a run's settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)  # trainer.strategy=fsdp only
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata=FREE_ON_RESUME)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=FREE_ON_RESUME)
    diagnostics: DiagnosticsConfig = field(
        default_factory=DiagnosticsConfig, metadata=FREE_ON_RESUME
    )
    health: HealthConfig = field(default_factory=HealthConfig, metadata=FREE_ON_RESUME)
    audit: AuditConfig = field(default_factory=AuditConfig, metadata=FREE_ON_RESUME)
    report: ReportConfig = field(default_factory=ReportConfig, metadata=FREE_ON_RESUME)
    pitfall: PitfallConfig = field(default_factory=PitfallConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)  # injected numerical faults
    tags: list[str] = field(default_factory=list)  # free-form labels copied into the summary


def register() -> None:
    """Put the schema in Hydra's ConfigStore; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name="amp_lab_schema", node=AmpLabConfig)


def schema_fields() -> Iterator[tuple[str, Field[Any]]]:
    """Every setting of the schema: (`group` or `group.key`, its dataclass field)."""
    schema = AmpLabConfig()
    for group in fields(schema):
        yield group.name, group
        section = getattr(schema, group.name)
        if is_dataclass(section):
            yield from ((f"{group.name}.{f.name}", f) for f in fields(section))


def free_on_resume() -> frozenset[str]:
    """The settings (`group`, or `group.key`) whose FREE_ON_RESUME metadata lets a resume change
    them."""
    return frozenset(key for key, f in schema_fields() if f.metadata.get("free_on_resume"))


def flat_settings(settings: AmpLabConfig | Mapping[str, Any]) -> dict[str, str]:
    """`group.key` -> JSON value (choices as plain strings): what a run records of its settings,
    in settings.json and in each checkpoint; also of a run's config read back as a dict."""
    groups = settings if isinstance(settings, Mapping) else asdict(settings)
    return {
        f"{group}.{key}": json.dumps(value, sort_keys=True)
        for group, values in groups.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def changed_settings(saved: Mapping[str, str], settings: AmpLabConfig) -> list[str]:
    """`key old -> new` for each setting that differs from a saved run's and is not free on
    resume; a key the saved run did not have (a setting added since) counts as unchanged."""
    free = free_on_resume()
    return [
        f"{k} {saved[k]} -> {v}"
        for k, v in flat_settings(settings).items()
        if saved.get(k, v) != v and k.split(".")[0] not in free and k not in free
    ]
