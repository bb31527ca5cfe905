"""A training recipe's data side, from timm: `create_transform` for files, `Mixup` for batches.

Normalisation, interpolation and the evaluation crop come from the model's pretrained config
when the settings leave them open, as a DeiT or ConvNeXt recipe runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import timm
import torch
from PIL import Image
from timm.data import Mixup, auto_augment, constants, create_transform
from torchvision import transforms as T

from amp_lab.config import ConfigError, DataConfig


def _posterize(img: Image.Image, bits_to_keep: int, **kwargs: object) -> Image.Image:
    """timm's posterize, keeping 0 bits as a black image as Pillow < 13 did: Pillow 13 refuses
    0, which RandAugment's `inc1` posterize reaches at magnitude 10 (m9 + mstd0.5 noise)."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # every bit masked away: zeros
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


# AugmentOp looks its function up here when a policy is built
for _name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
    auto_augment.NAME_TO_OP[_name] = _posterize


@dataclass(frozen=True)
class Normalisation:
    """Where each image's statistics, interpolation and evaluation crop come from."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str
    crop_pct: float


def resolve_normalisation(
    cfg: DataConfig,
    model_name: str | None,
    data_mean: Sequence[float] = constants.IMAGENET_DEFAULT_MEAN,
    data_std: Sequence[float] = constants.IMAGENET_DEFAULT_STD,
) -> Normalisation:
    """The settings' values first, then the model's pretrained config, then the data set's
    (ImageNet's unless given; timm's 0.875 evaluation crop)."""
    pretrained = timm.models.get_pretrained_cfg(model_name) if model_name else None
    mean = cfg.mean or getattr(pretrained, "mean", None) or data_mean
    std = cfg.std or getattr(pretrained, "std", None) or data_std
    interpolation = str(cfg.interpolation)
    if interpolation == "model":
        interpolation = getattr(pretrained, "interpolation", None) or "bilinear"
    crop_pct = cfg.crop_pct or getattr(pretrained, "crop_pct", None) or constants.DEFAULT_CROP_PCT
    return Normalisation(tuple(mean), tuple(std), interpolation, crop_pct)


def build_transforms(cfg: DataConfig, norm: Normalisation) -> tuple[T.Compose, T.Compose]:
    """(train, eval) transforms from timm's create_transform; an unparsed policy: ConfigError."""
    transform = functools.partial(
        create_transform,
        (3, cfg.img_size, cfg.img_size),
        mean=norm.mean,
        std=norm.std,
        interpolation=norm.interpolation,
    )
    evaluation = transform(is_training=False, crop_pct=norm.crop_pct)
    if not cfg.augment:
        return evaluation, evaluation
    try:
        train = transform(
            is_training=True,
            scale=(cfg.scale[0], cfg.scale[1]),
            hflip=cfg.hflip,
            color_jitter=cfg.color_jitter,
            auto_augment=cfg.auto_augment,
            re_prob=cfg.re_prob,
            re_mode=str(cfg.re_mode),
            re_count=cfg.re_count,
        )
    except (AssertionError, KeyError, ValueError, IndexError) as err:  # timm's policy parser
        raise ConfigError(
            f"data.auto_augment={cfg.auto_augment!r} is not a timm policy ({err or 'unparsed'}); "
            "use e.g. rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, trivialaugment or original"
        ) from err
    return train, evaluation


def build_mixup(cfg: DataConfig, num_classes: int, batch_size: int) -> Mixup | None:
    """timm's Mixup/CutMix (soft targets, label smoothing folded in) when either alpha is on."""
    if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
        return None
    if batch_size % 2:  # timm pairs each sample with its mirror in the batch
        raise ConfigError(
            f"data.mixup_alpha/cutmix_alpha need an even trainer.batch_size, not {batch_size}"
        )
    return Mixup(
        mixup_alpha=cfg.mixup_alpha,
        cutmix_alpha=cfg.cutmix_alpha,
        prob=cfg.mixup_prob,
        switch_prob=cfg.mixup_switch_prob,
        mode=str(cfg.mixup_mode),
        label_smoothing=cfg.label_smoothing,
        num_classes=num_classes,
    )


def mix_batches(
    mixup: Mixup | None, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each micro-batch blended before autocast, with soft fp32 targets; as is without mixup."""
    if mixup is None:
        return batches
    return [mixup(images, labels) for images, labels in batches]
