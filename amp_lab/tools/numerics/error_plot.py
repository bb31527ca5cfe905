"""numerics.png: the divergence finder's error against depth (module outputs forward, weight
gradients backward), each mode's band dashed and its first flagged module named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window (SLURM nodes have no display)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

FLOOR = 1e-9  # an exact match (error 0) drawn at the floor of the log axis
TOP = 1e3  # a row holding inf/nan drawn at the top


def _shown(row: dict[str, Any]) -> float:
    return TOP if row["nonfinite"] > 0 else min(max(row["norm"], FLOOR), TOP)


def _panel(ax: Axes, modes: dict[str, Any], key: str, first: str, title: str) -> None:
    for i, (mode, found) in enumerate(modes.items()):
        rows = found[key]
        if not rows:
            continue
        colour = f"C{i}"
        depth = [r["index"] for r in rows]
        error = [_shown(r) for r in rows]
        ax.plot(depth, error, color=colour, lw=1.2, label=f"{mode}: norm-wise relative error")
        ax.plot(
            depth, [r["band"] for r in rows], color=colour, ls="--", lw=0.9, label=f"{mode}: band"
        )
        flagged = found["first_out_of_band"][first] or {}
        row = next((r for r in rows if r["module"] == flagged.get("module")), None)
        if row is not None:
            y = _shown(row)
            ax.plot([row["index"]], [y], "o", color=colour, ms=6)
            ax.annotate(
                f"{row['module']} ({row['flag']})",
                (row["index"], y),
                xytext=(6, 8 + 12 * i),
                textcoords="offset points",
                fontsize=7,
                color=colour,
            )
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(f"relative error vs reference (non-finite: {TOP:g})")
    ax.grid(True, which="major", alpha=0.3)
    low, high = ax.get_ylim()
    ax.set_ylim(low / 8, high * 2)  # room for the legend and the labels inside the axes
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=7, framealpha=0.8, ncol=2)


def plot(result: dict[str, Any], path: Path) -> None:
    """Write the figure of a finder result to `path`."""
    modes = result["modes"]
    fig, (fwd, bwd) = plt.subplots(1, 2, figsize=(12, 4.2))
    _panel(fwd, modes, "forward", "forward", "module outputs (forward order)")
    fwd.set_xlabel("forward call")
    _panel(bwd, modes, "params", "backward", "weight gradients (backward order)")
    bwd.set_xlabel("module (backward order)")
    reference = "fp32" if result["vs"] == "fp32" else "fp32 (eager and compiled each)"
    fig.suptitle(
        f"amp_lab numerics: {', '.join(modes)} against {reference}; "
        f"a module is flagged above {result['bands']['flag_factor']:g}x its band",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)  # into the folder the command made
    plt.close(fig)
