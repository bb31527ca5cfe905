"""trainer.compile: off | model (true) | step, and the compiled step's GradScaler skip."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import settings

from amp_lab.build import build
from amp_lab.choices import CompileMode
from amp_lab.components.compile import compile_optimizer_step
from amp_lab.config import ConfigError
from amp_lab.trainer import Trainer


def test_old_true_false_still_mean_model_and_off():
    for value, mode in [("true", "model"), ("false", "off"), ("step", "step"), ("off", "off")]:
        assert settings(f"trainer.compile={value}").trainer.compile == CompileMode(mode)
    assert settings().trainer.compile == CompileMode.off
    with pytest.raises(ConfigError, match="trainer.compile=fast is not one of off, model, step"):
        settings("trainer.compile=fast")


def test_unknown_backend_and_non_torch_optimizer_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="trainer.compile_backend=nope is not a torch.compile"):
        Trainer(build(settings("trainer.compile=model", "trainer.compile_backend=nope"), tmp_path))
    # timm's lamb takes no tensor LR
    with pytest.raises(ConfigError, match="compile=step compiles torch.optim's optimizers"):
        Trainer(build(settings("trainer.compile=step", "optim.name=lamb"), tmp_path))
    with pytest.raises(ConfigError, match="optim.fused=true keeps its fused kernel"):
        Trainer(build(settings("trainer.compile=step", "optim.fused=true"), tmp_path))


def test_a_compiled_step_takes_a_tensor_lr_the_schedule_moves_without_recompiling():
    """A float LR is a constant of the graph: each new value would compile the step again."""
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    compile_optimizer_step(optimizer, "eager")
    lr = optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.item() == pytest.approx(0.1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()  # a recompile would raise
            schedule.step()
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1 / 5)


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_compiled_step_skips_an_inf_update_and_backs_off_the_scale(tmp_path):
    """compile=step on CPU (aot_eager: dynamo and AOTAutograd trace the model and the optimizer
    step, without inductor's C++ build): a step with an injected inf gradient leaves weights,
    moments and step counts exactly as one step less left them, and halves the scale; the
    schedule moves the tensor LR."""
    run = [
        "precision=fp16",
        "scaler.init_scale=1024",
        "trainer.log_every=1",
        "trainer.compile=step",
        "trainer.compile_backend=aot_eager",
    ]
    runs = {}
    for name, extra in [
        ("one", ["trainer.max_steps=1"]),
        ("skip", ["trainer.max_steps=2", "fault.inf_grad_at_step=2"]),
    ]:
        torch._dynamo.reset()  # each run compiles its own model and optimizer afresh
        runs[name] = build(settings(*run, *extra), tmp_path / name)
        Trainer(runs[name]).fit()
    one, skip = runs["one"], runs["skip"]
    assert hasattr(skip.optimizer.step, "_torchdynamo_orig_callable")  # a compiled step
    rows = _rows(tmp_path / "skip")
    assert [r["amp/skipped_steps"] for r in rows] == [0, 1]
    assert [r["amp/loss_scale"] for r in rows] == [1024.0, 512.0]
    for a, b in zip(one.model.parameters(), skip.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(one.optimizer.state.values(), skip.optimizer.state.values()):
        assert a["step"] == b["step"] == 1
        assert torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    lr = skip.optimizer.param_groups[0]["lr"]  # the schedule moved the tensor LR
    assert torch.is_tensor(lr) and lr.item() == pytest.approx(skip.scheduler.get_last_lr()[0])
    assert lr.item() != pytest.approx(skip.peak_lr)
