"""The studies in experiments/: each config and each sweep job composes; one CPU study runs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import CONF_DIR, ROOT, compose_cfg, leaves, run_cli
from helpers.distributed import as_rank, free_port, torchrun
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from amp_lab.build import build
from amp_lab.compose import validate
from amp_lab.config import flat_settings
from amp_lab.tools.report.compare import main as report_main
from amp_lab.trainer import Trainer

_OVERRIDES = OverridesParser.create()
STUDIES = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def _sweep_jobs(experiment: str) -> list[list[str]]:
    """The overrides of each job the study's `hydra.sweeper.params` grid expands to."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        sweeper = compose("config", [experiment], return_hydra_config=True).hydra.sweeper
    per = sweeper.get("study_per")  # a search: a study per value of these keys, the rest drawn
    params = _OVERRIDES.parse_overrides([f"{k}={v}" for k, v in sweeper.params.items()])
    axes = [  # the key as the study writes it: `+noop` adds a group
        [f"{key}={v}" for v in o.sweep_string_iterator()]
        for key, o in zip(sweeper.params, params)
        if per is None or o.key_or_group in per
    ]
    return [list(job) for job in itertools.product(*axes)]


def _job_count(experiment: str) -> int:
    """The runs a study launches: one per grid point, or n_trials per study of a search."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        sweeper = compose("config", [experiment], return_hydra_config=True).hydra.sweeper
    return len(_sweep_jobs(experiment)) * sweeper.get("n_trials", 1)


def _distinct_builds(experiment: str) -> list[list[str]]:
    """The study's jobs less those that differ from an earlier one by the seed alone (the seed
    builds nothing differently)."""
    seen: set[tuple[str, ...]] = set()
    jobs = []
    for job in _sweep_jobs(experiment):
        key = tuple(o for o in job if not o.startswith("trainer.seed="))
        if key not in seen:
            seen.add(key)
            jobs.append(job)
    return jobs


def test_the_studies_are_there_with_readme_and_cpu_variant():
    assert STUDIES == [
        "attention_logits",
        "beyond_autocast",
        "fp16_lr_warmup",
        "fsdp_precision",
        "grad_accum",
        "lr_per_precision",
        "optimizer_state",
        "precision_modes",
        "pure_bf16_updates",
        "recipe_precision",
        "scaler_grid",
        "silent_noops",
    ]
    index = (ROOT / "experiments" / "README.md").read_text()
    for study in STUDIES:
        assert (CONF_DIR / "experiment" / "cpu" / f"{study}.yaml").is_file()
        readme = (ROOT / "experiments" / study / "README.md").read_text()
        assert f"experiment={study}" in readme and f"+experiment/cpu={study}" in readme
        assert study in index


@pytest.mark.slow  # composes all 14 study configs: ~10 s
def test_the_index_gives_each_study_its_job_counts_and_the_cpu_variants_three_seeds():
    rows = {
        line.split("](")[0].strip("| ["): line
        for line in (ROOT / "experiments" / "README.md").read_text().splitlines()
        if line.startswith("| [")
    }
    for study in STUDIES:
        gpu, cpu = _job_count(f"experiment={study}"), _job_count(f"+experiment/cpu={study}")
        assert rows[study].endswith(f"| {gpu} / {cpu} |"), study
        cpu_jobs = _sweep_jobs(f"+experiment/cpu={study}")
        assert {o for job in cpu_jobs for o in job if o.startswith("trainer.seed=")} == {
            "trainer.seed=0",
            "trainer.seed=1",
            "trainer.seed=2",
        }, study


@pytest.mark.slow
@pytest.mark.parametrize(
    "experiment", [f"experiment={s}" for s in STUDIES] + [f"+experiment/cpu={s}" for s in STUDIES]
)
def test_every_job_of_every_study_composes(experiment):
    jobs = _sweep_jobs(experiment)
    assert len(jobs) >= 4  # a grid, not a single run
    seeds: dict[tuple[str, ...], list[str]] = {}  # the jobs by what they build: their seeds
    for job in jobs:
        key = tuple(o for o in job if not o.startswith("trainer.seed="))
        seeds.setdefault(key, []).extend(o for o in job if o.startswith("trainer.seed="))
    for key, seed_overrides in seeds.items():
        # composed once per build; each job's seed (a leaf nothing is derived from) then set as
        # Hydra's override parser types it, and the job validated whole
        cfg = compose_cfg(experiment, *key, fast=False)
        for seed in seed_overrides or [None]:
            if seed:
                OmegaConf.update(cfg, "trainer.seed", _OVERRIDES.parse_overrides([seed])[0].value())
            settings = validate(cfg)
            assert settings.tags[0] in experiment
            if seed:
                assert f"trainer.seed={settings.trainer.seed}" == seed
            if "cpu" in experiment:
                assert settings.trainer.device == "cpu" and settings.trainer.max_steps <= 60
        keys = flat_settings(settings)
        for axis in (settings.report.by or "precision").split(","):  # the report's --by
            assert any(k == axis or k.startswith(f"{axis}.") for k in keys), axis


def _build_on_two_ranks(rank: int, port: int, experiment: str, out: str) -> None:
    """mp.spawn worker: each job built in one gloo world of two ranks, as torchrun runs them."""
    as_rank(rank, port)
    torch.set_num_threads(1)
    for i, job in enumerate(_distinct_builds(experiment)):  # the first job's group serves all
        Trainer(build(validate(compose_cfg(experiment, *job, fast=False)), Path(out) / str(i)))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("study", STUDIES)
def test_every_job_of_every_cpu_study_builds(study, tmp_path):
    """Each job's model takes its images and its mode runs here: the CPU variants are what a
    user without a GPU runs first (a study of DDP/FSDP jobs on two gloo ranks, as it runs)."""
    experiment = f"+experiment/cpu={study}"
    jobs = [validate(compose_cfg(experiment, *j, fast=False)) for j in _distinct_builds(experiment)]
    if any(job.trainer.strategy != "single" for job in jobs):
        mp.spawn(_build_on_two_ranks, (free_port(), experiment, str(tmp_path)), nprocs=2)
        return
    for i, job in enumerate(jobs):
        Trainer(build(job, tmp_path / str(i)))


@pytest.mark.slow
def test_grad_accum_study_keeps_the_global_batch():
    for experiment in ["experiment=grad_accum", "+experiment/cpu=grad_accum"]:
        trainers = [
            validate(compose_cfg(experiment, *job, fast=False)).trainer
            for job in _sweep_jobs(experiment)
        ]
        assert len({t.batch_size * t.grad_accum for t in trainers}) == 1
        assert len({t.grad_accum for t in trainers}) == 3


def test_experiments_are_found_from_any_working_directory(tmp_path):
    result = run_cli("experiment=precision_modes", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tags:\n- precision_modes" in result.stdout and "name: cifar10" in result.stdout


@pytest.mark.slow
def test_a_cpu_study_sweep_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_cli(
        "-m",
        "+experiment/cpu=fp16_lr_warmup",
        "trainer.seed=0",  # one seed of the study's three: the command line wins over its axis
        "trainer.max_steps=10",
        "trainer.eval_every=0",
        "data.val_fraction=0.05",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("sweep/*/summary.json"))]
    assert len(summaries) == 4
    assert {(s["lr"]["scale"], s["lr"]["warmup_steps"]) for s in summaries} == {
        (1.0, 0),
        (1.0, 15),
        (0.5, 0),
        (0.5, 15),
    }
    assert all(s["status"] == "completed" and s["precision"]["name"] == "fp16" for s in summaries)
    # the sweep's next step, as it prints it: the report, with no options (the study names its axis)
    assert "next: amp_lab report sweep\n" in result.stderr
    assert report_main([str(tmp_path / "sweep")]) == 0
    data = json.loads((tmp_path / "sweep" / "report" / "report.json").read_text())
    assert data["axis"] == "lr.warmup_steps"
    assert [sorted(c["value"] for c in g["cells"]) for g in data["groups"]] == [["0", "15"]] * 2


def test_the_cpu_studies_share_one_base_and_copy_none_of_it():
    base = OmegaConf.load(CONF_DIR / "cpu_study.yaml")
    shared = {
        k: v
        for k, v in leaves(OmegaConf.to_container(base)).items()
        if not k.startswith("defaults")
    }
    for study in STUDIES:
        raw = OmegaConf.to_container(
            OmegaConf.load(CONF_DIR / "experiment" / "cpu" / f"{study}.yaml")
        )
        assert raw["defaults"][0] == "/cpu_study", study  # first: the study's lines win
        copied = [k for k, v in leaves(raw).items() if shared.get(k) == v]
        assert copied == [], study
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", [f"+experiment/cpu={study}"], return_hydra_config=True)
        assert (
            cfg.data.name,
            cfg.trainer.device,
            cfg.trainer.progress,
            cfg.checkpoint.every_minutes,
        ) == ("digits", "cpu", False, 0)
        assert "experiment/cpu" in cfg.hydra.job.config.override_dirname.exclude_keys


@pytest.mark.slow
def test_the_cpu_studies_vit_learns_digits_in_60_steps_where_4x4_patches_stay_near_chance(
    tmp_path,
):
    """Why the CPU studies train test_vit_patch8: 4 tokens of 8x8 px learn 16x16 digits within
    the 60 steps, 16 tokens of 4x4 px (test_vit) do not; fp32, seed 0, the studies' settings."""
    accs = {}
    for model in ("test_vit_patch8", "test_vit"):
        overrides = ["+experiment/cpu=scaler_grid", "precision=fp32", f"model={model}"]
        summary = Trainer(
            build(validate(compose_cfg(*overrides, fast=False)), tmp_path / model)
        ).fit()
        accs[model] = summary["final_val_acc"]
    assert accs["test_vit_patch8"] > 0.6 and accs["test_vit"] < 0.3, accs


@pytest.mark.slow
def test_the_fsdp_study_sweeps_under_torchrun_one_group_per_job(tmp_path):
    """Each rank runs every job of the sweep and joins one process group per job; FSDP's fp32
    policy trains as DDP does, step by step (the study's first finding)."""
    result = torchrun(
        "-m",
        "+experiment/cpu=fsdp_precision",
        "precision=fp32",
        "+parallel=ddp,fsdp,fsdp_reduce_bf16",
        "trainer.seed=0",
        "trainer.max_steps=10",
        "trainer.log_every=2",
        "trainer.eval_every=0",
        "logger=disabled",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {}
    for run in sorted((tmp_path / "sweep").glob("[0-9]_*")):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r["train/loss"] for r in rows if r["kind"] == "train"]
        losses[run.name.split("=")[1].split(",")[0]] = train
    assert list(losses) == ["ddp", "fsdp", "fsdp_reduce_bf16"] and len(losses["ddp"]) == 5
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)
    assert losses["fsdp_reduce_bf16"] != losses["ddp"]  # the bf16 reduction is really used
