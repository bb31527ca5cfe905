"""trainer.strategy=fsdp: the precision mode -> MixedPrecisionPolicy mapping, the refusals, the
wrap units (fast), and FSDP2 on two gloo ranks against DDP (slow)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import timm
import torch
import torch.multiprocessing as mp
from helpers import settings
from helpers.distributed import as_rank, free_port, torchrun

from amp_lab.build import build
from amp_lab.components.fsdp import resolve_plan, wrap_units
from amp_lab.config import ConfigError
from amp_lab.trainer import Trainer

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "precision, param, reduce",
    [("fp32", F32, F32), ("bf16", BF16, F32), ("fp16", F16, F32), ("fp16_noscale", F16, F32)],
)
def test_auto_policy_follows_the_precision_mode_with_fp32_reduction(precision, param, reduce):
    plan = resolve_plan(settings(f"precision={precision}", "trainer.strategy=fsdp"))
    assert (plan.param_dtype, plan.reduce_dtype) == (param, reduce)
    policy = plan.policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)
    assert plan.reshard_after_forward


def test_explicit_dtypes_win_over_the_mode():
    plan = resolve_plan(
        settings(
            "precision=bf16",
            "fsdp.param_dtype=fp32",
            "fsdp.reduce_dtype=bf16",
            "fsdp.reshard_after_forward=false",
        )
    )
    assert (plan.param_dtype, plan.reduce_dtype) == (F32, BF16)
    assert plan.describe() == {
        "param_dtype": "fp32",
        "reduce_dtype": "bf16",
        "reshard_after_forward": False,
    }
    # fp16 reduction is allowed where the gradients are loss-scaled
    assert resolve_plan(settings("precision=fp16", "fsdp.reduce_dtype=fp16")).reduce_dtype == F16


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["precision=bf16_pure"], "precision=bf16_pure under trainer.strategy=fsdp"),
        (["precision=fp16_pure"], "use precision=bf16 or fp16"),
        (["precision=fp8", "precision.fp8_emulate=true"], "precision=fp8 under"),
        (["precision=fp32", "fsdp.param_dtype=bf16"], "which computes in fp32"),
        (["precision=bf16", "fsdp.param_dtype=fp16"], "use fsdp.param_dtype=bf16 or fp32"),
        (["precision=bf16", "fsdp.reduce_dtype=fp16"], "unscaled gradients at or below 3e-8 flush"),
        (["precision=bf16", "precision.fp32_modules=[head]"], "set fsdp.param_dtype=fp32"),
        (["trainer.ema.decay=0.99"], "set trainer.ema.decay=0"),
    ],
)
def test_combinations_that_make_no_sense_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        resolve_plan(settings("trainer.strategy=fsdp", *overrides))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_fp32_modules_are_fine_when_gathered_in_fp32():
    plan = resolve_plan(
        settings("precision=bf16", "precision.fp32_modules=[head]", "fsdp.param_dtype=fp32")
    )
    assert plan.param_dtype == F32


def test_default_units_are_timms_blocks_and_stages():
    vit = timm.create_model("test_vit", pretrained=False, img_size=16, num_classes=10)
    assert wrap_units(vit, []) == list(vit.blocks)
    convnext = timm.create_model("test_convnext", pretrained=False, num_classes=10)
    assert wrap_units(convnext, []) == list(convnext.stages)


def test_wrap_patterns_name_modules_and_an_unknown_one_is_refused():
    vit = timm.create_model("test_vit", pretrained=False, img_size=16, num_classes=10)
    units = wrap_units(vit, ["blocks.*.mlp", "head"])
    assert units == [*(b.mlp for b in vit.blocks), vit.head]
    with pytest.raises(ConfigError, match=r"fsdp.wrap pattern 'layers\.\*' matches no module"):
        wrap_units(vit, ["blocks.*", "layers.*"])
    with pytest.raises(ConfigError, match="has no `blocks` or `stages`"):
        wrap_units(torch.nn.Sequential(torch.nn.Linear(2, 2)), [])


def test_fsdp_without_a_distributed_launch_is_refused(monkeypatch, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp needs a distributed launch"):
        Trainer(build(settings("trainer.strategy=fsdp"), tmp_path))
    assert not any(tmp_path.iterdir())  # nothing written


# 20 optimizer steps of test_vit on 16 px digits, 8 images per rank, every step logged
RUN = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=8",
    "trainer.max_steps=20",
    "trainer.log_every=1",
    "trainer.timing_warmup=1",
    "trainer.progress=false",
    "trainer.device=cpu",
    "logger.mode=disabled",
    "diagnostics.every=5",
    "checkpoint.enabled=false",
]


def _torchrun_sweep(tmp_path: Path, parallels: list[str], *overrides: str) -> dict[str, Path]:
    """One torchrun launch whose ranks run a job per conf/parallel preset (as the fsdp_precision
    study runs), each in its own process group: the run folder per preset."""
    sweep = f"+parallel={','.join(parallels)}"
    folders = ["hydra.sweep.dir=sweep", "hydra.sweep.subdir=${hydra.job.num}"]  # short names
    result = torchrun("-m", sweep, *RUN, *overrides, *folders, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: tmp_path / "sweep" / str(i) for i, name in enumerate(parallels)}


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _column(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_fsdp_fp32_matches_ddp_fp32_step_by_step_on_a_sharded_memory_budget(tmp_path):
    """Losses, clipped gradient norms and probes over the shards equal DDP's; rank 0 alone
    writes; each rank holds about half the parameters, gradients and optimizer state."""
    runs = _torchrun_sweep(tmp_path, ["ddp", "fsdp"], "trainer.clip_grad=0.5")
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    ddp_rows, fsdp_rows = _train_rows(ddp), _train_rows(fsdp)
    assert [r["step"] for r in fsdp_rows] == list(range(1, 21))  # one row per step: rank 0 only
    assert _column(fsdp_rows, "train/loss") == pytest.approx(
        _column(ddp_rows, "train/loss"), rel=1e-5
    )
    for key in ("train/grad_norm", "diag/applied_grad_norm", "diag/update_ratio"):
        assert len(_column(fsdp_rows, key)) >= 4, key
        assert _column(fsdp_rows, key) == pytest.approx(_column(ddp_rows, key), rel=1e-4), key
    assert _column(fsdp_rows, "diag/applied_grad_norm")[0] == pytest.approx(0.5, rel=1e-3)
    # counted over the shards and summed: the shares of the whole model's gradients, within a
    # dozen of its 253k values (a last-bit difference moves a value across zero or 2^-14)
    for key in ("diag/grad_zero_share", "diag/grad_subnormal_share", "diag/v_zero_share"):
        assert len(_column(fsdp_rows, key)) >= 4, key
        assert _column(fsdp_rows, key) == pytest.approx(_column(ddp_rows, key), abs=5e-5), key
    probes = (fsdp / "diagnostics.jsonl").read_text().splitlines()
    assert [json.loads(p)["step"] for p in probes] == list(range(1, 21))
    s_ddp, s_fsdp = (json.loads((d / "summary.json").read_text()) for d in (ddp, fsdp))
    assert s_fsdp["fsdp"] == {
        "param_dtype": "fp32",
        "reduce_dtype": "fp32",
        "reshard_after_forward": True,
    }
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
        # each rank keeps its shard: half of DDP's full copy, give or take dim-0 padding
        assert s_fsdp[key] == pytest.approx(s_ddp[key] / 2, rel=0.02), key
    assert s_ddp["param_bytes"] == s_ddp["params"] * 4 == s_ddp["grad_bytes"]
    assert s_ddp["optimizer_state_bytes"] == 2 * s_ddp["param_bytes"]  # AdamW's two moments


# per scaler kind: its overrides, and the scale each step ends with when rank 1's second step
# has an inf
INF_SCALERS = {
    "dynamic": ([], [1024.0, 512.0, 512.0, 512.0]),  # torch's GradScaler backs off on it
    "hysteresis": (["scaler.kind=hysteresis"], [1024.0] * 4),  # hysteresis=2: one keeps the scale
    "static": (["scaler.kind=static"], [1024.0] * 4),  # fixed at init_scale
}


# the lab's mistake under FSDP: clipping the scaled gradient shards
PITFALL = [
    "trainer.strategy=fsdp",
    "precision=fp16",
    "trainer.clip_grad=1.0",
    "pitfall=clip_before_unscale",
    "trainer.batch_size=8",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "diagnostics.every=2",
    "checkpoint.enabled=false",
]


def _spawned_worker(rank: int, ports: list[int], out_dir: str) -> None:
    """The in-process runs of this file's tests on one pair of spawned ranks (a spawn costs
    each rank an import of torch): one inf run per scaler kind, then the pitfall run; each in
    a group of its own, on a port of its own (a rank done first would otherwise join the group
    its peer is closing)."""
    torch.set_num_threads(1)
    for port, (kind, (scaler, _)) in zip(ports, INF_SCALERS.items()):
        as_rank(rank, port)
        _inf_run(rank, os.path.join(out_dir, kind), scaler)
    as_rank(rank, ports[-1])
    Trainer(build(settings(*PITFALL), os.path.join(out_dir, "pitfall"))).fit()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("fsdp")
    ports = [free_port() for _ in range(len(INF_SCALERS) + 1)]
    mp.spawn(_spawned_worker, args=(ports, str(out_dir)), nprocs=2, join=True)
    return out_dir


def _inf_run(rank: int, out_dir: str, scaler: list[str]) -> None:
    run = build(
        settings(
            "precision=fp16",
            "scaler.init_scale=1024",
            *scaler,
            "trainer.strategy=fsdp",
            "trainer.batch_size=8",
            "trainer.max_steps=4",
            "trainer.log_every=1",
            "checkpoint.enabled=false",
        ),
        out_dir,
    )
    forwards = {"n": 0}

    def poison(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if module.training and rank == 1:  # an inf in rank 1's gradients at its second step
            forwards["n"] += 1
            if forwards["n"] == 2:
                output.register_hook(lambda g: g * float("inf"))

    run.model.head.register_forward_hook(poison)
    weights, scales = [], []

    class StepAndGather:
        """The run's step, then the whole model gathered from both ranks' shards (a collective)."""

        def __init__(self, step: object) -> None:
            self.step = step

        def __call__(self, *args: object, **kwargs: object) -> object:
            result = self.step(*args, **kwargs)
            weights.append(torch.cat([p.full_tensor().flatten() for p in run.model.parameters()]))
            scales.append(run.scaler.get_scale())
            return result

        def __getattr__(self, name: str) -> object:  # the loop reads the step's diagnostics
            return getattr(self.step, name)

    trainer = Trainer(replace(run, train_step=StepAndGather(run.train_step)))
    summary = trainer.fit()
    torch.save(
        {"skipped": summary["skipped_steps"], "scales": scales, "weights": weights},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.slow
def test_an_inf_on_one_fsdp_rank_makes_both_skip_with_equal_scales(spawned):
    """The found-inf flag of the sharded gradients is reduced over the ranks (torch's DTensor
    dispatch does it inside GradScaler.unscale_), so rank 0, whose own shards are finite,
    skips too: under each scaler kind."""
    for kind, (_, scales) in INF_SCALERS.items():
        ranks = [torch.load(spawned / kind / f"rank{r}.pt") for r in range(2)]
        assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1, kind
        assert ranks[0]["scales"] == ranks[1]["scales"] == scales, kind
        before, skipped, after = ranks[0]["weights"][:3]
        assert torch.equal(skipped, before), kind  # the step with the inf changed no shard
        assert not torch.equal(after, skipped), kind  # the next one trains again
        lines = (spawned / kind / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert [r["amp/skipped_steps"] for r in rows if r["kind"] == "train"] == [0, 1, 1, 1]


@pytest.mark.slow
def test_bf16_policy_tracks_bf16_autocast_ddp_with_accumulation(tmp_path):
    """precision=bf16 with 2 micro-batches a step. Gathered in fp32 and autocast per op, FSDP is
    DDP's bf16 autocast to 1e-6; the default bf16 gather tracks it within 5e-3 relative over
    20 steps (measured: 4.5e-4, CPU, 2 gloo ranks): autocast's fp32 ops then start from weights
    already rounded to bf16 (docs/fsdp.md)."""
    runs = _torchrun_sweep(
        tmp_path,
        ["ddp", "fsdp", "fsdp_param_fp32"],
        "precision=bf16",
        "trainer.batch_size=4",
        "trainer.grad_accum=2",
    )
    ddp = _column(_train_rows(runs["ddp"]), "train/loss")
    bf16, fp32 = runs["fsdp"], runs["fsdp_param_fp32"]
    assert _column(_train_rows(fp32), "train/loss") == pytest.approx(ddp, rel=1e-6)
    gathered_bf16 = _column(_train_rows(bf16), "train/loss")
    assert gathered_bf16 == pytest.approx(ddp, rel=5e-3)
    assert gathered_bf16 != pytest.approx(ddp, rel=1e-6)  # the bf16 gather does change numbers
    summary = json.loads((bf16 / "summary.json").read_text())
    assert summary["fsdp"]["param_dtype"] == "bf16" and summary["fsdp"]["reduce_dtype"] == "fp32"


@pytest.mark.slow
def test_the_pitfall_lab_names_clipping_before_unscale_under_fsdp(spawned):
    """The lab's mistake clips the scaled gradient shards; the probe's norm over the shards
    shows the optimizer got clip / scale, and the run's signature names the pitfall."""
    run = spawned / "pitfall"
    summary = json.loads((run / "summary.json").read_text())
    assert "clip_before_unscale" in summary["diagnostics"]["signatures"]
    applied = _column(_train_rows(run), "diag/applied_grad_norm")
    assert applied and applied[0] == pytest.approx(1.0 / 65536, rel=1e-2)
