"""Every config group option composes into the typed schema; bad input fails with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import get_type_hints

import pytest
import yaml
from helpers import CONF_DIR, FAST, compose_cfg, leaves, run_cli, settings
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from amp_lab.build import build
from amp_lab.choices import Choice, DatasetName, DiagnosticsMode, PitfallName, PrecisionName
from amp_lab.config import AmpLabConfig, ConfigError, flat_settings
from amp_lab.diagnostics.pitfalls import VARIANTS
from amp_lab.errors import did_you_mean, schema_keys
from amp_lab.precision.modes import PRECISION_MODES
from amp_lab.trainer import Trainer

GROUPS = [
    "model",
    "data",
    "precision",
    "scaler",
    "lr",
    "optim",
    "trainer",
    "logger",
    "checkpoint",
    "diagnostics",
    "pitfall",
]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_into_the_schema(group, option, tmp_path):
    extra = [f"data.root={tmp_path}"] if group == "data" else []  # imagefolder needs one
    cfg = settings(f"{group}={option}", *extra, fast=False)
    assert isinstance(cfg, AmpLabConfig)
    node = getattr(cfg, group)
    if hasattr(node, "name"):
        # a model preset is named after its timm model (vit_small_patch4: vit_small, 4x4 patches),
        # a data preset after its data set (synthetic_imagenet: synthetic data, ImageNet's shape)
        family = node.name.split("_patch")[0]
        # a data recipe (imagenet_deit) extends the data set's option first in its defaults
        assert node.name in (option, _extends(group, option)) or (
            group in ("model", "data") and option.startswith(family)
        )


def test_every_group_has_options():
    for group in GROUPS:
        assert _options(group), group


def test_defaults_are_the_documented_ones():
    cfg = settings(fast=False)
    assert (cfg.model.name, cfg.data.name, cfg.precision.name) == (
        "test_convnext",
        "digits",
        "fp32",
    )
    assert (
        cfg.scaler.init_scale,
        cfg.scaler.growth_factor,
        cfg.scaler.backoff_factor,
        cfg.scaler.growth_interval,
        cfg.scaler.enabled,
    ) == (65536.0, 2.0, 0.5, 2000, None)


def test_the_users_command_sets_the_scale():
    cfg = settings("precision=fp16", "scaler.init_scale=32768")
    assert cfg.precision.name == "fp16" and cfg.scaler.init_scale == 32768.0


def test_model_kwargs_accept_new_keys():
    cfg = settings("+model.kwargs.drop_path_rate=0.1")
    assert cfg.model.kwargs["drop_path_rate"] == 0.1


@pytest.mark.parametrize(
    "override,message",
    [
        ("scaler.init_scale=0", "scaler.init_scale=0.0 must be finite and > 0"),
        ("scaler.growth_factor=1.0", "scaler.growth_factor=1.0 must be finite and > 1"),
        ("scaler.backoff_factor=1.5", "scaler.backoff_factor=1.5 must be between 0 and 1"),
        ("scaler.growth_interval=0", "scaler.growth_interval=0 must be >= 1"),
        ("trainer.batch_size=0", "trainer.batch_size=0 must be > 0"),
        ("lr.base=-1", "lr.base=-1.0 must be > 0"),
        ("lr.rule=cube", "lr.rule='cube' is unknown"),
        ("lr.schedule=exp", "lr.schedule='exp' is unknown"),
        ("data.name=mnist", "data.name='mnist' is unknown"),
        ("precision.name=fp17", "precision.name='fp17' is unknown; use one of fp32, tf32, fp16"),
        ("trainer.clip_mode=clip", "trainer.clip_mode='clip' is unknown; use one of norm, value"),
        ("diagnostics.mode=verbose", "diagnostics.mode='verbose' is unknown"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5 must be >= 0"),
        ("lr.step_every=-1", "lr.step_every=-1 must be >= 0"),
        ("trainer.target_acc=5", "trainer.target_acc=5.0 must be in [0, 1]"),
        (
            "+scaler.init_scal=1",
            "unknown setting scaler.init_scal; did you mean scaler.init_scale?",
        ),
        (
            "+trainer.max_step=3",
            "unknown setting trainer.max_step; did you mean trainer.max_steps?",
        ),
    ],
)
def test_invalid_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings(override)


def test_a_key_in_the_wrong_group_is_suggested_by_its_full_path():
    """Each setting typed under every other group is suggested back: alone where its name is
    its own, among the few that share it (name, enabled, tags) otherwise."""
    keys = schema_keys()
    groups = {key.partition(".")[0] for key in keys if "." in key}
    moved = 0
    for key in (k for k in keys if "." in k):
        name = key.partition(".")[2]
        sharing = sorted(k for k in keys if k.rpartition(".")[2] == name and k not in groups)
        for group in groups - {key.partition(".")[0]}:
            if f"{group}.{name}" not in keys:
                hint = did_you_mean(f"{group}.{name}")
                assert hint == f"; did you mean {' or '.join(sharing)}?", (key, group, hint)
                moved += 1
    assert moved > 2000  # every setting, in each group it is not in


@pytest.mark.parametrize(
    "typed,meant",
    [
        ("trainer.checkpoint_every", "checkpoint.every_steps"),  # renamed and moved
        ("trainer.every_steps", "checkpoint.every_steps"),
        ("health.bad_steps", "health.max_bad_steps"),
        ("scaler.init_scal", "scaler.init_scale"),  # a typo
        ("precison", "precision"),
    ],
)
def test_a_renamed_key_is_suggested_by_its_full_path(typed, meant):
    assert did_you_mean(typed) == f"; did you mean {meant}?"


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.name=resnet5", "did you mean resnet50"),
        ("optim.name=adamx", "optim.name='adamx' is unknown"),
        ("data=cifar10", "torchvision.datasets.CIFAR10('DIR', download=True)"),
        ("precision=tf32", "precision=tf32 needs an NVIDIA GPU"),
        ("trainer.batch_size=4096", "exceeds the 1438 training samples"),
        ("model=test_convnext", "model test_convnext cannot take 1x16x16 images"),
        (
            "data.img_size=10",
            "model test_vit cannot take 1x10x10 images (Input height (10) should "
            "be divisible by patch size (4).)",
        ),  # timm asserts it
    ],
)
def test_bad_inputs_fail_at_start_up(override, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(
            build(
                settings(override, "data.root=null" if "cifar" in override else "trainer.seed=0"),
                tmp_path,
            )
        )
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,expected",
    [
        (["model.name=resnet5"], "amp_lab: error: model.name='resnet5' is not a timm model"),
        (["precision=fp17"], "amp_lab: error: precision=fp17 is not an option of the precision"),
        (
            ["precision.name=fp17"],
            "amp_lab: error: precision.name='fp17' is unknown; use one of fp32",
        ),
        (["scaler.init_scale=-1"], "amp_lab: error: scaler.init_scale=-1.0 must be finite and > 0"),
        (["scaler.init_scal=3"], "did you mean scaler.init_scale?"),
        (["trainer.batch_size=abc"], "amp_lab: error: trainer.batch_size=abc is not a valid int"),
        (
            ["data=cifar10", "data.root=/nonexistent"],
            "amp_lab: error: data.root=/nonexistent is not",
        ),
    ],
)
def test_cli_errors_are_short_and_write_no_run(args, expected, tmp_path):
    result = run_cli(*args, "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_a_sweep_with_a_refused_job_runs_the_others_and_exits_2(tmp_path):
    folders = ["hydra.sweep.dir=sweep", "hydra.sweep.subdir=${hydra.job.num}"]
    result = run_cli("-m", "lr.base=1e-3,-1", *FAST, *folders, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "amp_lab: error: 1 sweep job(s) did not run: job 1: lr.base=-1.0 must be > 0"
    )
    assert "lr.base=-1.0 must be > 0" in result.stderr
    printed = result.stdout + result.stderr  # the sweep's end, as docs/sweeps.md shows it
    assert "amp_lab: sweep sweep: 2 job(s)" in printed
    assert "  0: completed, best val acc " in printed
    assert "  1: refused: lr.base=-1.0 must be > 0" in printed
    assert "next: amp_lab report sweep" in printed
    summary = json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())
    assert summary["status"] == "completed"
    # A relaunch into the same folder: only this launch's refusals count (not job 1's above),
    # also that of a job whose folder holds a finished run with other settings.
    result = run_cli("-m", "lr.base=1e-3", *FAST, *folders, "trainer.max_steps=8", cwd=tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("amp_lab: error: 1 sweep job(s) did not run: job 0: ")
    assert "holds a finished run with other settings: trainer.max_steps 6 -> 8" in last


@pytest.mark.slow
def test_help_lists_the_groups(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for group in GROUPS:
        assert f"{group}:" in result.stdout
    assert "scaler.init_scale=32768" in result.stdout


@pytest.mark.slow
def test_the_installed_command_runs_from_any_directory_and_names_the_tools(tmp_path):
    command = Path(sys.executable).with_name("amp_lab")  # the venv's console script
    result = subprocess.run(
        [str(command), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "Config groups" in result.stdout
    result = subprocess.run(
        [str(command), "doctor", "--steps", "2", "precision=fp16"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2  # the doctor itself answered, in one line
    assert (
        result.stderr.strip() == "amp_lab: error: --steps=2 is too short to compare curves; "
        "use >= 4"
    )
    result = subprocess.run(
        [str(command), "reprot", "multirun"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr.strip() == (
        "amp_lab: error: unknown command 'reprot'; did you mean report? (commands: doctor, "
        "report, bench, audit, numerics; anything else is key=value overrides)"
    )


def test_compose_keeps_output_out_of_the_repo():
    cfg = compose_cfg()
    assert "hydra" not in cfg  # the task sees only amp_lab's own keys


def test_option_files_hold_only_what_differs_from_the_schema():
    """config.py is the single source of the defaults: no option file repeats one. (accum/
    options are not a group's: each states its whole batch split, since it applies on top of
    a study's own batch size.)"""
    defaults = leaves(OmegaConf.to_container(OmegaConf.structured(AmpLabConfig)))
    repeated, checked = [], 0
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
            for key, value in leaves(raw, group).items():
                checked += 1
                if key in defaults and defaults[key] == value:
                    repeated.append(f"{group}/{path.name}: {key}={value}")
    assert checked > 40 and repeated == []


CHOICES = {
    f"{group.name}.{f.name}": hint
    for group in fields(AmpLabConfig)
    if is_dataclass(group.default_factory)
    for f in fields(group.default_factory)
    if isinstance(hint := get_type_hints(group.default_factory)[f.name], type)
    and issubclass(hint, Choice)
}


def test_the_choice_fields_are_enums():
    assert set(CHOICES) == {
        "data.name",
        "precision.name",
        "precision.update_rounding",
        "precision.fp8_recipe",
        "scaler.kind",
        "lr.rule",
        "lr.warmup_type",
        "lr.schedule",
        "trainer.device",
        "trainer.clip_mode",
        "trainer.strategy",
        "logger.mode",
        "diagnostics.mode",
        "audit.mode",
        "pitfall.name",
        "data.interpolation",
        "data.re_mode",
        "data.mixup_mode",
        "fsdp.param_dtype",
        "fsdp.reduce_dtype",
        "data.decode",
    }


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_choice_field_refuses_an_unknown_value_at_compose(key):
    names = ", ".join(c.value for c in CHOICES[key])
    with pytest.raises(HydraException):  # Hydra's compose refuses it already
        compose_cfg(f"{key}=bogus")
    with pytest.raises(
        ConfigError, match=re.escape(f"{key}='bogus' is unknown; use one of {names}")
    ) as err:
        settings(f"{key}=bogus")
    assert "\n" not in str(err.value)  # the lab's tools say so in one line


def test_choices_match_the_mode_table_and_the_option_files():
    assert list(PrecisionName) == list(PRECISION_MODES)
    assert set(PitfallName) == set(VARIANTS)
    for group, choice in [
        ("precision", PrecisionName),
        ("pitfall", PitfallName),
        ("diagnostics", DiagnosticsMode),
        ("data", DatasetName),
    ]:
        # a preset may reshape a data set (synthetic_imagenet: synthetic data, ImageNet's shape)
        presets = {
            o
            for o in _options(group)
            if group == "data" and compose_cfg(f"data={o}").data.name != o
        }
        assert set(_options(group)) - presets == {c.value for c in choice}, group


def _extends(group: str, option: str) -> str | None:
    """The option of its own group that `option` lists first in its defaults (a data recipe
    such as imagenet_deit extends imagefolder), or None."""
    first = (yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}).get(
        "defaults", [None]
    )[0]
    return first if first in _options(group) else None


