"""Sharded (FSDP2) checkpoints through torch.distributed.checkpoint, on gloo ranks of this CPU.

The ranks shard timm's test_vit with fully_shard themselves, as trainer.strategy=fsdp does, and
save and restore through the run's Checkpointer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import settings
from helpers.distributed import as_rank, free_port
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from amp_lab.checkpoint import sharded
from amp_lab.checkpoint.store import Checkpointer
from amp_lab.components.distributed import DistContext
from amp_lab.config import ConfigError
from amp_lab.run import LoopState

SETTINGS = ["checkpoint.keep=1", "checkpoint.every_minutes=0"]


def _join(rank: int, world: int, port: int) -> DistContext:
    as_rank(rank, port, world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return DistContext(rank, rank, world)


def _parts(seed: int) -> dict:
    """A sharded test_vit (each block, then the root), its AdamW and LR schedule; `seed` sets the
    init."""
    torch.manual_seed(seed)
    model = timm.create_model("test_vit", pretrained=False, img_size=16, num_classes=10)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # counts steps
    return {"model": model, "optimizer": optimizer, "scheduler": schedule}


def _train_step(parts: dict, rank: int, step: int) -> float:
    gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
    x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    loss = torch.nn.functional.cross_entropy(parts["model"](x), y)
    loss.backward()
    parts["optimizer"].step()
    parts["optimizer"].zero_grad()
    parts["scheduler"].step()
    return loss.item()


def _full(parts: dict) -> tuple[dict, dict]:
    """Model and optimizer state gathered whole (a collective), on the CPU."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # a copy: AdamW's CPU `step` tensors would otherwise be the live ones
    return copy.deepcopy(get_state_dict(parts["model"], parts["optimizer"], options=opts))


def _two_ranks(rank: int, port: int, out: str) -> None:
    ctx, run_dir = _join(rank, 2, port), Path(out)
    cfg = settings(*SETTINGS)
    parts, state = _parts(seed=0), LoopState()
    saver = Checkpointer(cfg, run_dir, state, parts, ctx)
    if rank == 0:  # what a job killed while writing its shards leaves
        (run_dir / "checkpoints" / "step_000000099.dcp.tmp").mkdir(parents=True)
    for step in (1, 2):
        _train_step(parts, rank, step)
        state.step = step
        torch.manual_seed(10 * step + rank)  # each rank's RNG its own
        saver.save()
    drawn = torch.rand(3)  # what each rank draws next, restored by the resume
    saved = _full(parts)
    after = [_train_step(parts, rank, step) for step in (3, 4)]
    trained = _full(parts)

    listing = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    dist.barrier()  # every rank has listed before rank 0 adds a folder
    if rank == 0:  # a newer folder without DCP's metadata: a write that never completed
        (run_dir / "checkpoints" / "step_000000003.dcp").mkdir()
    dist.barrier()
    fresh, fresh_state = _parts(seed=1), LoopState()  # other weights, step 0
    loader = Checkpointer(cfg, run_dir, fresh_state, fresh, ctx)
    assert loader.restore() and fresh_state.step == 2
    schedule_steps = fresh["scheduler"].last_epoch
    with loader.active():
        redrawn = torch.rand(3)
    resumed = [_train_step(fresh, rank, step) for step in (3, 4)]
    result = {"after": after, "resumed": resumed, "drawn": drawn, "redrawn": redrawn}
    result["listing"] = listing
    result["schedule_steps"] = schedule_steps
    torch.save(result, run_dir / f"rank{rank}.pt")
    resumed_full = _full(fresh)
    if rank == 0:
        torch.save(
            {"saved": saved, "trained": trained, "resumed": resumed_full}, run_dir / "full.pt"
        )
    dist.destroy_process_group()


def _one_rank(rank: int, port: int, out: str) -> None:
    ctx, run_dir = _join(rank, 1, port), Path(out)
    parts, state = _parts(seed=2), LoopState()
    [path] = Checkpointer(settings(*SETTINGS), run_dir, state, parts, ctx).checkpoints()
    sharded.load(path, parts)  # DCP reshards the two ranks' slices onto this one
    torch.save(_full(parts), run_dir / "one_rank.pt")
    try:
        Checkpointer(settings(*SETTINGS), run_dir, LoopState(), _parts(seed=2), ctx).restore()
    except ConfigError as err:
        (run_dir / "refused.txt").write_text(str(err))
    dist.destroy_process_group()


def _equal_states(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    models = all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[0].keys() == b[0].keys()
    sa, sb = a[1]["state"], b[1]["state"]
    return models and all(
        torch.equal(torch.as_tensor(sa[p][k]), torch.as_tensor(sb[p][k])) for p in sa for k in sa[p]
    )


@pytest.mark.slow
def test_two_rank_sharded_checkpoint_is_atomic_rotated_and_resumes_exactly(tmp_path):
    mp.spawn(_two_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    # keep=1: the step-2 folder replaced step 1's; nothing half-written is left (the stale
    # temp folder of a killed job was removed before the first save)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert ranks[0]["listing"] == ["step_000000002.dcp"]
    # the incomplete step-3 folder was set aside and step 2 resumed
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000000002.dcp",
        "step_000000003.dcp.corrupt",
    ]
    folder = tmp_path / "checkpoints" / "step_000000002.dcp"
    assert {p.name for p in folder.iterdir()} == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "state.pt",
        "rng_rank0.pt",
        "rng_rank1.pt",
    }
    state = sharded.read_state(folder)  # loads with weights_only=True
    assert state["world_size"] == 2 and state["sharded"] == ["model", "optimizer"]
    assert set(state["parts"]) == {"scheduler"}  # the rest, as a single-process checkpoint
    for result in ranks:  # steps 3 and 4 after the resume: the losses of the first run
        assert result["resumed"] == result["after"] and result["schedule_steps"] == 2
        assert torch.equal(result["redrawn"], result["drawn"])  # each rank's own RNG back
    assert not torch.equal(ranks[0]["drawn"], ranks[1]["drawn"])
    full = torch.load(tmp_path / "full.pt")
    assert _equal_states(full["trained"], full["resumed"])  # weights and AdamW moments

    # the same checkpoint on one rank: DCP reshards model and optimizer state ...
    mp.spawn(_one_rank, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    assert _equal_states(torch.load(tmp_path / "one_rank.pt"), full["saved"])
    # ... and the runner refuses the resume: the global batch and each rank's data would change
    assert (
        (tmp_path / "refused.txt")
        .read_text()
        .startswith(f"checkpoint {folder} was written by 2 rank(s), this run has 1; resume it on 2")
    )


def test_a_folder_missing_a_ranks_shards_is_unusable(tmp_path):
    """So the resume takes the previous checkpoint instead of failing inside DCP's load."""
    folder = tmp_path / "step_000000004.dcp"
    folder.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        (folder / name).write_bytes(b"")
    torch.save({"world_size": 2, "parts": {}}, folder / "state.pt")
    with pytest.raises(ValueError, match=r"the shards of rank\(s\) \[1\] are missing"):
        sharded.read_state(folder)
    (folder / "__1_0.distcp").write_bytes(b"")
    assert sharded.read_state(folder)["world_size"] == 2
