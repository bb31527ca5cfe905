"""The report's pictures (matplotlib, Agg): overview.png, a row of panels per comparison group,
a line per cell (mean over its seeds, min-max band), each axis value one colour in every row;
search.png, a search's loss against LR."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window (SLURM nodes have no display)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from amp_lab.tools.report.runs import RunData  # noqa: E402

Curve = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # steps, mean, min, max


def _band(per_run: list[dict[Any, float]]) -> tuple[Curve, float | None]:
    """Mean, min and max over the series (step -> value) at the steps all of them hold, up to the
    first step where one is not finite; and that step (None when all are finite)."""
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    ys = np.array([[p[s] for p in per_run] for s in steps], dtype=float).reshape(-1, len(per_run))
    bad = ~np.isfinite(ys).all(axis=1)
    cut = int(np.argmax(bad)) if bad.any() else len(steps)
    ys, xs = ys[:cut], np.array(steps[:cut], dtype=float)
    stop = float(steps[cut]) if bad.any() else None
    if not len(xs):
        return (xs, xs, xs, xs), stop
    return (xs, ys.mean(axis=1), ys.min(axis=1), ys.max(axis=1)), stop


def curve(runs: list[RunData], kind: str, key: str) -> tuple[Curve, float | None]:
    """`key` of the runs' `kind` records as a band (see _band)."""
    return _band(
        [{r["step"]: r[key] for r in getattr(run, kind) if r.get(key) is not None} for run in runs]
    )


def _draw(ax: Axes, c: Curve, stop: float | None, color: str, label: str, band: bool) -> None:
    """The mean line (and band); a diverged curve ends in an x at its last finite point, or at
    the top edge over its divergence step when it has none."""
    xs, mean, lo, hi = c
    ax.plot(xs, mean, color=color, marker="o", markersize=2, label=label)
    if band and len(xs):  # an empty band on a log axis leaves matplotlib no limits to tick
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
    if stop is None:
        return
    # y in axes fractions
    top: dict[str, Any] = {"transform": ax.get_xaxis_transform(), "clip_on": False}
    x, y, where = (xs[-1:], mean[-1:], {}) if len(xs) else ([stop], [0.97], top)
    ax.plot(x, y, "x", color=color, markersize=10, markeredgewidth=2, **where)


Cells = list[tuple[dict[str, Any], list[RunData]]]


def _lines(ax: Axes, cells: Cells, colors: dict[str, str], kind: str, key: str, title: str) -> None:
    """A line per cell: `key` of its runs' `kind` records (train or val)."""
    ax.set(title=title, xlabel="optimizer step")
    for cell, runs in cells:
        c, stop = curve(runs, kind, key)
        _draw(ax, c, stop, colors[cell["value"]], _label(cell), len(runs) > 1)


def _label(cell: dict[str, Any]) -> str:
    seeds = f" ({cell['n']} seeds)" if cell["n"] > 1 else ""
    return cell["value"] + seeds + (" ref" if cell["reference"] else "")


