"""One training step with named stages: the pitfall lab and the throughput bench run it, the loop
numbers it, batches arrive in the model's memory format, numerics watch it through a view."""

from __future__ import annotations

import inspect
import json
import weakref

import pytest
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.choices import PitfallName
from amp_lab.diagnostics.pitfalls import VARIANTS, HalfModel, LabStep, NoScalerUpdate
from amp_lab.run import Run
from amp_lab.step import STAGES, TrainStep
from amp_lab.tools.bench.throughput import batch_stream, phase_times
from amp_lab.tools.doctor.advice import SIGNATURE_FIXES
from amp_lab.trainer import Trainer

TINY = [
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
]


def _run(tmp_path, *overrides: str) -> Run:
    return build(settings(*TINY, *overrides), tmp_path)


def _batch(run: Run, offset: int = 0):
    images, labels = run.data.train.tensors
    return images[offset : offset + 8], labels[offset : offset + 8]


def _overridden(cls: type) -> set[str]:
    """Names of the methods `cls` defines itself, not inherited from TrainStep."""
    return {
        name
        for name, member in vars(cls).items()
        if inspect.isfunction(member) and not name.startswith("__")
    }


@pytest.mark.parametrize("pitfall", [p for p in PitfallName if p != PitfallName.none])
def test_each_pitfall_overrides_stages_never_the_step(pitfall):
    cls = VARIANTS[pitfall]
    assert cls.__call__ is TrainStep.__call__  # no copy of the whole step
    assert issubclass(cls, LabStep) and _overridden(cls) <= {*STAGES, "compute_loss"}
    # one mistake, one stage; dropping the scaler (half_model) touches every scaler call
    assert len(_overridden(cls)) == (4 if pitfall == PitfallName.half_model else 1)


def test_the_lab_step_holds_only_the_last_outputs_until_the_next_forward(tmp_path):
    """The held-graph detail of TrainStep is the fault runs' too: they run the same step."""
    run = _run(tmp_path, "precision=bf16", "fault.inf_grad_at_step=100")
    assert type(run.train_step) is LabStep
    run.train_step([_batch(run)])
    first = [weakref.ref(t) for t in run.train_step.held]
    run.train_step([_batch(run, 8)])
    assert all(ref() is None for ref in first)
    assert run.train_step.held[1].dim() == 0


def test_the_step_number_comes_from_the_loop_not_the_schedule(tmp_path):
    run = _run(tmp_path, "precision=fp32", "fault.inf_grad_at_step=5")
    result = run.train_step([_batch(run)], step=5)  # the schedule has not moved yet
    assert result.found_inf.item() == 1.0 and run.scheduler.last_epoch == 1
    assert run.train_step.diagnostics.step == 5
    assert run.train_step([_batch(run)]).found_inf.item() == 0.0  # step 6 by default
    assert run.train_step.step_number == 6


