"""The training loss a recipe asks for, from timm, always computed in fp32.

Mixup/CutMix on: soft targets, timm's SoftTargetCrossEntropy (the smoothing is inside the
targets). Label smoothing alone: timm's LabelSmoothingCrossEntropy on hard labels. Neither: plain
cross-entropy. Evaluation stays hard-label cross-entropy (amp_lab.step.loss_fn).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from amp_lab.config import DataConfig
from amp_lab.step import loss_fn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Fp32Loss(torch.nn.Module):
    """A timm loss fed fp32 logits (and fp32 soft targets): log-softmax over fp16/bf16 logits
    loses the small probabilities, and a soft target of 0.1/1000 classes is itself tiny."""

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.is_floating_point():
            target = target.float()
        return self.loss(logits.float(), target)


def build_loss(cfg: DataConfig) -> LossFn:
    """The recipe's training loss: soft-target, label-smoothing or plain cross-entropy."""
    if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
        return Fp32Loss(SoftTargetCrossEntropy())
    if cfg.label_smoothing > 0:
        return Fp32Loss(LabelSmoothingCrossEntropy(smoothing=cfg.label_smoothing))
    return loss_fn