def _note(ax: Axes, text: str) -> None:
    """`text` in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


loss_panel = partial(_lines, kind="train", key="train/loss", title="train loss")
val_panel = partial(_lines, kind="val", key="val/acc", title="val accuracy")


def _paired_delta(runs: list[RunData], refs: list[RunData]) -> tuple[Curve, float | None]:
    """Train loss minus the reference's, run by run with the reference run of the same seed
    (the reference's mean where no seed matches), averaged at the steps all pairs share."""
    by_seed = {ref.seed: ref for ref in refs}
    diffs, stops = [], []
    for run in runs:
        (xs, mine, _, _), stop = curve([run], "train", "train/loss")
        (rx, theirs, _, _), _ = curve(
            [by_seed[run.seed]] if run.seed in by_seed else refs, "train", "train/loss"
        )
        common, i, j = np.intersect1d(xs, rx, return_indices=True)
        diffs.append(dict(zip(common, mine[i] - theirs[j])))
        stops.append(stop)
    return _band(diffs)[0], min((s for s in stops if s is not None), default=None)


def delta_panel(ax: Axes, cells: Cells, colors: dict[str, str]) -> None:
    """Train loss minus the reference's, paired by seed (0 is the reference)."""
    ref = next((r for c, r in cells if c["reference"]), None)
    ax.set(title="Δ train loss vs reference", xlabel="optimizer step")
    if ref is None:
        _note(ax, "no reference")
        return
    refs = [run for run in ref if run.ok] or ref
    for cell, runs in cells:
        c, stop = _paired_delta(refs if cell["reference"] else runs, refs)
        _draw(ax, c, stop, colors[cell["value"]], _label(cell), False)
    ax.axhline(0.0, color="grey", linewidth=0.8)


def scale_panel(ax: Axes, cells: Cells, colors: dict[str, str]) -> None:
    """The loss scale (log2 axis), cells whose runs do not scale their loss left out."""
    scaled = [(c, r) for c, r in cells if any(scales_loss(run) for run in r)]
    _lines(ax, scaled, colors, "train", "amp/loss_scale", "loss scale")
    if not scaled:  # another group scales; this one does not
        _note(ax, "no run scales its loss")
        ax.set(xticks=[], yticks=[])
        return
    ax.set_yscale("log", base=2)


def scales_loss(run: RunData) -> bool:
    """Whether the run scaled its loss: dynamic scaling resolved on, or a scale other than 1."""
    if (run.summary.get("precision") or {}).get("dynamic_scaling"):
        return True
    return any(r.get("amp/loss_scale") not in (None, 1.0) for r in run.train)


Panel = Callable[[Axes, Cells, dict[str, str]], None]


def overview(runs: list[RunData], data: dict[str, Any]) -> Figure:
    """The figure: a row per group, a column per panel, a legend right of each row."""
    by_label = {run.label: run for run in runs}
    rows = [
        (g, [(c, [by_label[r] for r in c["runs"]]) for c in g["cells"]]) for g in data["groups"]
    ]
    panels: list[Panel] = [loss_panel, delta_panel, val_panel]
    if any(scales_loss(run) for run in runs):
        panels.append(scale_panel)
    values = list(dict.fromkeys(c["value"] for g in data["groups"] for c in g["cells"]))
    colors = {v: f"C{i % 10}" for i, v in enumerate(values)}
    fig, axes = plt.subplots(
        len(rows),
        len(panels),
        figsize=(3.6 * len(panels) + 2.6, 2.9 * len(rows)),
        squeeze=False,
        layout="constrained",
    )
    for ax_row, (group, cells) in zip(axes, rows):
        for ax, panel in zip(ax_row, panels):
            panel(ax, cells, colors)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize="small")
        ax_row[0].set_ylabel(f"group {group['id']}", fontsize="medium", fontweight="bold")
        ax_row[-1].legend(
            *ax_row[0].get_legend_handles_labels(),  # the same cells in every panel of the row
            loc="upper left",
            bbox_to_anchor=(1.03, 1.0),
            borderaxespad=0.0,
            fontsize="small",
            title="\n".join(_wrap(group["name"], 28)),
            title_fontsize="small",
        )
    return fig


def _wrap(text: str, width: int) -> list[str]:
    """The group's name over lines of about `width` characters, split at its commas."""
    lines: list[str] = []
    for part in text.split(", "):
        if lines and len(lines[-1]) + len(part) + 2 <= width:
            lines[-1] += ", " + part
        else:
            lines.append(part)
    return lines


def plot_overview(runs: list[RunData], data: dict[str, Any], out: Path) -> Path:
    """overview.png in `out`; returns its path."""
    return _save(overview(runs, data), out / "overview.png", dpi=80)  # small enough to commit


def _study(ax: Axes, study: dict[str, Any], color: str) -> None:
    """One study: its completed trials, a star at its best, rings and x's at pruned and failed."""
    rows = sorted(study["rows"], key=lambda r: r["lr"])
    done = [r for r in rows if r["state"] == "COMPLETE"]
    label = f"{study['study']} ({study['trials']} trials)"
    xs, ys = [r["lr"] for r in done], [r["val_loss"] for r in done]
    ax.plot(xs, ys, "o-", color=color, label=label, markersize=4)
    if study["best"]:
        ax.plot(study["best"]["lr"], study["best"]["val_loss"], "*", color=color, markersize=14)
    reported = [r for r in rows if r["last_reported"] is not None]
    pruned = [r for r in reported if r["kind"] in ("pruned", "missed")]  # not diverged
    xs, ys = [r["lr"] for r in pruned], [r["last_reported"] for r in pruned]
    ax.plot(xs, ys, "o", mfc="none", color=color)
    failed = [r["lr"] for r in rows if r["state"] == "FAIL" or r["kind"] == "diverged"]
    top = ax.get_xaxis_transform()  # x in data, y in axes fractions: 0.97 is the top edge
    ax.plot(failed, [0.97] * len(failed), "x", color=color, ms=10, mew=2, transform=top)


def plot_search(data: dict[str, Any], out: Path) -> Path:
    """search.png in `out`: final val loss against lr.base (log scale), one colour per study."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, study in enumerate(data["studies"]):
        _study(ax, study, f"C{i % 10}")
    title = "loss against LR per study (x at the top: failed or diverged; ring: pruned)"
    ax.set(xscale="log", xlabel="lr.base", ylabel="final val loss", title=title)
    ax.legend(loc="best", fontsize="small")  # inside the axes: the figure keeps its width
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out / "search.png", dpi=120)


def _save(fig: Figure, path: Path, dpi: int) -> Path:
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