def test_watching_stages_sees_each_stage_in_order_and_changes_nothing(tmp_path):
    common = ["precision=fp32", "trainer.grad_accum=2", "trainer.batch_size=4"]
    watched, plain = _run(tmp_path / "a", *common), _run(tmp_path / "b", *common)
    batches = [(x[:4], y[:4]) for x, y in [_batch(watched), _batch(watched, 8)]]
    seen: list[str] = []
    with watched.train_step.watching_stages(seen.append):
        loss = watched.train_step(batches).loss
    assert seen == ["forward_and_loss", "backward", "after_micro_batch"] * 2 + [
        "unscale_and_clip",
        "optimizer_step",
        "update_scale",
    ]
    assert not set(STAGES) & set(vars(watched.train_step))  # the class's stages again
    assert loss.item() == plain.train_step(batches).loss.item()
    for a, b in zip(watched.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_phase_times_time_the_runners_own_step(tmp_path):
    run = _run(tmp_path, "precision=bf16")
    forward, backward, optimizer = phase_times(run, batch_stream(run), steps=2)
    assert forward > 0 and backward > 0 and optimizer > 0
    assert run.train_step.step_number == 2 and run.scheduler.last_epoch == 2  # real steps
    assert run.train_step.held is not None


@pytest.mark.parametrize("channels_last", [True, False])
def test_batches_reach_the_device_in_the_models_memory_format(tmp_path, channels_last):
    run = build(
        settings(
            "model=test_convnext",
            "data=synthetic",
            "data.img_size=32",
            "data.num_samples=64",
            "data.num_classes=10",
            f"model.channels_last={str(channels_last).lower()}",
        ),
        tmp_path,
    )
    images, _ = next(run.data.train_batches(run.sampler))
    val, _ = next(run.data.val_batches(8))
    for batch in (images, val):
        assert batch.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert batch.is_contiguous() != channels_last


def test_the_observer_watches_the_step_the_loop_runs(tmp_path):
    """Built once, of the pitfall's class: the diagnostics see that class's scaler use."""
    half = _run(tmp_path / "half", "precision=fp16", "pitfall=half_model")
    assert type(half.train_step) is HalfModel
    assert half.train_step.diagnostics.view.uses_scaler is False
    plain = _run(tmp_path / "plain", "precision=fp16")
    assert (
        type(plain.train_step) is TrainStep
        and plain.train_step.diagnostics.view.uses_scaler is True
    )


@pytest.mark.parametrize(
    "mode, named",
    [
        (["precision=fp32"], "head.weight"),
        (["precision=bf16_pure"], "master weight 0"),
        (["precision=bf16_pure", "precision.master_weights=false"], None),
    ],
)
def test_the_view_names_the_weights_that_must_be_fp32(tmp_path, mode, named):
    view = _run(tmp_path, *mode).train_step.diagnostics.view
    weights = dict(view.optimized_weights())
    assert (named in weights) if named else weights == {}
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_the_view_reads_the_scale_on_the_device(tmp_path):
    run = _run(tmp_path, "precision=fp16", "scaler.init_scale=1024")
    view = run.train_step.diagnostics.view
    assert view.scale().item() == 1.0 and view.host_scale() == 1024.0  # before the first scale()
    run.train_step([_batch(run)])
    assert view.scale().item() == run.scaler.get_scale() == 1024.0


@pytest.mark.slow
def test_pitfall_names_are_the_strings_configs_records_and_the_doctor_use(tmp_path):
    """One Enum: the config's choice, the lab's variants, the signatures and the doctor's."""
    assert set(VARIANTS) == set(PitfallName) and PitfallName.half_model == "half_model"
    assert isinstance(settings("pitfall=half_model").pitfall.name, PitfallName)
    assert set(SIGNATURE_FIXES) <= set(PitfallName)
    assert json.dumps({PitfallName.half_model: PitfallName.none}) == '{"half_model": "none"}'
    run = _run(
        tmp_path,
        "precision=fp16",
        "scaler.init_scale=1e12",
        "pitfall=no_scaler_update",
        "trainer.max_steps=4",
        "trainer.log_every=4",
    )
    assert type(run.train_step) is NoScalerUpdate
    summary = Trainer(run).fit()
    assert "no_scaler_update" in summary["diagnostics"]["signatures"]
    torch.save(run.train_step.diagnostics.state_dict(), tmp_path / "diag.pt")  # as in a checkpoint
    state = torch.load(tmp_path / "diag.pt", weights_only=True)
    assert list(state["tracker"]["signatures"]) == ["no_scaler_update"]


def test_clip_before_unscale_keeps_the_pure_modes_gradient_hand_off(tmp_path):
    """Its own unscale stage still moves the 16-bit gradients into the fp32 masters first, so
    a pure-mode run with this mistake updates its weights (at ~1/scale of the right size)."""
    run = _run(
        tmp_path, "precision=fp16_pure", "pitfall=clip_before_unscale", "trainer.clip_grad=1.0"
    )
    before = [p.detach().clone() for p in run.model.parameters()]
    assert run.train_step([_batch(run)]).found_inf.item() == 0.0
    assert any(not torch.equal(a, p) for a, p in zip(before, run.model.parameters()))
