"""Data-parallel training: the world from torchrun's or SLURM's environment, and DDP helpers.

A single process uses the same DistContext, whose collectives are then no-ops.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from amp_lab.config import ConfigError


def resolve_device(requested: str) -> torch.device:
    """auto picks CUDA when present; asking for CUDA without one is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu")
    return torch.device(requested)


def world_from_environment() -> dict[str, Any]:
    """rank, local_rank, world_size, master_addr and master_port, torchrun first, then SLURM."""
    env = os.environ
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    if not torchrun and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        from submitit.slurm.slurm import SlurmJobEnvironment  # expands SLURM's node list

        slurm = SlurmJobEnvironment()
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return {
            "rank": slurm.global_rank,
            "local_rank": slurm.local_rank,
            "world_size": slurm.num_tasks,
            "master_addr": slurm.hostnames[0],
            # one port per job, so two jobs sharing a node do not collide
            "master_port": int(env.get("MASTER_PORT", 20000 + job_id % 20000)),
        }
    given: Mapping[str, str] = env if torchrun else {}  # a single process: the defaults
    return {
        "rank": int(given.get("RANK", 0)),
        "local_rank": int(given.get("LOCAL_RANK", 0)),
        "world_size": int(given.get("WORLD_SIZE", 1)),
        "master_addr": given.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": int(given.get("MASTER_PORT", 29500)),
    }


@dataclass
class DistContext:
    """This process's place in the world; collectives are no-ops in a world of one."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    shards: bool = False  # strategy=fsdp: the model is sharded (components/fsdp.py), not wrapped

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def device(self, requested: str) -> str:
        """Each rank binds the GPU of its local rank."""
        if self.active and requested in ("auto", "cuda") and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return requested

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if not self.active or self.shards:  # an FSDP model synchronises its own gradients
            return model
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def micro_batch_context(
        self, model: torch.nn.Module
    ) -> Callable[[bool], contextlib.AbstractContextManager[Any]]:
        """DDP all-reduces (FSDP reduce-scatters) gradients only on the last micro-batch of an
        accumulation; FSDP accumulates the unsharded gradients in its reduce dtype until then."""
        if isinstance(model, FSDPModule):
            return functools.partial(_sync_fsdp_gradients, model)
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):  # what wrap() made
            return lambda is_last: contextlib.nullcontext()
        return lambda is_last: contextlib.nullcontext() if is_last else model.no_sync()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.active:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when it is true on any (a host sync: DDP runs only)."""
        if not self.active:
            return flag
        return bool(self.all_reduce(torch.tensor([float(flag)], device=device), op="max").item())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank (e.g. the run directory)."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def _sync_fsdp_gradients(
    model: FSDPModule, is_last: bool
) -> contextlib.AbstractContextManager[Any]:
    model.set_requires_gradient_sync(is_last)
    return contextlib.nullcontext()


_GROUPS_JOINED = itertools.count()  # by this process: the same count on every rank of a sweep


def setup(strategy: str, requested_device: str) -> DistContext:
    """Join the process group for strategy=ddp or fsdp (a world of one needs none)."""
    if strategy == "single":
        return DistContext()
    world = world_from_environment()
    ctx = DistContext(
        world["rank"], world["local_rank"], world["world_size"], shards=strategy == "fsdp"
    )
    if ctx.shards and not ctx.active:
        raise ConfigError(
            "trainer.strategy=fsdp needs a distributed launch: torchrun --nproc_per_node=N -m "
            "amp_lab ..., or SLURM tasks (hydra.launcher.tasks_per_node=N); one process: "
            "trainer.strategy=single"
        )
    if not ctx.active or dist.is_initialized():
        return ctx
    os.environ.setdefault("MASTER_ADDR", world["master_addr"])
    os.environ.setdefault("MASTER_PORT", str(world["master_port"]))
    cuda = resolve_device(requested_device).type == "cuda"  # the runner's one device check
    timeout = timedelta(minutes=30)
    store, _, _ = next(dist.rendezvous("env://", ctx.rank, ctx.world_size, timeout=timeout))
    # A sweep under torchrun joins one group per job, all through torchrun's store: each job's
    # keys under a prefix of their own, or the next group would read this one's addresses.
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"amp_lab/job{next(_GROUPS_JOINED)}", store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timeout,
    )
    return ctx
