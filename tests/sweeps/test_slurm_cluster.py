"""Which SLURM the suite submits to: only the cluster scripts/slurm_cluster.sh started (in
SLURM_CLUSTER_DIR) and only while it is up; otherwise the tests that need it skip, submitting
nothing, whatever `sbatch` is on PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.slurm import MARKER, SCRIPT, cluster_conf, why_not_up

COMMANDS = ("sbatch", "srun", "squeue", "sinfo", "scancel", "sacct", "scontrol")


def _recorders(bin_dir: Path, calls: Path, says: str = "") -> dict[str, str]:
    """SLURM's commands as scripts that append each call to `calls` and print `says`; PATH with
    them first."""
    bin_dir.mkdir()
    for name in COMMANDS:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\necho {says}\n')
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_the_suite_takes_only_the_scripts_cluster_and_only_while_it_is_up(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    # a node that says it is idle, whoever asks
    monkeypatch.setenv("PATH", _recorders(tmp_path / "bin", calls, says="idle")["PATH"])
    folder = tmp_path / "cluster"
    (folder / "run").mkdir(parents=True)
    start = "scripts/slurm_cluster.sh start (as root)"
    assert why_not_up(folder) == f"no test SLURM cluster in {folder}: {start} makes one"

    for daemon in ("munged", "slurmctld", "slurmd"):  # alive, as far as their pid files tell
        (folder / "run" / f"{daemon}.pid").write_text(str(os.getpid()))
    (folder / "slurm.conf").write_text(
        "ClusterName=prod\n"
    )  # a slurm.conf the script did not write
    assert cluster_conf(folder) is None
    assert why_not_up(folder) == f"no test SLURM cluster in {folder}: {start} makes one"

    (folder / "slurm.conf").write_text(f"{MARKER}\nClusterName=amplab\n")
    assert cluster_conf(folder) == folder / "slurm.conf" and why_not_up(folder) is None
    assert "sinfo" in calls.read_text()  # up: its node said so

    calls.unlink()
    for pid_file in (folder / "run").iterdir():  # as `scripts/slurm_cluster.sh stop` leaves it
        pid_file.unlink()
    assert why_not_up(folder) == f"the test SLURM cluster in {folder} is stopped: {start} starts it"
    assert not calls.exists()  # said without asking SLURM (sinfo waits ~9 s for a dead controller)
    assert f'MARKER="{MARKER}"' in SCRIPT.read_text()  # the line the script writes first


def test_the_suites_slurm_commands_read_the_test_clusters_conf_or_none():
    """Set for the session and its subprocesses: never /etc/slurm/slurm.conf, a login node's own
    configuration, nor a SLURM_CONF the user had."""
    assert os.environ["SLURM_CONF"] == str(cluster_conf() or os.devnull)


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on this machine")
def test_sbatch_refuses_the_empty_conf_at_once():
    """What the suite relies on without a test cluster (a missing file costs 60 s of retries)."""
    env = {**os.environ, "SLURM_CONF": os.devnull}
    said = subprocess.run(
        ["sbatch", "--hold", "--wrap=true"], env=env, capture_output=True, text=True, timeout=20
    )
    assert said.returncode == 1 and "Unable to process configuration file" in said.stderr


def _pytest(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "slurm"]
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_without_the_cluster_every_slurm_test_skips_naming_the_script_and_submits_nothing(
    tmp_path,
):
    """sbatch on PATH, and the test cluster's folder as `scripts/slurm_cluster.sh stop` leaves it:
    each test that needs the cluster skips with the command that starts it and no SLURM command
    runs; --require-slurm (CI) makes each one fail instead."""
    calls = tmp_path / "calls"
    stopped = tmp_path / "cluster"
    (stopped / "run").mkdir(parents=True)
    (stopped / "slurm.conf").write_text(f"{MARKER}\nClusterName=amplab\n")
    env = {**os.environ, **_recorders(tmp_path / "bin", calls), "SLURM_CLUSTER_DIR": str(stopped)}
    result = _pytest("tests", env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    skipped = re.findall(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", result.stdout, flags=re.M)
    assert skipped and {reason for _, _, reason in skipped} == {
        f"the test SLURM cluster in {stopped} is stopped: scripts/slurm_cluster.sh start (as root) "
        "starts it"
    }, result.stdout[-3000:]
    count = sum(int(n) for n, _, _ in skipped)
    passed = rf"^{count} skipped, \d+ deselected(, \d+ warnings?)? in "  # nothing else ran
    assert re.search(passed, result.stdout, flags=re.M), result.stdout[-3000:]
    assert {where.split(":")[0] for _, where, _ in skipped} >= {
        "tests/sweeps/test_slurm.py",
        "tests/search/test_search.py",
        "tests/components/test_distributed.py",
    }
    assert not calls.exists(), calls.read_text()

    required = _pytest("tests/search/test_search.py", "--require-slurm", env=env)
    assert required.returncode == 1 and "1 error in " in required.stdout, required.stdout[-3000:]
    assert f"Failed: the test SLURM cluster in {stopped} is stopped: " in required.stdout
    assert not calls.exists(), calls.read_text()
