"""Per-rank memory accounting from the tensors' sizes (the unsharded case; FSDP's shards are
measured against DDP in tests/components/test_fsdp.py)."""

from __future__ import annotations

import timm
import torch

from amp_lab.components.memory import grad_bytes, param_bytes


def test_parameter_and_gradient_bytes_of_a_timm_model():
    model = timm.create_model("test_vit", pretrained=False, img_size=16, num_classes=10)
    numel = sum(p.numel() for p in model.parameters())
    assert param_bytes(model) == 4 * numel  # fp32
    assert grad_bytes(model) == 0  # no gradient yet
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert grad_bytes(model) == 4 * numel
    model.half()
    assert param_bytes(model) == 2 * numel
