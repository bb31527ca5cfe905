"""GradScaler's private state, used in one module, checked against the torch it was read for."""

from __future__ import annotations

import torch
from helpers import settings
from packaging.version import Version

from amp_lab.build import build
from amp_lab.precision import scaler_internals as internals
from amp_lab.trainer import Trainer

# fp32 with the scaler forced on: the scaler logic is the same as under fp16, and fast on CPU
SCALED = [
    "precision=fp32",
    "scaler.enabled=true",
    "scaler.init_scale=1024",
    "scaler.growth_interval=1",
]


def test_this_torch_is_one_the_scaler_internals_were_checked_against():
    version = "{}.{}".format(*Version(torch.__version__).release[:2])  # 2.14.1+cu130: 2.14
    assert version in internals.CHECKED_TORCH, (
        f"torch {version} is not in CHECKED_TORCH {internals.CHECKED_TORCH} of "
        f"amp_lab/precision/scaler_internals.py: re-read {internals.RECHECK} in torch's "
        f"torch/amp/grad_scaler.py, fix what changed, then add '{version}' to CHECKED_TORCH"
    )


def _scaled_backward(trainer: Trainer, inf: bool) -> None:
    images, labels = trainer.run.data.train.tensors
    trainer.run.optimizer.zero_grad(set_to_none=True)
    loss = trainer.run.model(images[:8]).float().logsumexp(-1).mean() * (float("inf") if inf else 1)
    trainer.run.scaler.scale(loss).backward()


def test_found_inf_is_the_skip_flag_until_update_clears_it(tmp_path):
    trainer = Trainer(build(settings(*SCALED), tmp_path))
    scaler, optimizer = trainer.run.scaler, trainer.run.optimizer
    for inf in (True, False):
        _scaled_backward(trainer, inf)
        scaler.step(optimizer)
        assert internals.found_inf(scaler, optimizer).item() == float(inf)
        assert [f.item() for f in internals.step_found_inf(scaler)] == [float(inf)]
        scaler.update()
        assert internals.step_found_inf(scaler) == []


def test_scale_tensor_is_the_scale_on_the_device(tmp_path):
    trainer = Trainer(build(settings(*SCALED), tmp_path))
    assert internals.scale_tensor(trainer.run.scaler) is None  # before the first scale()
    _scaled_backward(trainer, inf=False)
    scale = internals.scale_tensor(trainer.run.scaler)
    assert scale is not None and scale.device == trainer.run.device
    assert scale.item() == trainer.run.scaler.get_scale() == 1024.0


def test_update_scale_now_backs_off_and_grows_and_keeps_the_steps_records(tmp_path):
    trainer = Trainer(build(settings(*SCALED), tmp_path))
    scaler = trainer.run.scaler
    _scaled_backward(trainer, inf=False)
    grads = [p.grad for p in trainer.run.model.parameters() if p.grad is not None]
    internals.update_scale_now(scaler, grads)
    assert scaler.get_scale() == 2048.0  # a clean check with growth_interval 1: growth
    grads[0].fill_(float("nan"))
    internals.update_scale_now(scaler, grads)
    assert scaler.get_scale() == 1024.0  # backoff
    scaler.unscale_(trainer.run.optimizer)
    internals.update_scale_now(scaler, [])
    assert internals.step_found_inf(scaler)  # update()'s records stay for update() itself
    scale, growth = internals.scale_and_growth_tracker(scaler)
    assert scale.item() == 2048.0 and growth.item() == 0
    assert not torch.isfinite(grads[0]).all()  # the check leaves the gradients as they are
