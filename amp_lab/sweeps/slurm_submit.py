"""What sbatch and sacct say to a SLURM sweep's own process, as one line each: sbatch's refusal
(submitit's 50-line traceback) as its reason and the override that fixes it; on a cluster without
job accounting, sacct's failure once, and squeue asked instead; a job that ended without a result
as its logs and the command that resumes it.
"""

from __future__ import annotations

import getpass
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from submitit.core.utils import UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from amp_lab.sweeps.slurm_queue import partition_size, partitions, sinfo, slurm_said, time_fix

log = logging.getLogger("amp_lab.sweeps")

# what sacct prints, at each call, on a cluster that keeps no job accounting
NO_ACCOUNTING = "accounting storage is disabled"
# submitit's warning when its job-state command fails (it polls on, the states as they were)
_SACCT = "Bypassing sacct error"
LEFT_QUEUE = "left the queue"  # a job squeue no longer lists, for a cluster without sacct


def _fix(reason: str, partition: str, tasks_per_node: int) -> str | None:
    """The override for sbatch's reason (lower case), from what sinfo says of the partition."""
    if re.search(r"generic resource|\bgres\b", reason):
        gres = [g for g in sinfo(partition, "%G") if g != "(null)"]
        if not gres:
            return (
                f"partition {partition} has no GPUs: use hydra/launcher=submitit_slurm_cpu "
                "(or hydra.launcher.gpus_per_node=null)"
            )
        return (
            f"partition {partition} has {', '.join(gres)}: ask within it "
            "(hydra.launcher.gpus_per_node, hydra.launcher.gres)"
        )
    if "account" in reason:  # before 'partition': "Invalid account or account/partition ..."
        return (
            "set hydra.launcher.account=ACCOUNT, one of yours "
            "(sacctmgr -n show assoc user=$USER format=account,partition lists them)"
        )
    if "partition" in reason:
        names = [n.rstrip("*") for n in partitions()]
        if len(names) == 1:
            return f"set hydra.launcher.partition={names[0]}, the partition sinfo lists"
        return f"set hydra.launcher.partition to one that sinfo lists: {', '.join(names)}"
    if "qos" in reason:
        return (
            "set hydra.launcher.qos=QOS, one you may use "
            "(sacctmgr -n show assoc user=$USER format=qos lists them)"
        )
    if "time limit" in reason and (fix := time_fix(partition)):
        return fix
    cpus, mem = partition_size(partition)
    if "memory" in reason and mem:
        return (
            f"partition {partition}'s largest node has {int(mem)} GB: set "
            f"hydra.launcher.mem_gb={int(mem)}"
        )
    if "processors" in reason and cpus:
        return (
            f"partition {partition}'s largest node has {cpus} CPUs: set "
            f"hydra.launcher.cpus_per_task={max(1, cpus // tasks_per_node)}"
        )
    return None


def refusal(
    sbatch_said: str, partition: str | None, tasks_per_node: int = 1, script: Path | None = None
) -> str:
    """sbatch's refusal of a sweep's jobs as one line: sbatch's own reason, then the override
    that fixes it (or the submission script, whose options sbatch refused)."""
    said = [
        re.sub(r"^(sbatch: error: )?(Batch job submission failed: )?", "", line.strip())
        for line in sbatch_said.splitlines()
        if line.strip()
    ]
    reason = "; ".join(dict.fromkeys(said)) or "no reason given"
    if not partition:  # the cluster's default partition, marked '*' by sinfo
        partition = next((n.rstrip("*") for n in partitions() if n.endswith("*")), "")
    fix = _fix(reason.lower(), partition, tasks_per_node) or (
        f"its sbatch options are in {script}" if script else "see `sbatch --help`"
    )
    return f"sbatch refused the sweep's jobs: {reason}; {fix}"


