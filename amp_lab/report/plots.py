"""The comparison plots (matplotlib, Agg): curves per seed group (mean line, min-max band), bars.

Every plot is drawn by a function on one Axes, so the same drawing goes to its own PNG and to
`overview.png` (all six on one page).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window (SLURM nodes have no display)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from amp_lab.report.runs import RunData, group_label, group_runs, mean_std  # noqa: E402

Groups = list[tuple[str, list[RunData]]]


def _curve(runs: list[RunData], kind: str, key: str, x: str) -> tuple[np.ndarray, ...]:
    """Mean, min and max of `key` over the runs, at the steps every run logged."""
    per_run = [{r["step"]: (r.get(x), r.get(key)) for r in getattr(run, kind) if key in r}
               for run in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    xs = np.array([[p[s][0] for p in per_run] for s in steps], dtype=float).reshape(-1, len(runs))
    ys = np.array([[p[s][1] for p in per_run] for s in steps], dtype=float).reshape(-1, len(runs))
    return xs.mean(axis=1), ys.mean(axis=1), ys.min(axis=1), ys.max(axis=1)


def _lines(ax: Axes, groups: Groups, kind: str, key: str, x: str, ylabel: str) -> None:
    for label, runs in groups:
        xs, mean, lo, hi = _curve(runs, kind, key, x)
        (line,) = ax.plot(xs, mean, marker="o", markersize=3,
                          label=label + (f" (n={len(runs)})" if len(runs) > 1 else ""))
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("optimizer step" if x == "step" else "training time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def loss_vs_step(ax: Axes, groups: Groups) -> None:
    _lines(ax, groups, "train", "train/loss", "step", "train loss")
    ax.set_title("train loss vs step")


def loss_vs_time(ax: Axes, groups: Groups) -> None:
    _lines(ax, groups, "train", "train/loss", "time_s", "train loss")
    ax.set_title("train loss vs training time")


def val_acc(ax: Axes, groups: Groups) -> None:
    _lines(ax, groups, "val", "val/acc", "step", "val accuracy")
    ax.set_title("val accuracy")


def loss_scale(ax: Axes, groups: Groups) -> None:
    """Loss scale per run (log scale); an x marks each log step where steps were skipped."""
    for label, runs in groups:
        for run in runs:
            steps = [r["step"] for r in run.train]
            scale = [r.get("amp/loss_scale", np.nan) for r in run.train]
            (line,) = ax.plot(steps, scale, label=f"{label} [{run.label}]")
            skipped = [r.get("amp/skipped_steps", 0) for r in run.train]
            marks = [i for i, n in enumerate(skipped) if n > (skipped[i - 1] if i else 0)]
            ax.plot([steps[i] for i in marks], [scale[i] for i in marks], "x",
                    color=line.get_color(), markersize=8)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (x: skipped steps)")
    ax.set_title("loss scale and skipped steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")


def _bars(ax: Axes, groups: Groups, key: str, ylabel: str) -> None:
    stats = [mean_std([run.summary.get(key) for run in runs]) for _, runs in groups]
    means = [m if m is not None else 0.0 for m, _ in stats]
    ax.bar(range(len(groups)), means, yerr=[s or 0.0 for _, s in stats], capsize=4,
           color=[f"C{i}" for i in range(len(groups))])
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], rotation=20, ha="right",
                  fontsize="small")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def throughput(ax: Axes, groups: Groups) -> None:
    _bars(ax, groups, "mean_samples_per_s", "samples/s (warm-up excluded)")
    ax.set_title("throughput")


def peak_memory(ax: Axes, groups: Groups) -> None:
    _bars(ax, groups, "peak_memory_mb", "peak memory (MB)")
    ax.set_title("peak memory")


PLOTS: dict[str, Callable[[Axes, Groups], None]] = {
    "loss_vs_step": loss_vs_step, "loss_vs_time": loss_vs_time, "val_acc": val_acc,
    "loss_scale": loss_scale, "throughput": throughput, "peak_memory": peak_memory,
}


def write_plots(runs: list[RunData], out: Path, keys: list[str]) -> list[Path]:
    """One PNG per plot plus overview.png, in `out`; returns their paths."""
    groups = [(group_label(members, keys), members) for members in group_runs(runs).values()]
    paths = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, groups)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, draw in zip(axes.flat, PLOTS.values()):
        draw(ax, groups)
    fig.tight_layout()
    paths.append(out / "overview.png")
    fig.savefig(paths[-1], dpi=70)  # small enough to commit as a picture
    plt.close(fig)
    return paths
