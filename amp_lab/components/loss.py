"""The training loss a recipe asks for, from timm, always computed in fp32; evaluation stays
hard-label cross-entropy (loss_fn)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from amp_lab.config import DataConfig

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The loss runs in fp32: log-softmax over fp16 logits loses the small probabilities.
    return F.cross_entropy(logits.float(), labels)


def fp32_loss(loss: torch.nn.Module) -> LossFn:
    """A timm loss fed fp32 logits and soft targets (a target of 0.1/1000 classes is tiny)."""

    def forward(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.is_floating_point():
            target = target.float()
        return loss(logits.float(), target)

    return forward


def with_z_loss(loss: LossFn, z: float) -> LossFn:
    """A loss plus z * mean(logsumexp(logits)^2), in fp32: the penalty pulls the softmax's
    normaliser towards 1, so the logits cannot drift upwards together."""

    def forward(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_z = torch.logsumexp(logits.float(), dim=-1)
        return loss(logits, target) + z * log_z.square().mean()

    return forward


def build_loss(cfg: DataConfig) -> LossFn:
    """Soft-target (mixup/cutmix), label-smoothing or plain cross-entropy, plus any z-loss."""
    if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
        loss = fp32_loss(SoftTargetCrossEntropy())
    elif cfg.label_smoothing > 0:
        loss = fp32_loss(LabelSmoothingCrossEntropy(smoothing=cfg.label_smoothing))
    else:
        loss = loss_fn
    return with_z_loss(loss, cfg.z_loss) if cfg.z_loss > 0 else loss