class _NoSacct(SlurmInfoWatcher):
    """submitit's job watcher on a cluster without job accounting: squeue instead of sacct. A
    job that has left the queue without a result file (stopped by a signal, killed) has ended;
    without this the sweep would wait for it forever."""

    def _make_command(self) -> list[str] | None:
        if not self._registered - self._finished:
            return None
        return ["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string if isinstance(string, str) else string.decode()
        queued = dict(line.strip().split("|", 1) for line in text.splitlines() if "|" in line)
        return {job: {"State": queued.get(job, LEFT_QUEUE)} for job in self._registered}


class _StderrWithoutSbatch:
    """sys.stderr, less the sbatch errors that submitit prints before it raises them: amp_lab's
    one line says them, with the override that fixes them."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.dropped = stream, False

    def write(self, text: str) -> int:
        dropped, self.dropped = self.dropped, text.startswith("sbatch: error:")
        if self.dropped or (dropped and text == "\n"):  # the newline print() writes after it
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class OnceSacctWarning(logging.Filter):
    """submitit's warning that sacct failed (every poll, through each of its handlers) becomes
    one line of amp_lab's that says what it means."""

    seen = False  # set on the instance at the first warning

    def filter(self, record: logging.LogRecord) -> bool:
        if _SACCT not in record.getMessage():
            return True
        if not self.seen:
            self.seen = True
            log.warning(
                "sacct failed: until it answers, submitit reads job states from the jobs' own files"
            )
        return False


class SlurmSubmit:
    """A SLURM launch's submission and polls, told in amp_lab's words from start() to close()."""

    def __init__(self, sweep_dir: Path, partition: str | None, tasks_per_node: int) -> None:
        self.sweep_dir, self.partition, self.tasks_per_node = sweep_dir, partition, tasks_per_node
        self.stderr, self.watcher = sys.stderr, SlurmJob.watcher

    def start(self) -> None:
        submitit_log = logging.getLogger("submitit")
        if not any(isinstance(f, OnceSacctWarning) for f in submitit_log.filters):
            submitit_log.addFilter(OnceSacctWarning())
        said = slurm_said(["sacct", "-n", "-j", "1"], "stderr").strip()
        if NO_ACCOUNTING in said:  # sacct can only fail here, at every poll
            log.warning("sacct: %s: submitit reads job states from squeue", said)
            SlurmJob.watcher = _NoSacct(delay_s=60)
        sys.stderr = _StderrWithoutSbatch(self.stderr)

    def close(self) -> None:
        sys.stderr, SlurmJob.watcher = self.stderr, self.watcher

    def error_line(self, err: BaseException) -> str | None:
        """One line for sbatch's refusal of the launch's jobs, or for a machine without SLURM;
        None for any other error."""
        if isinstance(err, RuntimeError) and 'detect "srun"' in str(err):  # submitit's check
            return (
                "there is no SLURM on this machine (no srun): start the sweep on the cluster's "
                "login node, or run its jobs here with hydra/launcher=submitit_local"
            )
        ended = re.match(
            r"Job (\S+) \(task: \S+\) with path (.+)\nhas not produced any output \(state: (.+?)\)",
            str(err),
        )
        if isinstance(err, UncompletedJobError) and ended:  # stopped by a signal, killed
            job, result, state = ended.groups()
            return (
                f"SLURM job {job} ended without a result ({state}); its logs: "
                f"{Path(result).parent}; the same command with hydra.sweep.dir={self.sweep_dir} "
                "resumes the runs that did not finish"
            )
        sbatch = err.__cause__  # submitit's FailedJobError holds sbatch's stderr, from its exit
        if not (isinstance(sbatch, subprocess.CalledProcessError) and sbatch.cmd[0] == "sbatch"):
            return None
        scripts = (self.sweep_dir / ".submitit").glob(".submission_file_*.sh")
        script = max(scripts, key=lambda path: path.stat().st_mtime, default=None)
        return refusal(str(err), self.partition, self.tasks_per_node, script)
