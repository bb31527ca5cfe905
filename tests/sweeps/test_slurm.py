"""Sweeps through hydra-submitit-launcher on a real single-node SLURM (scripts/slurm_cluster.sh).

A test that takes the `cluster` fixture runs only on the cluster scripts/slurm_cluster.sh started
(CI's .ci/run starts it) and skips while it is not up. Jobs run this checkout's amp_lab (run_cli
puts it on PYTHONPATH; sbatch exports the environment) with the venv's python (submitit submits
sys.executable).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import ROOT, run_cli
from helpers.slurm import JOB, ON_TEST_CLUSTER
from helpers.wandb_records import offline_runs, read_run

from amp_lab.tracking.wandb_sink import sweep_group

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores, 2 jobs at once


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _job_dirs(sweep):
    return sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())


def _check_sweep(sweep, launcher_class: str):
    dirs = _job_dirs(sweep)
    assert [d.name.split("_")[0] for d in dirs] == ["0", "1", "2"]
    for run_dir, precision in zip(dirs, ["fp32", "fp16", "bf16"]):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed", summary["status"]
        assert summary["steps"] == 4 and summary["precision"]["name"] == precision
        assert [r["step"] for r in _rows(run_dir) if r["kind"] == "train"] == [2, 4]
        hydra_yaml = (run_dir / ".hydra" / "hydra.yaml").read_text()
        assert launcher_class in hydra_yaml


def test_three_job_sweep_with_the_local_launcher(tmp_path):
    """submitit_local runs the jobs as submitit processes on this machine (the SLURM launcher's
    three-job sweep is the README command's, below)."""
    result = run_cli(
        "-m",
        "precision=fp32,fp16,bf16",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *JOB,
        "trainer.max_steps=4",
        "trainer.log_every=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _check_sweep(tmp_path / "sweep", "LocalLauncher")


def test_a_refused_job_on_slurm_is_named_in_the_sweeps_terminal(cluster, tmp_path):
    """The job runs in its own process on the cluster; the sweep still ends with exit code 2
    and the reason, read from the job's log."""
    result = run_cli(
        "-m",
        "lr.base=1e-3,-1",
        "hydra/launcher=submitit_slurm",
        *ON_TEST_CLUSTER,
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *JOB,
        "trainer.max_steps=2",
        "trainer.log_every=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "amp_lab: error: 1 sweep job(s) did not run: job 1: lr.base=-1.0 must be > 0"
    )
    first = _job_dirs(tmp_path / "sweep")[0]
    assert json.loads((first / "summary.json").read_text())["status"] == "completed"


def _signalled_sweep(sweep, cwd, *overrides: str, signal: str = "USR2") -> tuple[int, str]:
    """A one-job SLURM sweep sent `signal` (USR2: SLURM's pre-timeout signal, with scancel so the
    test need not wait for a time limit) once its job has logged twice; its exit code and stderr
    once the sweep ends."""
    cmd = [
        sys.executable,
        "-m",
        "amp_lab",
        "-m",
        "hydra/launcher=submitit_slurm",
        *ON_TEST_CLUSTER,
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={sweep}",
        *JOB,
        "checkpoint.every_minutes=0",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }  # as run_cli does
    result = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not list(sweep.glob("0_*/metrics.jsonl")) or len(_rows(_job_dirs(sweep)[0])) < 2:
            assert time.monotonic() < deadline and result.poll() is None, "no progress"
            time.sleep(1)
        [job_id] = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
        subprocess.run(["scancel", f"--signal={signal}", job_id], check=True)
        _, stderr = result.communicate(timeout=300)
    finally:
        if result.poll() is None:
            result.kill()
    return result.returncode, stderr


def test_signalled_job_checkpoints_is_requeued_and_resumes(cluster, tmp_path):
    """The job gets SLURM's pre-timeout signal (USR2), saves, is requeued into the same job dir,
    finishes from its checkpoint; its W&B run goes on as the same run, and the steps before the
    requeue are in it (the requeue has SLURM end W&B's service too)."""
    sweep = tmp_path / "sweep"
    returncode, stderr = _signalled_sweep(
        sweep,
        tmp_path,
        "precision=fp16",
        "trainer.max_steps=100",
        "trainer.log_every=10",
        "logger.mode=offline",
    )
    assert returncode == 0, stderr[-3000:]
    run_dir = _job_dirs(sweep)[0]
    log = (run_dir / "__main__.log").read_text()
    resumed_at = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert resumed_at and all(20 <= s < 100 for s in resumed_at), log[-2000:]
    assert list((run_dir / "checkpoints").glob(f"step_{resumed_at[0]:09d}.pt"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 100
    assert [r["step"] for r in _rows(run_dir) if r["kind"] == "train"] == list(range(10, 101, 10))
    submitit_log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert "Requeued job" in submitit_log
    first, resumed = (read_run(f) for f in offline_runs(run_dir))
    assert first.run_id == resumed.run_id and first.group == resumed.group == sweep_group(sweep)
    logged = [
        [row["step"] for row in run.history if "train/loss" in row] for run in (first, resumed)
    ]
    assert logged == [
        [s for s in range(10, 101, 10) if s <= resumed_at[0]],
        [s for s in range(10, 101, 10) if s > resumed_at[0]],
    ]


def test_a_job_stopped_without_a_result_ends_the_sweep_in_one_line(cluster, tmp_path):
    """SIGTERM (a preemption, scancel) stops the run after its checkpoint and the job leaves the
    queue without a result file; on this cluster without accounting the sweep learns it from
    squeue (it waited forever), says so in one line, and the line's command resumes the run."""
    sweep = tmp_path / "sweep"
    run = ("precision=fp16", "trainer.max_steps=100", "trainer.log_every=10")
    returncode, stderr = _signalled_sweep(sweep, tmp_path, *run, signal="TERM")
    [job_id] = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    assert returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"amp_lab: error: SLURM job {job_id} ended without a result (left the queue); its logs: "
        f"{sweep / '.submitit' / job_id}; the same command with hydra.sweep.dir={sweep} resumes "
        "the runs that did not finish"
    )
    stopped = json.loads((_job_dirs(sweep)[0] / "summary.json").read_text())["status"]
    assert stopped.startswith("interrupted: SIGTERM at step ")
    result = run_cli(
        "-m",
        "hydra/launcher=submitit_slurm",
        *ON_TEST_CLUSTER,
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={sweep}",
        *JOB,
        "checkpoint.every_minutes=0",
        *run,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = (_job_dirs(sweep)[0] / "__main__.log").read_text()
    assert re.search(r"resumed from \S+ at step \d+", log), log[-2000:]
    summary = json.loads((_job_dirs(sweep)[0] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 100


def _refusal(tmp_path, *overrides: str) -> str:
    """A two-job SLURM sweep that sbatch refuses: exit code 2 within seconds, stderr one
    `amp_lab: error:` line (no traceback, no sbatch lines besides), the sweep folder kept."""
    sweep = tmp_path / "refused"
    result = run_cli(
        "-m",
        "precision=fp32,bf16",
        *overrides,
        f"hydra.sweep.dir={sweep}",
        *JOB,
        "trainer.max_steps=2",
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("amp_lab: error: sbatch refused the sweep's jobs: "), line
    assert (sweep / "multirun.yaml").is_file()  # what was written before sbatch stays
    return line


def _node() -> dict[str, int]:
    """The test node's CPUs and memory (sinfo's RealMemory, MB) in whole GB."""
    out = subprocess.run(["sinfo", "-h", "-o", "%c %m"], capture_output=True, text=True, check=True)
    cpus, mem_mb = out.stdout.split()
    return {"cpus": int(cpus), "gb": int(mem_mb) // 1024}


def test_the_readme_gpu_command_is_refused_in_one_line_whose_override_runs_as_typed(
    cluster, tmp_path, monkeypatch
):
    """docs/sweeps.md's GPU command on this cluster without GPUs: sbatch's refusal as one line with
    the override. With it (its CPU command) the jobs fit, run, and the sweep ends with each job's
    state and the next command; sacct's "accounting storage is disabled" is said once, not at
    every poll; no Hydra deprecation warning in the job logs."""
    monkeypatch.delenv("OMP_NUM_THREADS")  # threads follow the CPUs SLURM gave the job
    readme = ["-m", "precision=fp32,fp16,bf16", "hydra.launcher.partition=debug"]
    line = _refusal(tmp_path, *readme[1:], "hydra/launcher=submitit_slurm")
    assert line.endswith(
        "Invalid generic resource (gres) specification; partition debug has no GPUs: use "
        "hydra/launcher=submitit_slurm_cpu (or hydra.launcher.gpus_per_node=null)"
    ), line
    override = re.search(r"use (\S+)", line).group(1)
    sweep = tmp_path / "sweep"
    result = run_cli(
        *readme,
        override,
        f"hydra.sweep.dir={sweep}",
        *JOB,
        "trainer.max_steps=4",
        "trainer.log_every=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _check_sweep(sweep, "SlurmLauncher")
    tail = result.stderr.strip().splitlines()[-5:]
    assert tail[0] == f"amp_lab: sweep {sweep}: 3 job(s)"
    assert [line.split(": ", 1)[1].split(",")[0] for line in tail[1:4]] == ["completed"] * 3
    assert tail[4] == f"next: amp_lab report {sweep}"
    said = result.stdout + result.stderr
    assert said.count("Slurm accounting storage is disabled") == 1, said[-3000:]
    assert "Bypassing" not in said
    [script] = list((sweep / ".submitit").glob("*/*_submission.sh"))
    text = script.read_text()  # it went through sbatch, with submitit_slurm's requeue signal
    assert "#SBATCH --signal=USR2@120" in text and "export PYTHONUNBUFFERED=1" in text
    assert "#SBATCH --cpus-per-task=2" in text and "--gpus" not in text
    for log in (sweep / ".submitit").glob("*/*_log.err"):
        assert "deprecated" not in log.read_text(), log
    summary = json.loads((_job_dirs(sweep)[0] / "summary.json").read_text())
    assert summary["threads"]["cpus"] == summary["threads"]["threads"] == 2


@pytest.mark.parametrize(
    "override, reason, fix",
    [
        (
            "hydra.launcher.partition=nosuch",
            "invalid partition specified: nosuch; Invalid partition name specified",
            "set hydra.launcher.partition=debug, the partition sinfo lists",
        ),
        (
            "hydra.launcher.mem_gb=512",
            "Memory specification can not be satisfied; "
            "Requested node configuration is not available",
            "partition debug's largest node has {gb} GB: set hydra.launcher.mem_gb={gb}",
        ),
    ],
)
def test_sbatchs_refusal_is_one_line_with_its_reason_and_the_override(
    cluster, tmp_path, override, reason, fix
):
    line = _refusal(tmp_path, "hydra/launcher=submitit_slurm_cpu", override)
    assert line.endswith(f"jobs: {reason}; {fix.format(**_node())}"), line


@pytest.mark.parametrize(
    "sbatch_said, fix",
    [
        # SLURM's ESLURM_INVALID_ACCOUNT, as sbatch prints it
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition "
            "combination specified",
            "set hydra.launcher.account=ACCOUNT, one of yours (sacctmgr -n show assoc "
            "user=$USER format=account,partition lists them)",
        ),
        # said by this cluster with EnforcePartLimits=ALL in its slurm.conf
        (
            "sbatch: error: Batch job submission failed: Requested time limit is invalid "
            "(missing or exceeds some limit)",
            "partition debug allows 240 min per job: set hydra.launcher.timeout_min=240",
        ),
        (
            "sbatch: error: Batch job submission failed: More processors requested than permitted",
            "partition debug's largest node has {cpus} CPUs: set "
            "hydra.launcher.cpus_per_task={cpus}",
        ),
    ],
)
def test_refusals_this_cluster_does_not_make_get_their_override_from_sinfo(
    cluster, sbatch_said, fix
):
    """This cluster keeps no accounting, so sbatch takes any account, and it leaves SLURM's
    EnforcePartLimits at NO, so a job over the time limit or the node's CPUs pends (the pending
    tests below) instead of being refused. The line for sbatch's own words of such a refusal."""
    from amp_lab.sweeps.slurm_submit import refusal

    taken = subprocess.run(  # held, then cancelled: it never runs
        [
            "sbatch",
            "--parsable",
            "--hold",
            "--account=nosuch",
            "--time=300",
            "-c",
            "8",
            "--wrap=true",
        ],
        capture_output=True,
        text=True,
    )
    subprocess.run(["scancel", taken.stdout.strip()], check=False)
    assert taken.returncode == 0, taken.stderr  # else test these refusals on the cluster
    reason = sbatch_said.split("failed: ")[1]
    line = refusal(sbatch_said, "debug")
    assert line == f"sbatch refused the sweep's jobs: {reason}; {fix.format(**_node())}"


def test_a_slurm_sweep_on_a_machine_without_slurm_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun (python is sys.executable, absolute)
    result = run_cli(
        "-m",
        "hydra/launcher=submitit_slurm_cpu",
        f"hydra.sweep.dir={tmp_path / 's'}",
        *JOB,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "amp_lab: error: there is no SLURM on this machine (no srun): start the sweep on the "
        "cluster's login node, or run its jobs here with hydra/launcher=submitit_local"
    )


def _told_while_pending(tmp_path, *overrides: str) -> str:
    """The line a two-job SLURM sweep whose jobs sbatch takes but cannot start prints within
    about 5 s; the jobs are then cancelled."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "amp_lab",
        "-m",
        "precision=fp32,fp16",
        *overrides,
        "hydra.callbacks.skipped_jobs.pending_warn_s=5",
        f"hydra.sweep.dir={sweep}",
        *JOB,
        "trainer.max_steps=2",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )  # Hydra logs to stdout
    told = ""
    try:
        deadline = time.monotonic() + 120
        while "pending for" not in told and time.monotonic() < deadline and proc.poll() is None:
            told = proc.stdout.readline()
    finally:
        ids = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("*") if p.is_dir()}
        subprocess.run(["scancel", *ids], check=False)
        proc.kill()
        proc.wait()
    return told


def test_a_pending_job_is_told_with_squeues_reason_and_the_override(cluster, tmp_path):
    """The GPU preset on this 2-CPU node: the jobs can never start; the sweep says why and what
    to set instead of waiting in silence."""
    told = _told_while_pending(
        tmp_path,
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.gpus_per_node=null",
    )
    assert re.search(
        r"SLURM jobs \d+_0, \d+_1 pending for \d+ s \((PartitionConfig|Resources)"
        r"\): each asks 8 CPUs / 64 GB; partition debug has 2 CPUs / \d+ GB per "
        r"node: set hydra.launcher.cpus_per_task / hydra.launcher.mem_gb",
        told,
    ), told


def test_a_job_over_the_partitions_time_limit_is_told_the_limit(cluster, tmp_path):
    """sbatch takes it here (EnforcePartLimits=NO) and it pends; the line names the limit."""
    told = _told_while_pending(
        tmp_path, "hydra/launcher=submitit_slurm_cpu", "hydra.launcher.timeout_min=300"
    )
    assert re.search(
        r"SLURM jobs \d+_0, \d+_1 pending for \d+ s \(PartitionTimeLimit\): each asks 2 CPUs / "
        r"4 GB; partition debug allows 240 min per job: set hydra.launcher.timeout_min=240$",
        told.strip(),
    ), told


def test_two_task_fsdp_job_checkpoints_its_shards_is_requeued_and_resumes(cluster, tmp_path):
    """trainer.strategy=fsdp as one job of two SLURM tasks (tasks_per_node=2): both ranks write
    their shards when the job gets USR2, the job is requeued, and both resume from the folder."""
    sweep = tmp_path / "sweep"
    returncode, stderr = _signalled_sweep(
        sweep,
        tmp_path,
        "trainer.strategy=fsdp",
        "precision=bf16",
        "hydra.launcher.tasks_per_node=2",
        "trainer.batch_size=8",
        "trainer.max_steps=60",
        "trainer.log_every=5",
    )
    assert returncode == 0, stderr[-3000:]
    run_dir = _job_dirs(sweep)[0]
    log = (run_dir / "__main__.log").read_text()
    resumed_at = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert resumed_at and all(10 <= s < 60 for s in resumed_at), log[-2000:]
    [folder] = (run_dir / "checkpoints").glob(f"step_{resumed_at[-1]:09d}.dcp")
    assert {"__0_0.distcp", "__1_0.distcp", "state.pt"} <= {p.name for p in folder.iterdir()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 60
    assert summary["world_size"] == 2 and summary["lr"]["global_batch"] == 16
    assert [r["step"] for r in _rows(run_dir) if r["kind"] == "train"] == list(range(5, 61, 5))
    submitit_log = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert "Requeued job" in submitit_log