def test_choices_are_plain_strings_in_every_record():
    """Code compares `cfg.precision.name == "fp16"`; summaries, W&B and the report read
    plain strings."""
    cfg = settings("precision=fp16", "scaler=hysteresis", "diagnostics=off")
    assert cfg.precision.name == "fp16" and {"fp16": 1}[cfg.precision.name] == 1
    assert f"{cfg.precision.name}/{cfg.scaler.kind}" == "fp16/hysteresis"
    assert json.loads(json.dumps(asdict(cfg)))["diagnostics"]["mode"] == "off"
    assert (
        type(
            OmegaConf.to_container(compose_cfg("precision=fp16"), enum_to_str=True)["precision"][
                "name"
            ]
        )
        is str
    )
    assert "name: fp16\n" in OmegaConf.to_yaml(compose_cfg("precision=fp16"))  # .hydra/


def test_hydra_settings_live_in_conf_hydra():
    assert list(OmegaConf.load(CONF_DIR / "config.yaml")) == ["defaults"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra = compose("config", return_hydra_config=True).hydra
    assert hydra.callbacks.skipped_jobs._target_ == "amp_lab.sweeps.jobs.SkippedJobs"
    assert OmegaConf.to_container(hydra.sweep)["subdir"] == (
        "${hydra.job.num}_${hydra.job.override_dirname}"
    )  # job dirs named by their overrides
    assert list(hydra.job.config.override_dirname.exclude_keys) == [
        "hydra/launcher",
        "trainer.device",
    ]


def test_the_configuration_reference_is_the_schema():
    """docs/configuration.md holds every key of the schema with its default and its comment,
    as written from the schema: a new key without its entry, or a changed default, fails here."""
    from helpers.config_doc import PAGE, configuration_markdown

    expected = configuration_markdown()
    if os.environ.get("UPDATE_DOCS"):
        PAGE.write_text(expected)
    assert PAGE.read_text() == expected, "run UPDATE_DOCS=1 python -m pytest tests/test_config.py"
    for key in flat_settings(AmpLabConfig()):  # trainer.ema: its keys, trainer.ema.decay, ...
        assert f"| `{key}" in expected, key
