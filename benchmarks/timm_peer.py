"""timm's own `train.py` as a peer: amp_lab's settings as its arguments, and its log read back.

The arguments derive from the composed settings (model, batch, precision, optimizer, schedule,
augmentation, normalisation), so `--override` changes both programs. timm logs each update's rate
(`--log-interval 1`) from the end of the previous update to the end of this one, data loading
included: what amp_lab's throughput meter counts per step.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from amp_lab.choices import CompileMode
from amp_lab.components.augment import resolve_normalisation
from amp_lab.components.lr import peak_lr
from amp_lab.components.models import create_sized
from amp_lab.config import AmpLabConfig, ConfigError

# amp_lab precision mode -> timm train.py's autocast flags (it has no other modes)
AMP_FLAGS = {
    "fp32": [],
    "bf16": ["--amp", "--amp-dtype", "bfloat16"],
    "fp16": ["--amp", "--amp-dtype", "float16"],
}
# one logged update: its epoch, index, and the samples per second of that update alone
TRAIN_LINE = re.compile(r"Train: (\d+) \[\s*(\d+)/\d+ .*?Time: [\d.]+s,\s+([\d.]+)/s")


def _model_args(settings: AmpLabConfig) -> list[str]:
    model = settings.model
    kwargs, size = dict(model.kwargs), settings.data.img_size
    with torch.device("meta"):  # as build_model finds out, with no memory or time spent
        if create_sized(model.name, size, **kwargs)[1]:
            kwargs["img_size"] = size
    args = ["--model", model.name]
    if kwargs:
        args += ["--model-kwargs", *(f"{k}={v}" for k, v in kwargs.items())]
    if model.drop_path_rate > 0:
        args += ["--drop-path", str(model.drop_path_rate)]
    if model.drop_rate > 0:
        args += ["--drop", str(model.drop_rate)]
    return args + (["--channels-last"] if model.channels_last else [])


def _schedule_args(settings: AmpLabConfig) -> list[str]:
    lr, optim, trainer = settings.lr, settings.optim, settings.trainer
    if lr.warmup_steps or lr.warmup_epochs != int(lr.warmup_epochs) or lr.schedule != "cosine":
        raise ConfigError(
            "--parts peer maps a cosine schedule with whole warmup epochs to timm's train.py; "
            "use lr.schedule=cosine and an integer lr.warmup_epochs (lr.warmup_steps=0)"
        )
    peak = peak_lr(lr, trainer.batch_size * trainer.grad_accum)
    args = ["--opt", optim.name, "--lr", repr(peak), "--min-lr", repr(lr.min_factor * peak)]
    args += ["--weight-decay", str(optim.weight_decay), "--momentum", str(optim.momentum)]
    args += ["--sched", "cosine", "--sched-on-updates"]
    args += ["--warmup-epochs", str(int(lr.warmup_epochs))]
    args += ["--grad-accum-steps", str(trainer.grad_accum), "--seed", str(trainer.seed)]
    return args + (["--clip-grad", str(trainer.clip_grad)] if trainer.clip_grad > 0 else [])


def _data_args(settings: AmpLabConfig, data_dir: Path, device: torch.device) -> list[str]:
    data = settings.data
    norm = resolve_normalisation(data, settings.model.name)  # as amp_lab's imagefolder's
    args = ["--data-dir", str(data_dir), "--train-split", "train", "--val-split", "val"]
    args += ["--input-size", "3", str(data.img_size), str(data.img_size)]
    args += ["--mean", *map(str, norm.mean), "--std", *map(str, norm.std)]
    args += ["--crop-pct", str(norm.crop_pct), "--interpolation", norm.interpolation]
    args += ["--smoothing", str(data.label_smoothing), "-j", str(data.num_workers)]
    args += ["--mixup", str(data.mixup_alpha), "--cutmix", str(data.cutmix_alpha)]
    if not data.augment:
        args.append("--no-aug")
    else:
        args += ["--scale", *map(str, data.scale), "--hflip", str(data.hflip)]
        args += ["--color-jitter", str(data.color_jitter), "--reprob", str(data.re_prob)]
        args += ["--aa", data.auto_augment] if data.auto_augment else []
    # timm's prefetcher (normalisation on the GPU, pinned memory) is its fast CUDA path
    return args + (["--pin-mem"] if device.type == "cuda" else ["--no-prefetcher"])


def timm_args(
    settings: AmpLabConfig, data_dir: Path, num_classes: int, device: torch.device, output: Path
) -> list[str]:
    """timm train.py's arguments for the run amp_lab's `settings` describe."""
    precision = str(settings.precision.name)
    if precision not in AMP_FLAGS:
        raise ConfigError(
            f"--parts peer: timm's train.py has no precision={precision}; use one of "
            f"{list(AMP_FLAGS)}"
        )
    t = settings.trainer
    # timm compiles the model only (forward and its backward), which is amp_lab's compile=model;
    # compile=step also compiles the optimizer step, which timm cannot, and is refused
    if t.compile == CompileMode.step:
        raise ConfigError(
            "--parts peer: timm's train.py compiles the model only; use trainer.compile=model "
            "(or off) to compare like with like"
        )
    args = [*_model_args(settings), "--num-classes", str(num_classes), "-b", str(t.batch_size)]
    args += ["--epochs", str(t.epochs), *AMP_FLAGS[precision], "--device", device.type]
    args += _schedule_args(settings) + _data_args(settings, data_dir, device)
    if t.compile == CompileMode.model:
        args += [f"--torchcompile={t.compile_backend}"]
    return args + ["--log-interval", "1", "--output", str(output)]


def timm_rate(log: str, warmup: int) -> tuple[float, int]:
    """(samples/s over the logged updates after the first `warmup`, how many were counted).
    Each update's time is batch / its rate, so the whole rate is their harmonic mean."""
    rates = [float(m.group(3)) for m in TRAIN_LINE.finditer(log)]
    counted = rates[warmup:]
    if not rates:
        raise ConfigError(
            "the peer's log has no 'Train: E [i/N] ... Time: Xs, R/s' line; is --peer-script "
            "timm's train.py?"
        )
    if not counted or min(counted) <= 0:
        raise ConfigError(
            f"the peer logged {len(rates)} updates, none after the {warmup} warm-up ones; raise "
            "trainer.epochs or the data set's size"
        )
    return len(counted) / sum(1 / r for r in counted), len(counted)
