"""Numerics telemetry on real configs: attribution, scale events, underflow, the pitfall lab."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, settings

from amp_lab.build import build
from amp_lab.config import ConfigError
from amp_lab.trainer import Trainer

# smaller than FAST: CPU fp16 is slow, and these tests run many short trainings
TINY = [
    "data.img_size=8",
    "trainer.batch_size=8",
    "data.val_fraction=0.05",
    "+model.kwargs.depth=1",
]
SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def _fit(tmp_path, *overrides: str) -> tuple[dict, list[dict]]:
    summary = Trainer(build(settings(*TINY, *overrides), tmp_path)).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if r["kind"] == "train"]


def _batch(trainer: Trainer, n: int = 8):
    images, labels = trainer.run.data.train.tensors
    return images[:n], labels[:n]


@pytest.mark.parametrize("extra", [[], ["fault.inf_grad_at_step=2"]])
def test_light_mode_reads_nothing_back_on_non_logging_steps(tmp_path, monkeypatch, extra):
    """Count every host read of a tensor; only log steps (4, 8) may have any."""
    trainer = Trainer(
        build(
            settings(*TINY, "precision=fp16", "trainer.log_every=4", "trainer.max_steps=8", *extra),
            tmp_path,
        )
    )
    assert trainer.run.settings.diagnostics.mode == "light"  # the default
    current, calls = {"step": 0}, {}
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.setdefault(current["step"], []).append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step_call = type(trainer.run.train_step).__call__

    def step(self, micro_batches, **kwargs):
        current["step"] += 1
        return step_call(self, micro_batches, **kwargs)

    monkeypatch.setattr(type(trainer.run.train_step), "__call__", step)
    summary = trainer.fit()
    monkeypatch.undo()
    assert summary["steps"] == 8 and calls.get(4) and calls.get(8)  # the counting works
    assert {s: c for s, c in calls.items() if s not in (0, 4, 8)} == {}
    if extra:  # the arming path ran too: the fault was seen, exactly at its step
        assert summary["diagnostics"]["nonfinite"]["first_step"] == 2


def test_inf_gradient_is_attributed_and_the_backoff_logged(tmp_path):
    summary, train = _fit(
        tmp_path,
        "precision=fp16",
        "fault.inf_grad_at_step=3",
        "diagnostics=full",
        "trainer.log_every=2",
    )
    nonfinite = summary["diagnostics"]["nonfinite"]
    assert nonfinite["first_step"] == 3 and nonfinite["attributed_step"] == 3
    assert nonfinite["module"] == "head" and nonfinite["phase"] == "backward"
    assert summary["diagnostics"]["scale_events"][0] == {
        "step": 3,
        "kind": "backoff",
        "from": 65536.0,
        "to": 32768.0,
    }
    assert [r["amp/backoffs"] for r in train] == [0, 1, 0]
    assert train[-1]["diag/first_nonfinite_step"] == 3
    detail = [json.loads(x) for x in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    hist = detail[0]["grad_log2_hist"]
    assert len(hist["counts"]) == hist["high"] - hist["low"] and sum(hist["counts"]) > 1000
    assert all(v["max_abs"] < 65504 for v in detail[0]["activations"].values())
    assert 0 <= train[0]["diag/grad_flush_share"] <= 1 and train[0]["diag/act_max"] > 0
    assert summary["diagnostics"]["fp32_state_ok"] is True


@pytest.mark.slow
def test_probes_see_a_compiled_model(tmp_path):
    """torch.compile ignores module hooks added after compiling, so probe steps run the eager
    module inside it: the compiled run reports the same activations as an eager one."""
    common = ["precision=bf16", "diagnostics.every=2", "trainer.log_every=2", "trainer.max_steps=4"]
    _, eager = _fit(tmp_path / "eager", *common)
    _, compiled = _fit(
        tmp_path / "compiled", *common, "trainer.compile=true", "trainer.compile_backend=aot_eager"
    )
    assert [r["diag/act_max_module"] for r in compiled] == [r["diag/act_max_module"] for r in eager]
    for c, e in zip(compiled, eager):
        assert c["diag/act_max"] == pytest.approx(e["diag/act_max"], rel=1e-2)


@pytest.mark.slow
def test_full_mode_on_a_compiled_model_says_it_runs_eager(tmp_path, caplog):
    Trainer(build(settings(*TINY, "diagnostics=full", "trainer.compile=true"), tmp_path))
    assert "every step runs eager" in caplog.text


def test_overflowing_module_is_named_in_light_mode(tmp_path):
    summary, _ = _fit(
        tmp_path,
        "precision=fp16",
        "fault.overflow_module=blocks.0.mlp.fc2",
        "fault.overflow_factor=1e6",
    )
    nonfinite = summary["diagnostics"]["nonfinite"]
    assert nonfinite["forward"]["module"] == "blocks.0.mlp.fc2"
    assert nonfinite["forward"]["dtype"] == "float16"
    assert nonfinite["forward"]["max_abs"] == float("inf")
    assert nonfinite["first_step"] == 1  # exact even though light mode attributes later
    assert summary["skipped_steps"] == summary["steps"]


def test_skipped_steps_are_judged_and_no_scaler_update_is_a_signature(tmp_path):
    common = [
        "precision=fp16",
        "scaler.init_scale=1e12",
        "trainer.log_every=4",
        "trainer.max_steps=4",
    ]
    right, _ = _fit(tmp_path / "right", *common)
    wrong, _ = _fit(tmp_path / "wrong", *common, "pitfall=no_scaler_update")
    assert right["final_loss_scale"] == pytest.approx(1e12 / 16)  # backs off on each overflow
    assert "unstable: 4 of 4 steps skipped (100%)" in [h["words"] for h in right["health"]]
    assert "no_scaler_update" not in right["diagnostics"]["signatures"]
    assert wrong["final_loss_scale"] == pytest.approx(1e12)  # never moves
    assert wrong["skipped_steps"] == 4
    assert "no_scaler_update" in wrong["diagnostics"]["signatures"]


def test_update_every_microbatch_is_named(tmp_path):
    summary, _ = _fit(
        tmp_path,
        "precision=fp16",
        "pitfall=update_every_microbatch",
        "trainer.grad_accum=4",
        "scaler.init_scale=256",
        "scaler.growth_interval=2",
        "trainer.max_steps=2",
    )
    assert "update_every_microbatch" in summary["diagnostics"]["signatures"]
    assert summary["final_loss_scale"] > 256 * 2  # grew faster than once per step allows


def test_clip_before_unscale_makes_updates_one_over_scale(tmp_path):
    common = [
        "optim=sgd",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "lr.base=1.0",
        "lr.schedule=constant",
        "trainer.clip_grad=0.05",
        "diagnostics.every=1",
    ]
    moves = {}
    for name, extra in [("ref", []), ("wrong", ["pitfall=clip_before_unscale"])]:
        trainer = Trainer(
            build(settings(*TINY, "precision=fp16", *common, *extra), tmp_path / name)
        )
        before = [p.detach().clone() for p in trainer.run.model.parameters()]
        result = trainer.run.train_step([_batch(trainer)])
        trainer.run.monitor.add(result)
        moves[name] = torch.sqrt(
            sum(
                ((a - p.detach()) ** 2).sum()
                for a, p in zip(before, trainer.run.model.parameters())
            )
        ).item()
        (tmp_path / name).mkdir()
        trainer.run.train_step.diagnostics.read(1, trainer.run.monitor.read(1), None)
        signatures = trainer.run.train_step.diagnostics.signatures
        assert ("clip_before_unscale" in signatures) == (name == "wrong")
    assert moves["ref"] == pytest.approx(0.05, rel=1e-3)
    assert moves["wrong"] / moves["ref"] == pytest.approx(1 / 65536, rel=0.05)


def test_half_model_fires_the_fp32_state_check(tmp_path):
    summary, _ = _fit(
        tmp_path,
        "precision=fp16",
        "pitfall=half_model",
        "trainer.max_steps=2",
        "fault.inf_grad_at_step=1",
    )
    diag = summary["diagnostics"]
    # its own signature only: the loop has no scaler, so a skip without backoff is no misuse
    assert diag["fp32_state_ok"] is False and list(diag["signatures"]) == ["half_model"]
    assert "float16" in diag["signatures"]["half_model"]
    assert diag["warnings"][0].startswith("fp32-state check")


def test_loss_in_low_precision_overflows_the_scaled_loss(tmp_path):
    summary, train = _fit(
        tmp_path,
        "precision=fp16",
        "pitfall=loss_in_low_precision",
        "trainer.max_steps=4",
        "trainer.log_every=4",
    )
    assert "loss_in_low_precision" in summary["diagnostics"]["signatures"]
    # the backward enters the fp16 loss with the scale, 65536 > 65504: the first step overflows
    assert summary["diagnostics"]["scale_events"][0]["step"] == 1
    assert summary["diagnostics"]["nonfinite"]["first_step"] == 1


def test_fp32_modules_run_in_fp32_under_autocast(tmp_path):
    trainer = Trainer(
        build(settings(*TINY, "precision=fp16", "precision.fp32_modules=[head,*norm1]"), tmp_path)
    )
    dtypes = {}
    for name, module in trainer.run.model.named_modules():
        module.register_forward_hook(
            lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype)
        )
    trainer.run.train_step([_batch(trainer)])
    assert dtypes["head"] == dtypes["blocks.0.norm1"] == torch.float32
    assert dtypes["blocks.0.mlp.fc1"] == torch.float16  # the rest stays in autocast
    with pytest.raises(ConfigError, match=r"fp32_modules: 'haed' matches no module.*head"):
        Trainer(build(settings(*TINY, "precision.fp32_modules=[haed]"), tmp_path / "bad"))


@pytest.mark.slow
def test_fp32_modules_from_the_command_line(tmp_path):
    bad = run_cli(
        "model=test_vit",
        *TINY,
        "trainer.device=cpu",
        "hydra.run.dir=run",
        "precision.fp32_modules=[nothing_like_this]",
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("amp_lab: error: precision.fp32_modules: 'nothing_like_this' matches no module")
    )


@pytest.mark.parametrize(
    "mode",
    [
        ["precision=bf16_pure"],
        ["precision=fp16_pure"],
        ["precision=bf16_pure", "precision.master_weights=false"],
    ],
)
def test_pure_modes_are_not_the_half_model_pitfall(tmp_path, mode):
    """16-bit weights are what the pure modes are for; their optimizer steps fp32 masters (or,
    without them, the bf16 weights on purpose)."""
    summary, _ = _fit(tmp_path, *mode, "trainer.max_steps=2")
    assert summary["diagnostics"]["fp32_state_ok"] is True
    assert summary["diagnostics"]["signatures"] == {}


def test_the_masters_of_a_pure_mode_are_checked_for_fp32(tmp_path):
    trainer = Trainer(
        # audit=warn: the precision audit stops such a run; the diagnostics' view is under test
        build(settings(*TINY, "precision=bf16_pure", "trainer.max_steps=1", "audit=warn"), tmp_path)
    )
    optimizer, master = trainer.run.optimizer, trainer.run.train_step.params[0]

    def break_state(*_):  # an optimizer whose moments went 16-bit, as after a bad cast
        optimizer.state[master]["exp_avg"] = optimizer.state[master]["exp_avg"].bfloat16()

    optimizer.register_step_post_hook(break_state)
    summary = trainer.fit()
    assert (
        "optimizer exp_avg of master weight 0 (torch.bfloat16)"
        in summary["diagnostics"]["signatures"]["half_model"]
    )


@pytest.mark.parametrize("pitfall, misuse", [("none", False), ("no_scaler_update", True)])
def test_the_hysteresis_scaler_holding_its_scale_is_no_misuse(tmp_path, pitfall, misuse):
    """Every step overflows (init_scale 1e12): scaler.hysteresis=2 holds the scale on the first
    overflow of a run and backs off on the second, which no_scaler_update never does."""
    summary, _ = _fit(
        tmp_path,
        "precision=fp16",
        "scaler=hysteresis",
        "scaler.init_scale=1e12",
        "scaler.max_scale=1e12",
        f"pitfall={pitfall}",
        "trainer.max_steps=4",
        "trainer.log_every=4",
    )
    assert summary["skipped_steps"] == 4
    assert ("no_scaler_update" in summary["diagnostics"]["signatures"]) == misuse
