"""The training step's GradScaler recipe, checked on real configs and a real timm model."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.run import Run
from amp_lab.step import count_correct


def _run(tmp_path, *overrides: str) -> Run:
    return build(settings(*overrides), tmp_path)


def _batch(run: Run, n: int, offset: int = 0):
    images, labels = run.data.train.tensors
    return images[offset : offset + n], labels[offset : offset + n]


def _weights(run: Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def _inject_inf_once(run: Run):
    """Make the next backward put an inf into one parameter's gradient."""
    param = run.model.head.weight
    handle = None

    def hook(grad):
        handle.remove()
        return grad * float("inf")

    handle = param.register_hook(hook)


def test_inf_gradient_under_fp16_is_skipped_and_backs_off(tmp_path):
    run = _run(tmp_path, "precision=fp16", "scaler.init_scale=1024")
    run.train_step([_batch(run, 16)])  # one clean step first
    before, scale = _weights(run), run.scaler.get_scale()
    _inject_inf_once(run)
    with warnings.catch_warnings(record=True) as caught:
        result = run.train_step([_batch(run, 16, 16)])
    assert result.found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(run)))  # nothing written
    assert run.scaler.get_scale() == scale * 0.5  # scale x backoff_factor
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    # the schedule follows the step counter: the skipped step still moved it on
    assert run.scheduler.last_epoch == 2
    run.train_step([_batch(run, 16, 32)])
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(run)))


def test_scale_grows_after_growth_interval_clean_steps(tmp_path):
    run = _run(tmp_path, "precision=fp16", "scaler.init_scale=256", "scaler.growth_interval=3")
    scales = []
    for i in range(6):
        result = run.train_step([_batch(run, 16, 16 * i)])
        assert result.found_inf.item() == 0.0
        scales.append(run.scaler.get_scale())
    assert scales == [256, 256, 512, 512, 512, 1024]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16_noscale"])
def test_modes_without_scaler_still_skip_non_finite_steps(tmp_path, precision):
    run = _run(tmp_path, f"precision={precision}")
    before = _weights(run)
    _inject_inf_once(run)
    result = run.train_step([_batch(run, 16)])
    assert result.found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(run)))
    assert run.scaler.get_scale() == 1.0  # nothing is scaled in these modes


def test_every_step_measures_its_norm_and_an_inf_gradient_skips_the_update(tmp_path):
    """The norm of every step stays a device tensor (the monitor reads it at log steps); an inf
    gradient makes it inf, and the scaler's own check skips the update."""
    run = _run(tmp_path, "precision=bf16")
    before = _weights(run)
    _inject_inf_once(run)
    result = run.train_step([_batch(run, 16)])
    assert not torch.isfinite(result.grad_norm) and result.found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(run)))
    assert torch.isfinite(run.train_step([_batch(run, 16)]).grad_norm)


def test_clipping_sees_unscaled_gradients(tmp_path):
    """fp16 with a 65536 scale: the logged norm matches fp32, and the clip acts on true grads."""
    common = [
        "optim=sgd",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "lr.base=1.0",
        "lr.schedule=constant",
        "trainer.clip_grad=0.05",
    ]
    ref = _run(tmp_path / "a", "precision=fp32", *common)
    amp = _run(tmp_path / "b", "precision=fp16", "scaler.init_scale=65536", *common)
    batch = _batch(ref, 16)
    before = _weights(amp)
    norm_ref = ref.train_step([batch]).grad_norm.item()
    norm_amp = amp.train_step([batch]).grad_norm.item()
    assert norm_amp == pytest.approx(norm_ref, rel=2e-2)
    assert norm_ref > 0.05  # so the clip is active
    update = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, _weights(amp))))
    assert update.item() == pytest.approx(0.05, rel=1e-3)  # lr 1 x clipped unscaled norm


def test_accumulation_equals_one_large_batch_in_fp32(tmp_path):
    common = [
        "precision=fp32",
        "optim=sgd",
        "optim.weight_decay=0",
        "lr.base=0.5",
        "lr.schedule=constant",
    ]
    big = _run(tmp_path / "big", "trainer.batch_size=64", *common)
    acc = _run(tmp_path / "acc", "trainer.batch_size=16", "trainer.grad_accum=4", *common)
    assert all(torch.equal(a, b) for a, b in zip(_weights(big), _weights(acc)))  # same init
    images, labels = _batch(big, 64)
    big_result = big.train_step([(images, labels)])
    acc_result = acc.train_step(
        [(images[i : i + 16], labels[i : i + 16]) for i in range(0, 64, 16)]
    )
    assert acc_result.loss.item() == pytest.approx(big_result.loss.item(), abs=1e-6)
    for a, b in zip(_weights(big), _weights(acc)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(_weights(big), _weights(_run(tmp_path / "init", *common)))
    )  # the step really changed the weights


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_optimizer_state_and_master_weights_stay_fp32(tmp_path, precision):
    run = _run(tmp_path, f"precision={precision}")
    run.train_step([_batch(run, 16)])
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    state = [
        t
        for s in run.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1
    ]
    assert state and all(t.dtype == torch.float32 for t in state)


def test_loss_is_computed_in_fp32_under_autocast(tmp_path):
    run = _run(tmp_path, "precision=bf16")
    result = run.train_step([_batch(run, 16)])
    assert result.loss.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accuracy_counts_the_first_maximum_like_argmax(dtype):
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.5], [0.0, 0.0, 0.0]]).to(dtype)
    assert torch.equal(logits.argmax(-1), torch.tensor([1, 0, 0]))
    assert count_correct(logits, torch.tensor([1, 0, 0])).item() == 3
    assert count_correct(logits, torch.tensor([2, 1, 2])).item() == 0  # ties go to the first


def test_a_step_holds_only_the_last_outputs_until_the_next_forward(tmp_path):
    """The previous step's logits and loss stay alive into the next step (as a hand-written
    loop's variables do) and are released there: memory never grows with the step count."""
    run = _run(tmp_path, "precision=bf16")
    run.train_step([_batch(run, 16)])
    first = [weakref.ref(t) for t in run.train_step.held]
    run.train_step([_batch(run, 16, 16)])
    assert all(ref() is None for ref in first)
    logits, loss = run.train_step.held
    assert logits.shape == (16, run.settings.data.num_classes) and loss.dim() == 0


def test_optimizer_is_fused_so_the_scaler_skips_on_device(tmp_path):
    run = _run(tmp_path, "precision=fp16")
    assert run.optimizer.defaults["fused"] is True
    assert getattr(run.optimizer, "_step_supports_amp_scaling", False)
