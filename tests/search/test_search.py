"""The search sweeper (`+search=lr`, hydra_plugins/amp_lab_search/): real CPU searches with real
configs and tiny runs, hydra-optuna-sweeper's test cases among them; the journal in the sweep
folder (or the storage named) read back with Optuna, as a user would.

A trial enqueued into a study before the search starts (Optuna's own way to say "try this
first") injects diverging LRs and a hopeless one, so the outcomes do not hang on the sampler.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers import ROOT, run_cli
from omegaconf import OmegaConf

from amp_lab.search.study import JOB_DIR, RESULT, storage

pytestmark = pytest.mark.slow
TINY = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "trainer.device=cpu",
    "trainer.progress=false",
    "logger=disabled",
    "trainer.max_steps=12",
    "trainer.eval_every=4",
    "lr.warmup_steps=int(interval(0, 4))",
]
DIVERGES, SANE, HOPELESS = 1e30, 3e-3, 1e-7  # lr.base: NaN at once, learns, learns nothing


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _enqueue(sweep: Path, study: str, *lrs: float) -> None:
    sweep.mkdir(parents=True, exist_ok=True)
    created = optuna.create_study(study_name=study, storage=storage(sweep))
    for lr in lrs:
        created.enqueue_trial({"lr.base": lr, "lr.warmup_steps": 0})


def _trials(sweep: Path, study: str, url: str | None = None) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=storage(sweep, url)).trials


@pytest.fixture(scope="module")
def search(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One study per precision, fp32 and bf16, 4 trials each, half of which diverge: fp32's are
    a sane LR, one that diverges, one too small to learn (the pruner stops it at its first
    evaluation) and another that diverges; bf16's first two diverge."""
    tmp = tmp_path_factory.mktemp("search")
    sweep = tmp / "sweep"
    _enqueue(sweep, "precision=fp32", SANE, DIVERGES, HOPELESS, DIVERGES)
    _enqueue(sweep, "precision=bf16", DIVERGES, DIVERGES)
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32,bf16",
        "hydra.sweeper.study_per=[precision]",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.pruner.n_startup_trials=1",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp,
    )
    return sweep, result


def test_a_search_runs_a_study_per_precision_and_a_diverged_trial_is_pruned(search):
    sweep, result = search
    assert result.returncode == 0, result.stderr[-3000:]
    fp32 = _trials(sweep, "precision=fp32")
    assert [t.state.name for t in fp32] == ["COMPLETE", "PRUNED", "PRUNED", "PRUNED"]
    good, diverged, hopeless, _ = fp32
    # reported its NaN loss, which Optuna's pruner stops: ranked last by the sampler, not lost
    assert diverged.user_attrs[RESULT] == "diverged: pruned by the search at step 4 (val/loss nan)"
    assert math.isnan(diverged.intermediate_values[4]) and diverged.value is None
    assert hopeless.user_attrs[RESULT].startswith("pruned by the search at step 4 (val/loss 2.")
    summary = json.loads((sweep / good.user_attrs[JOB_DIR] / "summary.json").read_text())
    assert good.value == summary["final_val_loss"] and summary["precision"]["name"] == "fp32"
    bf16 = _trials(sweep, "precision=bf16")
    assert [t.user_attrs[RESULT].split(":")[0] for t in bf16[:2]] == ["diverged", "diverged"]
    assert all(t.state.name in {"COMPLETE", "PRUNED"} for t in bf16[2:])
    for t in bf16:  # each trial an ordinary run folder with the drawn settings
        overrides = (sweep / t.user_attrs[JOB_DIR] / ".hydra" / "overrides.yaml").read_text()
        assert f"lr.base={t.params['lr.base']:.4g}" in overrides and "precision=bf16" in overrides
    assert (
        "amp_lab: search precision=fp32: best lr.base=0.003, lr.warmup_steps=0: " in result.stderr
    )
    assert "(trial 0; 4 trials: 1 completed, 2 diverged, 1 pruned)" in result.stderr


