"""Per-rank memory accounting from the tensors' sizes (host metadata only): the bytes of the
parameters, gradients and optimizer state this rank holds (under FSDP its shards)."""

from __future__ import annotations

import torch

from amp_lab.precision.optimizer_state import tensor_bytes


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters on this rank (FSDP: its shards, fp32 masters)."""
    return sum(tensor_bytes(p) for p in model.parameters())


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients held now (after a step: the last step's, not yet zeroed)."""
    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
