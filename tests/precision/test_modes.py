"""Precision modes beyond autocast on real configs and a real timm ViT: fp8 (torchao, emulated on
CPU), bf16_pure / fp16_pure with fp32 master weights, and bf16 weights without masters."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.config import ConfigError
from amp_lab.precision.master_weights import RoundedUpdates, stochastic_round_to_bf16
from amp_lab.precision.modes import PRECISION_MODES
from amp_lab.trainer import Trainer

FP8 = ["precision=fp8", "precision.fp8_emulate=true"]
NO_MASTERS = ["precision=bf16_pure", "precision.master_weights=false"]


def _batch(trainer: Trainer, n: int = 16, offset: int = 0):
    images, labels = trainer.run.data.train.tensors
    return images[offset : offset + n], labels[offset : offset + n]


def _fp_state(optimizer: torch.optim.Optimizer, skip: tuple[str, ...] = ()) -> list[torch.Tensor]:
    return [
        t
        for s in optimizer.state.values()
        for k, t in s.items()
        if k not in skip and torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1
    ]


@pytest.mark.parametrize(
    "overrides, model_dtype, optim_dtype",
    [
        ([*FP8, "precision.fp8_recipe=tensorwise"], torch.float32, torch.float32),
        ([*FP8, "precision.fp8_recipe=rowwise"], torch.float32, torch.float32),
        (["precision=bf16_pure"], torch.bfloat16, torch.float32),
        (["precision=fp16_pure"], torch.float16, torch.float32),
        ([*NO_MASTERS, "precision.update_rounding=kahan"], torch.bfloat16, torch.bfloat16),
        ([*NO_MASTERS, "precision.update_rounding=stochastic"], torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp8_tensorwise", "fp8_rowwise", "bf16_pure", "fp16_pure", "bf16_kahan", "bf16_sr"],
)
def test_each_mode_learns_and_holds_the_dtypes_it_claims(
    tmp_path, overrides, model_dtype, optim_dtype
):
    trainer = Trainer(build(settings(*overrides, "lr.schedule=constant"), tmp_path))
    batch = _batch(trainer)
    results = [trainer.run.train_step([batch]) for _ in range(4)]
    losses = [r.loss.item() for r in results]
    assert all(r.found_inf.item() == 0.0 for r in results)
    assert losses[-1] < losses[0] - 0.1  # it fits the batch
    assert {p.dtype for p in trainer.run.model.parameters()} == {model_dtype}
    held = [p for g in trainer.run.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in held} == {optim_dtype}  # masters (fp32) or the weights themselves
    # optimizer moments are fp32 in every mode (no masters: the step runs on an fp32 up-cast)
    state = _fp_state(trainer.run.optimizer, skip=("kahan_comp",))
    assert state and all(t.dtype == torch.float32 for t in state)


@pytest.mark.parametrize(
    "overrides",
    [["precision=bf16_pure"], [*NO_MASTERS, "precision.update_rounding=kahan"]],
    ids=["masters", "no_masters"],
)
def test_pure_modes_keep_batchnorm_in_fp32(tmp_path, overrides):
    """As apex O2: BatchNorm's weights and running statistics stay fp32, the rest is 16-bit,
    and a step keeps it so (the rounding back to bf16 leaves BatchNorm alone)."""
    trainer = Trainer(
        build(settings(*overrides, "model=resnet18", "lr.schedule=constant"), tmp_path)
    )
    norms = [m for m in trainer.run.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms
    for _ in range(2):
        trainer.run.train_step([_batch(trainer)])
    kept = {id(t) for m in norms for t in [*m.parameters(), *m.buffers()]}
    assert all(t.dtype == torch.float32 for m in norms for t in [*m.parameters(), m.running_var])
    assert {p.dtype for p in trainer.run.model.parameters() if id(p) not in kept} == {
        torch.bfloat16
    }
    assert norms[0].running_mean.abs().sum() > 0  # the fp32 statistics were updated


def test_fp8_converts_the_eligible_linears_but_not_the_head(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    trainer = Trainer(build(settings(*FP8), tmp_path))
    converted = [n for n, m in trainer.run.model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 24  # test_vit: qkv, proj, fc1, fc2 in each of 6 blocks (dims 64/192)
    assert not isinstance(trainer.run.model.head, Float8Linear)  # 64 -> 10 classes, and the head
    info = trainer.run.describe()["precision"]  # what summary.json records
    assert info["reports_mfu"] is False and info["fp8_recipe"] == "tensorwise"
    assert PRECISION_MODES["fp8"].reports_mfu is False  # the bench reads this from the table


@pytest.mark.slow
def test_fp8_leaves_the_fp32_modules_in_fp32(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    trainer = Trainer(build(settings(*FP8, "precision.fp32_modules=[blocks.0.mlp]"), tmp_path))
    types = {n: type(m) for n, m in trainer.run.model.named_modules()}
    assert (
        types["blocks.0.mlp.fc1"] is torch.nn.Linear
        and types["blocks.0.mlp.fc2"] is torch.nn.Linear
    )  # kept, with their fp32 wrapper
    assert types["blocks.0.attn.qkv"] is Float8Linear and types["blocks.1.mlp.fc1"] is Float8Linear
    trainer.fit()  # and the run trains through both kinds


@pytest.mark.slow
def test_fp16_pure_with_master_weights_matches_fp16_autocast(tmp_path):
    common = ["lr.base=1e-3", "lr.schedule=constant", "optim.weight_decay=0"]
    amp = Trainer(build(settings("precision=fp16", *common), tmp_path / "amp"))
    pure = Trainer(build(settings("precision=fp16_pure", *common), tmp_path / "pure"))
    weights = [p for g in amp.run.optimizer.param_groups for p in g["params"]]
    start = [w.detach().clone() for w in weights]
    for i in range(4):
        batch = _batch(amp, offset=16 * i)
        loss_amp = amp.run.train_step([batch]).loss.item()
        loss_pure = pure.run.train_step([batch]).loss.item()
        assert loss_pure == pytest.approx(loss_amp, rel=5e-3, abs=5e-3), i
    masters = [p for g in pure.run.optimizer.param_groups for p in g["params"]]
    moved = torch.cat([(w - w0).flatten() for w, w0 in zip(weights, start)]).norm()
    apart = torch.cat([(m - w).flatten() for m, w in zip(masters, weights)]).norm()
    assert apart < 0.1 * moved  # the two runs take nearly the same steps
    assert pure.run.scaler.get_scale() == amp.run.scaler.get_scale() == 65536.0


def test_master_weights_survive_a_state_dict_round_trip(tmp_path):
    first = Trainer(build(settings("precision=bf16_pure"), tmp_path / "a"))
    first.run.train_step([_batch(first)])
    saved_model, saved_opt = first.run.model.state_dict(), first.run.optimizer.state_dict()
    second = Trainer(build(settings("precision=bf16_pure"), tmp_path / "b"))
    second.run.model.load_state_dict(saved_model)
    second.run.optimizer.load_state_dict(saved_opt)
    for a, b in zip(
        second.run.optimizer.param_groups[0]["params"],
        first.run.optimizer.param_groups[0]["params"],
    ):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # the low bits came back too
    batch = _batch(first, offset=16)
    assert first.run.train_step([batch]).loss.item() == second.run.train_step([batch]).loss.item()


def _tiny_update_run(rounding: str, steps: int = 64) -> torch.Tensor:
    """SGD with updates far below bf16's resolution at 1.0 (ulp 2**-7): sum of what arrives."""
    weight = torch.nn.Parameter(torch.ones(4096))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = torch.optim.SGD([weight], lr=1.0)
    RoundedUpdates(model, optimizer, torch.bfloat16, rounding)
    for _ in range(steps):
        weight.grad = torch.full_like(weight, -(2.0**-12))  # each step adds 2**-12 = ulp / 32
        optimizer.step()
    return weight.float() + optimizer.state[weight].get("kahan_comp", torch.zeros(1)).float()


