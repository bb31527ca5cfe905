"""Per-rank memory accounting: the bytes of the model's parameters, their gradients and the
optimizer's state that this rank holds, from the tensors' sizes (host metadata only: no device
sync). Under FSDP each counts the local shard, so the saving over DDP (about 1 / world size for
all three) reads straight off summary.json's `param_bytes`, `grad_bytes` and
`optimizer_state_bytes`."""

from __future__ import annotations

import torch

from amp_lab.precision.optimizer_state import tensor_bytes


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters on this rank (FSDP: its shards, fp32 masters)."""
    return sum(tensor_bytes(p) for p in model.parameters())


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients held now (after a step: the last step's, not yet zeroed)."""
    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
