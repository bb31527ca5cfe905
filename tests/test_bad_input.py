"""Every bad input a user types is one line on stderr, exit code 2, no traceback, nothing lost.

Hydra's own errors (an unknown group option, an unparsable value, an unknown key, a broken
override) and amp_lab's start-up checks read alike; the table covers every config group.
"""

from __future__ import annotations

import json

import pytest
from helpers import FAST, run_cli

BAD_INPUTS = [
    # (overrides, what the one line must say); Hydra's errors first: no run starts
    (
        ["model=vit_nope"],
        "model=vit_nope is not an option of the model group; options: convnext_tiny,",
    ),
    (["data=synth"], "did you mean data=synthetic?"),
    (["precision=fp17"], "did you mean precision=fp16? options: bf16, bf16_pure, fp16,"),
    (["scaler=dynamc"], "did you mean scaler=dynamic?"),
    (["optim=adamx"], "did you mean optim=adamw?"),
    (["lr=cosine"], "lr=cosine is not an option of the lr group; options: default"),
    (["diagnostics=fulll"], "did you mean diagnostics=full?"),
    (["pitfall=half"], "did you mean pitfall=half_model?"),
    (["audit=stp"], "did you mean audit=stop? options: off, stop, warn"),
    (["+accum=b64x3"], "accum=b64x3 is not an option of the accum group"),
    (["accum=b64x4"], "accum is an optional group: choose it with +accum=OPTION (options: b16x4,"),
    (["experiment=scaler_grd"], "did you mean experiment=scaler_grid?"),
    (["+recipe=deit3"], "recipe=deit3 is not an option of the recipe group"),
    (["+search=lrr"], "search=lrr is not an option of the search group; did you mean search=lr?"),
    (["+updates=nearst"], "updates=nearst is not an option of the updates group; did you mean"),
    (["+noop=eps_fp17"], "noop=eps_fp17 is not an option of the noop group; did you mean"),
    (["+parallel=fsdp_bf16"], "parallel=fsdp_bf16 is not an option of the parallel group"),
    (["logger=offline"], "logger=offline is not an option of the logger group"),
    (["hydra/launcher=submitit_slrum"], "did you mean hydra/launcher=submitit_slurm?"),
    (["precision=null"], "precision=null leaves the precision group empty; choose one of: bf16,"),
    (["data.img_size=abc"], "data.img_size=abc is not a valid int"),
    (["lr.base=1e"], "lr.base=1e is not a valid float"),
    (["trainer.progress=maybe"], "trainer.progress=maybe is not a valid bool"),
    (["checkpoint.every_steps=often"], "checkpoint.every_steps=often is not a valid int"),
    (["scaler.init_scal=1"], "unknown setting scaler.init_scal; did you mean scaler.init_scale?"),
    (["+scaler.init_scal=1"], "unknown setting scaler.init_scal; did you mean scaler.init_scale?"),
    (["trainer.max_step=5"], "did you mean trainer.max_steps?"),
    (["fault.inf_grad_at=3"], "did you mean fault.inf_grad_at_step?"),
    (["trainer.max_bad_steps=5"], "trainer.max_bad_steps; did you mean health.max_bad_steps?"),
    (["trainer.checkpoint_every=50"], "did you mean checkpoint.every_steps?"),
    (
        ["optim.kwargs.betas=[0.9,0.95]"],
        "optim.kwargs is free-form: add a key to it with +optim.kwargs.betas=VALUE",
    ),
    (["trainer.max_steps=[1"], "cannot parse the override 'trainer.max_steps=[1'"),
    # amp_lab's own start-up checks (these build the run, so they import torch)
    (["trainer.max_steps=-1"], "trainer.max_steps=-1 must be >= 0"),
    (["logger.mode=onlin"], "logger.mode='onlin' is unknown; use one of offline, online, disabled"),
    (["model.name=resnet5"], "model.name='resnet5' is not a timm model"),
    (["fsdp.reduce_dtype=int8"], "fsdp.reduce_dtype='int8' is unknown; use one of auto, fp32,"),
    (["trainer.strategy=fsdp"], "trainer.strategy=fsdp needs a distributed launch: torchrun"),
    (["trainer.compile=fast"], "trainer.compile=fast is not one of off, model, step"),
    (["precision=bf16", "pitfall=half_model"], "precision=bf16 on the CPU feeds the fp16 weights"),
    (["precision=bf16_pure", "pitfall=half_model"], "which undoes model.half(); use precision="),
    (
        ["precision=fp8", "precision.fp8_emulate=true", "precision.fp32_modules=[stages]"],
        "precision=fp8 converted no Linear layer of this model (each is its classifier, in",
    ),
    (
        ["precision=fp16", "pitfall=half_model", "precision.fp32_modules=[head]"],
        "precision.fp32_modules=[head] cannot run in fp32 over model.half()'s fp16 weights",
    ),
]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("amp_lab: error: ")
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


# the settings are checked before torch loads (about a second each); a model name is checked
# against timm's registry, which imports torch: seconds, slow tier
TORCH_CHECKS = {"model.name=resnet5", "precision=fp8"}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(o, e, id=" ".join(o), marks=pytest.mark.slow if o[0] in TORCH_CHECKS else ())
        for o, e in BAD_INPUTS
    ],
)
def test_a_bad_input_is_one_line_and_exit_2(overrides, expected, tmp_path):
    result = run_cli(*overrides, "hydra.run.dir=run", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert expected in _one_error_line(result.stderr)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_groups_covered():
    """The table names every config group and the launcher."""
    from amp_lab.config import CONF_DIR

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"}
    named = {
        o.lstrip("+").split("=")[0].split(".")[0] for overrides, _ in BAD_INPUTS for o in overrides
    }
    assert groups <= named, groups - named
    assert "hydra/launcher" in named


def test_a_bad_sweep_value_is_one_line(tmp_path):
    result = run_cli("-m", "precision=fp32,fp17", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2
    assert "precision=fp17 is not an option" in _one_error_line(result.stderr)


@pytest.mark.slow
def test_a_bad_input_loses_nothing_already_written(tmp_path):
    """A typo on a relaunch into a finished run's folder leaves its results as they were."""
    assert (
        run_cli(*FAST, "checkpoint.every_steps=2", "hydra.run.dir=run", cwd=tmp_path).returncode
        == 0
    )
    run = tmp_path / "run"
    kept = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    for typo in ("trainer.max_steps=ten", "trainer.max_steps=-1"):
        result = run_cli(*FAST, "checkpoint.every_steps=2", typo, "hydra.run.dir=run", cwd=tmp_path)
        assert result.returncode == 2
        _one_error_line(result.stderr)
    assert {p: p.read_bytes() for p in kept} == kept
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_every_checkpoint_corrupt_is_one_short_line(tmp_path):
    """torch explains a corrupt file in a paragraph; the line keeps its first sentence."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for step in (2, 4, 6):
        (checkpoints / f"step_{step:09d}.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    result = run_cli(*FAST, "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert line.count("step_0000000") == 3 and "trainer.resume=false" in line
    assert "If you are seeing this error" not in line