def test_rounded_updates_keep_what_nearest_rounding_loses():
    torch.manual_seed(0)
    exact = 1.0 + 64 * 2.0**-12
    assert torch.all(_tiny_update_run("nearest") == 1.0)  # every update rounded away
    assert torch.allclose(_tiny_update_run("kahan"), torch.tensor(exact), atol=1e-6)
    stochastic = _tiny_update_run("stochastic")
    assert stochastic.mean().item() == pytest.approx(exact, abs=2e-3)  # unbiased on average


def test_stochastic_rounding_picks_the_two_neighbours_without_bias():
    torch.manual_seed(0)
    x = torch.full((100_000,), 1.0 + 2.0**-10)  # 1/8 of the way from 1 to 1 + 2**-7
    rounded = stochastic_round_to_bf16(x).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2.0**-10, abs=1e-4)
    assert torch.equal(
        stochastic_round_to_bf16(torch.tensor([-3.0, 0.5])).float(), torch.tensor([-3.0, 0.5])
    )  # representable values stay put


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision=fp16_pure", "precision.master_weights=false"], "master_weights=true"),
        (["precision=bf16_pure", "precision.update_rounding=kahan"], "master_weights=false"),
        (["precision.update_rounding=up"], "update_rounding='up' is unknown"),
        (["precision=fp8", "precision.fp8_recipe=blockwise"], "fp8_recipe='blockwise' is unknown"),
        (["precision=fp8"], "precision.fp8_emulate=true"),  # no SM 8.9+ GPU here
        (["precision=bf16_pure", "precision.fp32_modules=[head]"], "use bf16 with precision.fp32"),
    ],
)
def test_bad_precision_settings_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        Trainer(build(settings(*overrides), tmp_path))
    assert "\n" not in str(err.value)


def test_fp8_without_torchao_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(
        ConfigError, match=r"^precision=fp8 needs torchao .*: pip install 'amp-lab\[fp8\]'$"
    ):
        Trainer(build(settings(*FP8), tmp_path))
