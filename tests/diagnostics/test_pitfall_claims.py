"""Each pitfall's documented symptom (docs/amp_pitfalls.md, the lab table of docs/diagnostics.md),
measured under SGD and under AdamW: the docs say which symptom shows with which optimizer."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.choices import PitfallName, PrecisionName
from amp_lab.config import ConfigError, FaultConfig, PrecisionConfig
from amp_lab.diagnostics.pitfalls import prepare_model
from amp_lab.precision.modes import PRECISION_MODES, resolve_precision
from amp_lab.trainer import Trainer

TINY = [
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
    "precision=fp16",
    "trainer.log_every=1",
]
FP8_ON_CPU = ["precision.fp8_emulate=true"]  # fp8's emulated matmuls, where no GPU has them
OPTIMIZERS = {
    "sgd": ["optim=sgd", "optim.weight_decay=0", "optim.momentum=0", "lr.base=0.1"],
    "adamw": ["optim=adamw"],
}


def _fit(tmp_path, optim: str, *overrides: str) -> tuple[dict, list[dict]]:
    summary = Trainer(build(settings(*TINY, *OPTIMIZERS[optim], *overrides), tmp_path)).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if r["kind"] == "train"]


def update_ratio(tmp_path, optim: str, pitfall: str) -> float:
    """Update-to-weight ratio of the first step (the same weights and batch in both runs)."""
    _, rows = _fit(
        tmp_path / pitfall,
        optim,
        f"pitfall={pitfall}",
        "trainer.clip_grad=1.0",
        "lr.schedule=constant",
        "trainer.max_steps=1",
        "diagnostics.every=1",
    )
    return rows[0]["diag/update_ratio"]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_clip_before_unscale_shrinks_sgd_updates_by_the_scale_but_not_adamw(tmp_path, optim):
    """SGD: the update is ~1/scale (65536) of the correct one; AdamW normalises the gradient's
    size away, so its update shrinks far less (docs/amp_pitfalls.md: 0.60x on this model, the eps
    term growing relatively larger)."""
    ratio = update_ratio(tmp_path, optim, "clip_before_unscale") / update_ratio(
        tmp_path, optim, "none"
    )
    if optim == "sgd":
        assert ratio == pytest.approx(1 / 65536, rel=0.05)
    else:
        assert 0.45 < ratio < 0.75  # the docs' 0.60, with room for another CPU's kernels


@pytest.mark.slow
def test_clip_before_unscale_under_adamw_loses_about_as_fast_as_the_correct_run(tmp_path):
    """docs/amp_pitfalls.md's 40 steps: the loss over the first and last 5 steps, 2.367 -> 2.297
    with the pitfall against 2.371 -> 2.282 without (CPU, 2026-12-03)."""
    ends = {}
    for pitfall in ("none", "clip_before_unscale"):
        _, rows = _fit(
            tmp_path / pitfall,
            "adamw",
            f"pitfall={pitfall}",
            "trainer.clip_grad=1.0",
            "trainer.max_steps=40",
            "data.img_size=16",
            "trainer.batch_size=32",
        )
        losses = [r["train/loss"] for r in rows]
        ends[pitfall] = (sum(losses[:5]) / 5, sum(losses[-5:]) / 5)
    (first, last), (first_clip, last_clip) = ends["none"], ends["clip_before_unscale"]
    assert last_clip < first_clip - 0.04  # it trains
    assert abs((first_clip - last_clip) - (first - last)) < 0.05  # about as fast


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_no_scaler_update_pins_the_scale_while_steps_skip(tmp_path, optim):
    summary, _ = _fit(
        tmp_path,
        optim,
        "pitfall=no_scaler_update",
        "fault.inf_grad_at_step=2",
        "trainer.max_steps=4",
    )
    assert summary["skipped_steps"] == 1 and summary["final_loss_scale"] == 65536
    assert "no_scaler_update" in summary["diagnostics"]["signatures"]
    assert "scale_pinned" in {e["rule"] for e in summary["health"]}


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_update_every_microbatch_grows_the_scale_grad_accum_times_too_fast(tmp_path, optim):
    summary, _ = _fit(
        tmp_path,
        optim,
        "pitfall=update_every_microbatch",
        "trainer.grad_accum=4",
        "scaler.init_scale=256",
        "scaler.growth_interval=2",
        "trainer.max_steps=2",
    )
    assert summary["final_loss_scale"] > 256 * 2  # once per step allows one growth in 2 steps
    assert "update_every_microbatch" in summary["diagnostics"]["signatures"]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_half_model_keeps_fp16_weights_and_optimizer_state(tmp_path, optim):
    trainer = Trainer(
        build(
            settings(*TINY, *OPTIMIZERS[optim], "pitfall=half_model", "trainer.max_steps=2"),
            tmp_path,
        )
    )
    summary = trainer.fit()
    assert summary["diagnostics"]["fp32_state_ok"] is False
    evidence = summary["diagnostics"]["signatures"]["half_model"]
    weights = len(list(trainer.run.model.parameters()))
    # AdamW: every weight and both its moments are fp16; SGD without momentum keeps no state
    assert evidence.startswith(f"{weights * (3 if optim == 'adamw' else 1)} not fp32")
    assert "float16" in evidence


def test_half_model_clips_as_trainer_clip_mode_says(tmp_path):
    """By value: every gradient element within ±clip_grad, so their total norm is far above it
    (clipping by norm would bring the total to clip_grad)."""
    clip = ("trainer.clip_grad=1e-3", "trainer.clip_mode=value", "trainer.max_steps=2")
    run = build(settings(*TINY, *OPTIMIZERS["sgd"], "pitfall=half_model", *clip), tmp_path)
    seen = []

    def clipped(optimizer, args, kwargs):
        grads = [p.grad.float() for g in optimizer.param_groups for p in g["params"]]
        seen.append(
            (
                max(g.abs().max().item() for g in grads),
                torch.cat([g.flatten() for g in grads]).norm().item(),
            )
        )

    run.optimizer.register_step_pre_hook(clipped)
    Trainer(run).fit()
    assert len(seen) == 2
    bound = torch.tensor(1e-3, dtype=torch.float16).item()  # fp16 gradients: 1e-3 rounded
    assert all(largest <= bound and total > 1e-2 for largest, total in seen), seen


@pytest.mark.parametrize("model", ["test_vit", "test_convnext"])
def test_half_model_beside_bf16_shows_no_mistake_so_it_is_refused(model):
    """What the refusal of pitfall=half_model beside bf16 says (tests/test_bad_input.py): on the
    CPU, timm's layers refuse fp16 weights beside bf16 autocast activations; bf16_pure casts the
    weights back."""
    sized = {"img_size": 32} if "vit" in model else {}
    net = timm.create_model(model, pretrained=False, num_classes=10, **sized)
    cpu = torch.device("cpu")
    fp16 = resolve_precision(PrecisionName.fp16, cpu, PrecisionConfig())
    prepare_model(net, FaultConfig(), PitfallName.half_model, fp16)
    refused = "Unexpected floating ScalarType|mixed dtype"
    with pytest.raises(RuntimeError, match=refused), torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(2, 3, 32, 32))
    pure = resolve_precision(PrecisionName.bf16_pure, cpu, PrecisionConfig())
    pure.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "mode",
    [n for n, m in PRECISION_MODES.items() if torch.bfloat16 in (m.param_dtype, m.autocast_dtype)],
)
def test_half_model_is_refused_beside_every_bf16_mode(tmp_path, mode):
    with pytest.raises(ConfigError, match=f"pitfall=half_model .*; precision={mode} "):
        build(settings(*TINY, "pitfall=half_model", f"precision={mode}", *FP8_ON_CPU), tmp_path)


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_loss_in_low_precision_overflows_the_first_scaled_step(tmp_path, optim):
    summary, rows = _fit(tmp_path, optim, "pitfall=loss_in_low_precision", "trainer.max_steps=2")
    assert rows[0]["amp/skipped_steps"] == 1  # 65536 x the fp16 loss passes 65504
    assert "loss_in_low_precision" in summary["diagnostics"]["signatures"]
