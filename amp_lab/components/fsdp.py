"""FSDP2 for trainer.strategy=fsdp: `fully_shard` under a mixed-precision policy derived from the
precision mode (docs/fsdp.md has the table).

The sharded parameters stay fp32 (the masters), gathered in `param_dtype`, gradients reduced in
`reduce_dtype`; autocast stays on, so the ops it keeps in fp32 still get fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.precision.modes import PRECISION_MODES, dtype_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_UNITS = ("blocks", "stages")  # timm: ViT/DeiT/Swin blocks, ConvNeXt/ResNet-style stages


@dataclass(frozen=True)
class FsdpPlan:
    """The resolved policy: what the shards are gathered in and reduced in."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def describe(self) -> dict[str, object]:
        return {
            "param_dtype": dtype_name(self.param_dtype),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "reshard_after_forward": self.reshard_after_forward,
        }


def resolve_plan(settings: AmpLabConfig) -> FsdpPlan:
    """The policy `fsdp.*` and the precision mode ask for; ConfigError for what makes no sense."""
    name, cfg = str(settings.precision.name), settings.fsdp
    mode = PRECISION_MODES[name]
    if mode.fp8:
        raise ConfigError(
            "precision=fp8 under trainer.strategy=fsdp: amp_lab has no float8 all-gather; use "
            "precision=bf16 (or trainer.strategy=ddp for fp8)"
        )
    if mode.param_dtype != torch.float32:
        raise ConfigError(
            f"precision={name} under trainer.strategy=fsdp: FSDP keeps fp32 sharded masters and "
            "gathers them in fsdp.param_dtype; use precision=bf16 or fp16 (16-bit compute is "
            "their default fsdp.param_dtype)"
        )
    compute = mode.autocast_dtype or torch.float32
    param = compute if cfg.param_dtype == "auto" else DTYPES[str(cfg.param_dtype)]
    if param not in (torch.float32, compute):
        raise ConfigError(
            f"fsdp.param_dtype={cfg.param_dtype} under precision={name}, which computes in "
            f"{dtype_name(compute)}; use fsdp.param_dtype={dtype_name(compute)} or fp32 (or pick "
            "the precision mode of that dtype)"
        )
    reduce = torch.float32 if cfg.reduce_dtype == "auto" else DTYPES[str(cfg.reduce_dtype)]
    if reduce == torch.float16 and not mode.dynamic_scaling:
        raise ConfigError(
            f"fsdp.reduce_dtype=fp16 under precision={name}: unscaled gradients at or below "
            "3e-8 flush to zero in fp16; use fsdp.reduce_dtype=fp32 or bf16, or precision=fp16"
        )
    if param != torch.float32 and settings.precision.fp32_modules:
        raise ConfigError(
            f"precision.fp32_modules under fsdp.param_dtype={dtype_name(param)}: those modules' "
            "weights would be gathered in 16 bits; set fsdp.param_dtype=fp32"
        )
    if settings.trainer.ema.decay > 0:
        raise ConfigError(
            "trainer.ema under trainer.strategy=fsdp: the EMA would copy the sharded model; "
            "set trainer.ema.decay=0 (or use trainer.strategy=ddp)"
        )
    return FsdpPlan(param, reduce, cfg.reshard_after_forward)


def wrap_units(model: torch.nn.Module, patterns: list[str]) -> list[torch.nn.Module]:
    """The modules sharded before the root: the default units, or those the patterns match."""
    named = [(n, m) for n, m in model.named_modules() if n]  # the root is sharded last anyway
    if not patterns:
        units = [
            unit
            for attr in DEFAULT_UNITS
            if isinstance(group := getattr(model, attr, None), torch.nn.Module)
            for unit in group.children()
        ]
        if not units:
            raise ConfigError(
                f"{type(model).__name__} has no `blocks` or `stages` to shard; name its "
                "modules with fsdp.wrap=[PATTERN,...] (fnmatch, e.g. 'layers.*')"
            )
        return units
    for pattern in patterns:
        if not any(fnmatchcase(n, pattern) for n, _ in named):
            sample = ", ".join(n for n, _ in named if "." not in n)
            raise ConfigError(
                f"fsdp.wrap pattern {pattern!r} matches no module of the model; its top-level "
                f"modules: {sample} (e.g. fsdp.wrap=['blocks.*'])"
            )
    return [m for n, m in named if any(fnmatchcase(n, p) for p in patterns)]


def shard_model(model: torch.nn.Module, patterns: list[str], plan: FsdpPlan) -> None:
    """fully_shard each unit, innermost first, then the root, in place: before the optimizer."""
    for unit in [*reversed(wrap_units(model, patterns)), model]:  # named_modules: parents first
        fully_shard(unit, mp_policy=plan.policy(), reshard_after_forward=plan.reshard_after_forward)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (a norm over sharded gradients) reduced across the shards."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_group(tensors: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group the tensors are sharded over (FSDP parameters), or None."""
    sharded = next((t for t in tensors if isinstance(t, DTensor)), None)
    return None if sharded is None else sharded.device_mesh.get_group()


def square_norms(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each tensor's squared L2 norm (squares add over shards; norms do not)."""
    return torch.stack(torch._foreach_norm(tensors)).square()


def sum_over_shards(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-shard sums (counts, squared norms) made totals, in place; as it is unsharded."""
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor
