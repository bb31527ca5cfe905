"""Where and how the compared runs were made: date, devices, versions, load, commands. Speed is a
finding only from a GPU not overloaded; the load is read as the report is made, so it describes
the runs where the report follows them on the same machine (as `make studies` does)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
from importlib import metadata
from typing import Any

import yaml

from amp_lab.records import HYDRA_DIR
from amp_lab.tools.report.runs import RunData, setting_value

SWEEPER = ("hydra.sweeper", "hydra/sweeper")  # the overrides of a sweep's sweeper


def run_device(run: RunData) -> str:
    """The device the run trained on: as resolved in its summary, else as configured."""
    device = (run.summary.get("precision") or {}).get("device")
    if device:
        return str(device)
    return str(setting_value(run.settings.get("trainer.device", '"?"')))


def _launch(run: RunData, hydra: dict[str, Any]) -> str:
    """`python`, or `torchrun --nproc_per_node=N` for a run of N ranks that a launcher on this
    machine started (torchrun started the ranks; a SLURM launcher starts its tasks itself)."""
    world = int(run.summary.get("world_size") or 1)
    target = str((hydra.get("launcher") or {}).get("_target_", ""))
    slurm = "slurm" in target.lower()
    return f"torchrun --nproc_per_node={world}" if world > 1 and not slurm else "python"


def commands(runs: list[RunData]) -> list[str]:
    """The commands that made the runs: one per sweep folder (its multirun.yaml holds the last
    launch into it), one per single run (its .hydra/hydra.yaml)."""
    found: list[str] = []
    for run in runs:
        sweep = run.path.parent / "multirun.yaml"
        hydra_file = sweep if sweep.exists() else run.path / HYDRA_DIR / "hydra.yaml"
        try:
            hydra = yaml.safe_load(hydra_file.read_text())["hydra"]
            # the sweeper's settings too (a search's n_trials, sampler, ...), so that the command
            # sweeps what it swept; hydra.sweep.dir not: a new folder, or it would resume
            overrides = hydra["overrides"]
            sweeper = [
                o for o in overrides.get("hydra") or [] if o.lstrip("+~").startswith(SWEEPER)
            ]
            task = " ".join(shlex.quote(str(o)) for o in overrides["task"] + sweeper)
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
        flag = "-m " if sweep.exists() else ""
        found.append(f"{_launch(run, hydra)} -m amp_lab {flag}{task}".rstrip())
    return list(dict.fromkeys(found))


def gather(runs: list[RunData], argv: list[str]) -> dict[str, Any]:
    """The report's context, with `speed_representative` and why not."""
    cores = os.cpu_count() or 1
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    devices = sorted({run_device(run) for run in runs})
    reasons = []
    if any(d == "cpu" or d == "?" for d in devices):
        reasons.append("the runs trained on a CPU, whose fp16/bf16 kernels say nothing about a GPU")
    if load is not None and load[0] > cores:
        reasons.append(f"the load average ({load[0]:.1f}) was above the {cores} cores")
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "devices": devices,
        "host": {
            "python": platform.python_version(),
            "torch": metadata.version("torch"),  # dependencies: installed with amp_lab
            "timm": metadata.version("timm"),
            "cores": cores,
            "load_avg": load,
            "platform": platform.platform(),
        },
        "commands": commands(runs),
        "report_command": "python -m amp_lab report " + " ".join(shlex.quote(a) for a in argv),
        "speed_representative": not reasons,
        "speed_note": "; ".join(reasons),
    }


def markdown(context: dict[str, Any]) -> str:
    """The context report.md and a study's README open with: the commands, where and when."""
    host, load = context["host"], context["host"]["load_avg"]
    lines = [
        "Made with:",
        "```bash",
        *context["commands"],
        context["report_command"],
        "```",
        f"on {', '.join(context['devices'])} ({host['cores']} cores, load average "
        + ("unknown" if load is None else f"{load[0]:.1f}")
        + f"), {context['date'][:10]}, torch {host['torch']}, timm {host['timm']}.",
    ]
    if not context["speed_representative"]:
        lines.append(
            f"Speed and memory are **not representative**: {context['speed_note']}. "
            "They are shown in the tables and left out of the verdicts."
        )
    return "\n".join(lines)