def test_a_search_writes_hydras_optimization_results(search):
    sweep, _ = search
    found = OmegaConf.load(sweep / "optimization_results.yaml")
    assert found.name == "optuna" and set(found.studies) == {"precision=fp32", "precision=bf16"}
    best = optuna.load_study(study_name="precision=fp32", storage=storage(sweep)).best_trial
    assert found.studies["precision=fp32"] == {
        "best_params": {"lr.base": SANE, "lr.warmup_steps": 0},
        "best_value": best.value,
    }


def test_the_report_reads_a_search_and_its_command_searches_the_same_space(search, tmp_path):
    sweep, _ = search
    result = run_cli("report", str(sweep), "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    studies = {s["precision"]: s for s in data["studies"]}
    fp32, bf16 = studies["fp32"], studies["bf16"]
    assert (fp32["trials"], fp32["completed"], fp32["diverged"], fp32["pruned"]) == (4, 1, 2, 1)
    assert fp32["best"]["lr"] == SANE and fp32["lr_ratio"] == 1.0
    assert bf16["lr_ratio"] == pytest.approx(bf16["best"]["lr"] / SANE)
    done = [r for r in bf16["rows"] if r["state"] == "COMPLETE"]
    assert bf16["best"]["val_loss"] == min(r["val_loss"] for r in done)
    near = [r["lr"] for r in done if r["val_loss"] <= 1.01 * bf16["best"]["val_loss"]]
    assert bf16["near_best_lr"] == [min(near), max(near)]
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| precision=fp32 | 4 (1 ok, 1 pruned, 2 diverged) | 0.003 | 0 |" in report
    assert (tmp_path / "report" / "search.png").stat().st_size > 10_000
    assert "best lr.base" in result.stdout and "× fp32 LR" in result.stdout
    for axis in (["--by", "optim.weight_decay"], ["--ref", "fp32"]):  # no comparison of runs
        refused = run_cli("report", str(sweep), *axis, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert (
            f"{sweep} is an LR search: its report compares each study's best LR" in refused.stderr
        )

    # "Made with": the search's own settings included, so that the command searches again
    [command] = data["context"]["commands"]
    assert "hydra.sweeper.n_trials=4" in command and "hydra.sweep.dir" not in command
    assert command in report
    again = tmp_path / "again"
    args = shlex.split(command)[3:]  # after `python -m amp_lab`
    assert run_cli(*args, f"hydra.sweep.dir={again}", cwd=tmp_path).returncode == 0
    for study in ("precision=fp32", "precision=bf16"):
        first, rerun = _trials(sweep, study), _trials(again, study)
        assert len(rerun) == len(first) == 4
        assert rerun[0].distributions == first[-1].distributions  # the same space, drawn anew


def test_a_search_whose_every_trial_diverges_ends_with_one_verdict_line(tmp_path):
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32",
        "hydra.sweeper.n_trials=2",
        "lr.base=tag(log, interval(1e29, 1e30))",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *TINY,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("amp_lab: search ")]
    assert line.startswith(
        "amp_lab: search all: no trial of 2 finished with a finite final_val_loss (2 diverged): "
        "no best setting; lower the searched ranges' upper bounds"
    )


@pytest.mark.parametrize("max_failure_rate", [0.5, 1.0])
def test_crashed_trials_stop_the_search_past_max_failure_rate(max_failure_rate, tmp_path):
    """Hydra's test_failure_rate: every trial crashes (AdamW takes no `bogus`); past the rate
    the sweep stops after the first round with one line naming the crash, else the verdict
    does."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "+search=lr",
        "+optim.kwargs.bogus=1",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        f"hydra.sweeper.max_failure_rate={max_failure_rate}",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp_path,
    )
    crash = "crashed: TypeError: AdamW.__init__() got an unexpected keyword argument 'bogus'"
    trials = _trials(sweep, "all")
    assert all(t.state.name == "FAIL" and t.user_attrs[RESULT] == crash for t in trials)
    if max_failure_rate < 1:
        assert result.returncode == 2 and len(trials) == 2
        [line] = result.stderr.splitlines()
        assert line.startswith(f"amp_lab: error: trial 0 of all {crash} ({sweep}/0_")
        assert (
            "2 of the round's 2 trials failed, more than hydra.sweeper.max_failure_rate=0.5" in line
        )
    else:
        assert result.returncode == 0 and len(trials) == 4, result.stderr[-3000:]
        [line] = [x for x in result.stderr.splitlines() if x.startswith("amp_lab: search ")]
        assert line.endswith(f"(4 crashed): no best setting; trial 0 {crash}: fix that first")
        found = OmegaConf.load(sweep / "optimization_results.yaml")
        assert found.best_params is None and found.best_value is None


CUSTOM = """
def evaluations(cfg, trial):
    trial.suggest_int("trainer.eval_every", 2, 4)
"""


def test_hydras_settings_storage_study_name_sampler_objective_and_a_custom_space(tmp_path):
    """hydra-optuna-sweeper's example as its users type it: an sqlite storage and a study name
    (resumed by the same command with more trials), a seeded random sampler, a categorical
    dimension fixed by the command line, the objective maximized, a custom search space."""
    (tmp_path / "space.py").write_text(CUSTOM)  # importable: python -m runs from the cwd
    url = f"sqlite:///{tmp_path / 'test.db'}"
    args = [
        "-m",
        "+search=lr",
        f"hydra.sweeper.storage={url}",
        "hydra.sweeper.study_name=lr-search",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=123",
        "hydra.sweeper.objective=best_val_acc",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.custom_search_space=space.evaluations",
        "optim=choice(adamw,sgd)",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *TINY,
        "lr.warmup_steps=0",  # fixed: leaves the space
    ]
    result = run_cli(*args, "hydra.sweeper.n_trials=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    study = optuna.load_study(study_name="lr-search", storage=url)
    assert study.direction.name == "MAXIMIZE" and len(study.trials) == 2
    assert not (tmp_path / "sweep" / "search.journal").exists()
    for t in study.trials:
        assert set(t.params) == {"lr.base", "optim", "trainer.eval_every"}
        run = tmp_path / "sweep" / t.user_attrs[JOB_DIR]
        assert t.value == json.loads((run / "summary.json").read_text())["best_val_acc"]
        assert (
            sorted(t.intermediate_values) == list(range(0, 13, t.params["trainer.eval_every"]))[1:]
        )
        assert all(0 <= v <= 1 for v in t.intermediate_values.values())  # val/acc reported
    found = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert (
        found.best_value == study.best_value
        and found.best_params.optim == study.best_params["optim"]
    )
    assert "lr.warmup_steps" not in found.best_params

    first = [(t.params, t.value) for t in study.trials]
    assert run_cli(*args, "hydra.sweeper.n_trials=3", cwd=tmp_path).returncode == 0
    trials = optuna.load_study(study_name="lr-search", storage=url).trials
    assert len(trials) == 3 and [(t.params, t.value) for t in trials[:2]] == first


@pytest.mark.parametrize(
    "override, expected",
    [
        ("lr.bse=interval(1, 2)", "unknown setting lr.bse; did you mean lr.base?"),
        # Optuna's own reasons, as Optuna 5 and 4 word them
        ("lr.base=tag(log, interval(0.5, 0.1))", ("`low <= high` must hold", "smaller than or")),
        ("lr.base=tag(log, interval(0, 0.1))", ("`low > 0` must hold for `log=True`", "than 0")),
        (
            "lr.warmup_steps=int(interval(-3, 4))",
            "draws lr.warmup_steps=-3: lr.warmup_steps=-3 must",
        ),
        ("lr.schedule=interval(1, 2)", "lr.schedule=1.0 is unknown; use one of cosine"),
        (
            "lr.warmup_init=interval(2, 3)",
            "draws lr.warmup_init=2.0: lr.warmup_init=2.0 must be in",
        ),
        ("precision=choice(fp16,bf17)", "precision=bf17 is not an option of the precision group"),
        ("hydra.sweeper.objective=best_val_ac", "best_val_ac is not a figure a search scores; did"),
        ("hydra.sweeper.direction=maximize", "final_val_loss is minimized (one objective; drop"),
    ],
)
def test_a_bad_search_setting_is_one_line_and_exit_2_before_any_trial(override, expected, tmp_path):
    result = run_cli("-m", "+search=lr", override, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("amp_lab: error: "), result.stderr[-2000:]
    assert any(
        words in lines[0] for words in ((expected,) if isinstance(expected, str) else expected)
    )
    assert not (tmp_path / "sweep").exists()


def test_an_interrupted_search_resumes_from_its_journal(tmp_path):
    """Ctrl-C mid-trial stops the sweep; the same command again fails the interrupted trial,
    runs its settings again and completes the study, leaving the finished trials as they were."""
    sweep = tmp_path / "sweep"  # given relative to the working directory, as users do
    args = ["+search=lr", "precision=fp32", "hydra.sweeper.n_trials=2", "hydra.sweep.dir=sweep"]
    long_runs = [*TINY, "trainer.max_steps=150", "trainer.eval_every=50"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "-m", "amp_lab", "-m", *args, *long_runs]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C reaches it as on a terminal, also when pytest runs as a background job (which
        # ignores SIGINT, and the runner rightly leaves an ignored signal alone)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        # the second trial has logged a step: its loop, and its Ctrl-C handler, are running
        while not any(f.read_text().strip() for f in sweep.glob("1_*/metrics.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "Traceback" not in stderr, stderr[-2000:]
    before = _trials(sweep, "all")
    assert [t.state.name for t in before] == ["COMPLETE", "RUNNING"]
    first = (sweep / before[0].user_attrs[JOB_DIR] / "summary.json").read_text()

    result = run_cli("-m", *args, *long_runs, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    after = _trials(sweep, "all")
    assert [t.state.name for t in after[:2]] == ["COMPLETE", "FAIL"]
    assert RESULT not in after[1].user_attrs  # interrupted: counts toward nothing
    assert after[2].params == before[1].params  # its settings, tried again first
    assert [t.state.name for t in after[2:]] == ["COMPLETE"]
    assert (sweep / before[0].user_attrs[JOB_DIR] / "summary.json").read_text() == first
    [line] = [x for x in result.stderr.splitlines() if x.startswith("amp_lab: search ")]
    assert line.startswith("amp_lab: search all: best") and "2 trials: 2 completed)" in line


def test_a_search_hands_its_trials_to_submitit_local(tmp_path):
    """Each trial in its own process: it reports to its study through the journal."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32,bf16",
        "hydra.sweeper.study_per=[precision]",
        "hydra.sweeper.n_trials=1",
        "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list((sweep / ".submitit").glob("*/*_submitted.pkl"))) == 2
    for study in ("precision=fp32", "precision=bf16"):
        [trial] = _trials(sweep, study)
        assert trial.state.name == "COMPLETE" and sorted(trial.intermediate_values) == [4, 8, 12]


def test_a_search_runs_its_trials_as_slurm_jobs(cluster, tmp_path):
    """The same search under hydra/launcher=submitit_slurm_cpu: each round's trials (one per
    study) are one job array on the test cluster; every trial reaches its study through the
    journal, pruning included (each job reports its evaluations from its own process)."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32,bf16",
        "hydra.sweeper.study_per=[precision]",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.pruner.n_startup_trials=1",
        "hydra/launcher=submitit_slurm_cpu",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=null",
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list((sweep / ".submitit").glob("*/*_submission.sh"))) == 2  # 2 rounds, 2 arrays
    for study in ("precision=fp32", "precision=bf16"):
        trials = _trials(sweep, study)
        assert len(trials) == 2 and trials[0].state.name == "COMPLETE"
        assert all(t.intermediate_values for t in trials)  # reported from the SLURM job
        assert trials[1].state.name in {"COMPLETE", "PRUNED"}
