"""The LR search (`+search=lr`, hydra_plugins/amp_lab_search/): real CPU searches with real
configs and tiny runs; the journal in the sweep folder read back with Optuna, as a user would.

A trial enqueued into a study before the search starts (Optuna's own way to say "try this
first") injects a diverging LR and a hopeless one, so the outcomes do not hang on the sampler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers import ROOT, run_cli

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
    "hydra.sweeper.space.lr.warmup_steps.high=4",
]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _enqueue(sweep: Path, study: str, *params: dict) -> None:
    sweep.mkdir(parents=True, exist_ok=True)
    created = optuna.create_study(study_name=study, storage=storage(sweep))
    for p in params:
        created.enqueue_trial(p)


def _trials(sweep: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=storage(sweep)).trials


@pytest.fixture(scope="module")
def search(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """fp32 and bf16, 3 trials each; fp32's first three are a sane LR, one that diverges and
    one too small to learn, which the pruner stops at its first evaluation."""
    tmp = tmp_path_factory.mktemp("search")
    sweep = tmp / "sweep"
    _enqueue(
        sweep,
        "precision=fp32",
        {"lr.base": 3e-3, "lr.warmup_steps": 0},
        {"lr.base": 1e30, "lr.warmup_steps": 0},
        {"lr.base": 1e-7, "lr.warmup_steps": 0},
    )
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32,bf16",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner.n_startup_trials=1",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp,
    )
    return sweep, result


def test_a_search_runs_one_study_per_precision_and_a_diverged_trial_fails(search):
    sweep, result = search
    assert result.returncode == 0, result.stderr[-3000:]
    fp32 = _trials(sweep, "precision=fp32")
    assert [t.state.name for t in fp32] == ["COMPLETE", "FAIL", "PRUNED"]
    good, diverged, pruned = fp32
    assert diverged.user_attrs[RESULT].startswith("diverged") and diverged.value is None
    assert pruned.user_attrs[RESULT].startswith("pruned by the search at step 4")
    summary = json.loads((sweep / good.user_attrs[JOB_DIR] / "summary.json").read_text())
    assert good.value == summary["final_val_loss"] and summary["precision"]["name"] == "fp32"
    bf16 = _trials(sweep, "precision=bf16")
    assert len(bf16) == 3 and all(t.state.name in {"COMPLETE", "PRUNED"} for t in bf16)
    for t in bf16:  # each trial an ordinary run folder with the drawn settings
        overrides = (sweep / t.user_attrs[JOB_DIR] / ".hydra" / "overrides.yaml").read_text()
        assert f"lr.base={t.params['lr.base']:.4g}" in overrides and "precision=bf16" in overrides
    assert "amp_lab: search precision=fp32: best lr.base=0.003, lr.warmup_steps=0" in result.stderr
    assert "3 trials: 1 completed, 1 diverged, 1 pruned" in result.stderr


def test_the_report_reads_a_search(search, tmp_path):
    sweep, _ = search
    result = run_cli("report", str(sweep), "--out", str(tmp_path / "report"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    studies = {s["precision"]: s for s in data["studies"]}
    fp32, bf16 = studies["fp32"], studies["bf16"]
    assert (fp32["trials"], fp32["completed"], fp32["diverged"], fp32["pruned"]) == (3, 1, 1, 1)
    assert fp32["best"]["lr"] == 3e-3 and fp32["lr_ratio"] == 1.0
    assert bf16["lr_ratio"] == pytest.approx(bf16["best"]["lr"] / 3e-3)
    done = [r for r in bf16["rows"] if r["state"] == "COMPLETE"]
    assert bf16["best"]["val_loss"] == min(r["val_loss"] for r in done)
    near = [r["lr"] for r in done if r["val_loss"] <= 1.01 * bf16["best"]["val_loss"]]
    assert bf16["near_best_lr"] == [min(near), max(near)]
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| precision=fp32 | 3 (1 ok, 1 pruned, 1 diverged) | 0.003 | 0 |" in report
    assert (tmp_path / "report" / "search.png").stat().st_size > 10_000
    assert "best lr.base" in result.stdout and "× fp32 LR" in result.stdout
    for axis in (["--by", "optim.weight_decay"], ["--ref", "fp32"]):  # no comparison of runs
        result = run_cli("report", str(sweep), *axis, cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
        assert f"{sweep} is an LR search: its report compares each study's best LR" in result.stderr


def test_a_search_whose_every_trial_diverges_ends_with_one_verdict_line(tmp_path):
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.space.lr.base.low=1e29",
        "hydra.sweeper.space.lr.base.high=1e30",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *TINY,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("amp_lab: search ")]
    assert line.startswith("amp_lab: search all: no trial of 2 finished with a finite loss")
    assert "(2 diverged)" in line


@pytest.mark.parametrize(
    "override, expected",
    [
        ("+hydra.sweeper.space.lr.bse={low:1,high:2}", "unknown search-space key lr.bse; did you"),
        ("hydra.sweeper.space.lr.base.low=0.5", "lr.base is an empty range [0.5, 0.1]"),
        ("hydra.sweeper.space.lr.base.low=0", "lr.base.low=0 is out of range: a log-scale range"),
        ("hydra.sweeper.space.lr.warmup_steps.low=-3", "searched settings are >= 0"),
        ("+hydra.sweeper.space.lr.schedule={low:1,high:2}", "lr.schedule is a Schedule, not a"),
    ],
)
def test_a_bad_search_space_is_one_line_and_exit_2(override, expected, tmp_path):
    result = run_cli("-m", "+search=lr", override, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("amp_lab: error: "), result.stderr[-2000:]
    assert expected in lines[0]
    assert not list((tmp_path / "sweep").glob("*/metrics.jsonl"))


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


def test_a_refused_trial_fails_and_a_key_fixed_on_the_command_line_leaves_the_space(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "+search=lr",
        "precision=fp32",
        "lr.warmup_steps=0",
        "hydra.sweeper.n_trials=1",
        "+hydra.sweeper.space.lr.warmup_init={low: 2, high: 3}",  # lr.warmup_init must be <= 1
        f"hydra.sweep.dir={sweep}",
        *TINY,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "1 sweep job(s) did not run" in result.stderr
    [trial] = _trials(sweep, "all")
    assert trial.state.name == "FAIL" and set(trial.params) == {"lr.base", "lr.warmup_init"}
    assert trial.user_attrs[RESULT].startswith("refused: lr.warmup_init=")
