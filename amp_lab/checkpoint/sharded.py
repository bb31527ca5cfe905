"""Sharded checkpoints for FSDP2 runs, written with torch.distributed.checkpoint (DCP).

`<run dir>/checkpoints/step_NNNNNNNNN.dcp/` holds DCP's files (the model, the optimizer and any
other part whose state holds DTensors, every rank writing its shards), `state.pt` (rank 0: the
other parts, as a single-process checkpoint holds them, and the world size) and each rank's
`rng_rank<R>.pt`. All ranks write into `step_N.dcp.tmp/`, which rank 0 renames into place once
every file is complete (docs/fsdp.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

STATE_FILE = "state.pt"  # rank 0's non-sharded parts
METADATA_FILE = ".metadata"  # written by DCP once every rank's shards are complete
MODEL_PARTS = ("model", "optimizer")  # saved through get_state_dict / set_state_dict


def is_sharded(model: torch.nn.Module) -> bool:
    """True when the model's parameters are DTensor shards (fully_shard applied)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def sharded_parts(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of the parts held as shards: model and optimizer, and DTensor holders."""
    model_sd, optim_sd = get_state_dict(parts["model"], parts["optimizer"])
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    for name, part in parts.items():
        if name in MODEL_PARTS:
            continue
        part_sd = part.state_dict()
        if any(isinstance(leaf, DTensor) for leaf in tree_leaves(part_sd)):
            state[name] = part_sd
    return state


def save(
    path: Path,
    shards: dict[str, Any],
    rank_payload: Mapping[str, Any],
    main_payload: Mapping[str, Any] | None,
) -> None:
    """Every rank: write the sharded checkpoint `path` (a folder), atomically; `main_payload` is
    rank 0's (None on the others)."""
    tmp = path.with_name(path.name + ".tmp")
    main = main_payload is not None
    if main:
        for stale in path.parent.glob("*.dcp.tmp"):  # left by a job killed mid-write
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    _barrier()  # the folder exists, and no rank writes into a stale one
    dcp.save(shards, storage_writer=dcp.FileSystemWriter(tmp))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(dict(rank_payload), tmp / rng_file(rank))
    if main_payload is not None:
        torch.save(dict(main_payload), tmp / STATE_FILE)
    _barrier()  # every rank's files are complete
    if main:
        os.replace(tmp, path)  # atomic for a folder whose name is not taken
    _barrier()  # no rank trains on (or stops) before the checkpoint is in place


def read_state(path: Path) -> dict[str, Any]:
    """state.pt of a sharded checkpoint; ValueError if DCP's metadata or a rank's shards are
    missing (so the previous checkpoint is used)."""
    if not (path / METADATA_FILE).is_file():
        raise ValueError("no DCP metadata (an incomplete sharded checkpoint)")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    missing = [r for r in range(state["world_size"]) if not (path / f"__{r}_0.distcp").is_file()]
    if missing:
        raise ValueError(f"the shards of rank(s) {missing} are missing")
    return state


def read_rng(path: Path, rank: int) -> dict[str, Any] | None:
    """This rank's RNG states, or None when the checkpoint has none for it."""
    file = path / rng_file(rank)
    return torch.load(file, weights_only=True) if file.is_file() else None


def load(path: Path, parts: Mapping[str, Any]) -> None:
    """Every rank: load the sharded parts of `path` into the (sharded) model, optimizer, ..."""
    state = sharded_parts(parts)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(
        parts["model"],
        parts["optimizer"],
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    for name, part_sd in state.items():
        if name not in MODEL_PARTS:
            parts[name].load_state_dict(part_sd)


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a sharded folder."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
