"""overview.png stays readable at any number of runs: one row per group, short legend labels
outside the axes and inside the figure, the loss-scale panel only when a run scales its loss."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml
from helpers.reports import OVERFLOW, report, run

from amp_lab.tools.report.plots import overview
from amp_lab.tools.report.runs import load_runs

# 3 groups (lr.base) x {fp32, fp16, bf16 seed 0, bf16 seed 1}: 12 runs, job folders named with
# every override, as a sweep with many fixed overrides names them (~150 characters)
LONG = (
    "data.img_size=16,logger=disabled,model=test_vit,trainer.batch_size=16,"
    "trainer.log_every=2,trainer.max_steps=4,trainer.progress=False,trainer.timing_warmup=1"
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plots") / "sweep"
    jobs = [
        (lr, p, seed)
        for lr in ("1e-3", "2e-3", "3e-3")
        for p, seed in (("fp32", 0), ("fp16", 0), ("bf16", 0), ("bf16", 1))
    ]
    for i, (lr, p, seed) in enumerate(jobs):
        run(
            root,
            f"{i}_{LONG},lr.base={lr},precision={p},trainer.seed={seed}",
            f"lr.base={lr}",
            f"precision={p}",
            f"trainer.seed={seed}",
        )
    return root


def _legends_and_axes(fig: plt.Figure) -> tuple[list, list]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    return legends, fig.axes


@pytest.mark.slow
def test_legends_lie_inside_the_figure_and_off_every_axes(sweep: Path) -> None:
    runs = load_runs([sweep])
    data = report(str(sweep))
    assert [g["name"] for g in data["groups"]] == [
        "lr.base=0.001",
        "lr.base=0.002",
        "lr.base=0.003",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Tight layout not applied"
        fig = overview(runs, data)
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends, axes = _legends_and_axes(fig)
    assert len(legends) == 3 and len(axes) == 3 * 4  # a row per group; loss scale: fp16 scales
    box = fig.bbox
    for legend in legends:
        assert [t.get_text() for t in legend.get_texts()] == ["fp32 ref", "fp16", "bf16 (2 seeds)"]
        extent = legend.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, extent
        assert box.y0 <= extent.y0 and extent.y1 <= box.y1, extent
        assert not any(extent.overlaps(ax.get_window_extent(renderer)) for ax in axes)
    for ax in axes:  # titles, tick labels and axis labels inside the figure too
        tight = ax.get_tightbbox(renderer)
        assert box.x0 <= tight.x0 and tight.x1 <= box.x1 and tight.y1 <= box.y1, ax.get_title()
    colors = {
        line.get_label(): line.get_color()
        for ax in axes
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }
    assert len(set(colors.values())) == 3  # one colour per precision, the same in every row
    plt.close(fig)
    assert (sweep / "report" / "overview.png").stat().st_size > 20_000


@pytest.mark.slow
def test_delta_panel_is_zero_for_the_reference(sweep: Path) -> None:
    runs = load_runs([sweep])
    data = json.loads((sweep / "report" / "report.json").read_text())
    fig = overview(runs, data)
    delta_ax = fig.axes[1]
    assert delta_ax.get_title() == "Δ train loss vs reference"
    lines = {line.get_label(): line for line in delta_ax.get_lines()}
    assert list(lines["fp32 ref"].get_ydata()) == [0.0, 0.0]
    fp16 = [r for r in runs if r.label.endswith("precision=fp16,trainer.seed=0")][0]
    fp32 = [r for r in runs if r.label.endswith("precision=fp32,trainer.seed=0")][0]
    expected = fp16.train[-1]["train/loss"] - fp32.train[-1]["train/loss"]
    assert lines["fp16"].get_ydata()[-1] == pytest.approx(expected)
    plt.close(fig)


@pytest.mark.slow
def test_no_loss_scale_panel_without_scaling_and_a_diverged_run_is_marked(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32")
    run(sweep, "1_precision=bf16", "precision=bf16")
    fig = overview(load_runs([sweep]), report(str(sweep)))
    assert [ax.get_title() for ax in fig.axes] == [
        "train loss",
        "Δ train loss vs reference",
        "val accuracy",
    ]
    plt.close(fig)
    run(sweep, "2_precision=fp32", "precision=fp32", *OVERFLOW, steps=8)
    fp16 = run(sweep, "3_precision=fp16", "precision=fp16", *OVERFLOW, steps=8)
    data = report(str(sweep))
    fig = overview(load_runs([sweep]), data)
    assert len(fig.axes) == 2 * 4  # fp16 scales its loss: a loss-scale column
    assert [t.get_text() for t in fig.axes[3].texts] == ["no run scales its loss"]  # fp32, bf16
    marks = [line for line in fig.axes[4].get_lines() if line.get_marker() == "x"]
    first_bad = next(
        r["step"]
        for r in map(json.loads, (fp16 / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train" and not math.isfinite(r["train/loss"])
    )
    assert [list(m.get_xdata()) for m in marks] == [[first_bad]]  # at its divergence
    plt.close(fig)


def test_a_scaled_cell_whose_runs_share_no_step_still_draws(tmp_path) -> None:
    """A diverged fp16 run beside a refused one (no records): the cell's curves share no step,
    and the loss-scale panel (a log axis) is drawn without a band."""
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32", *OVERFLOW, steps=8)
    run(sweep, "1_precision=fp16", "precision=fp16", *OVERFLOW, steps=8)
    refused = sweep / "2_precision=fp16,trainer.seed=3" / ".hydra"
    refused.mkdir(parents=True)
    (refused / "overrides.yaml").write_text(yaml.safe_dump(["precision=fp16", "trainer.seed=3"]))
    data = report(str(sweep))
    assert [(c["value"], c["n"]) for c in data["groups"][0]["cells"]] == [("fp32", 1), ("fp16", 2)]
    assert (sweep / "report" / "overview.png").stat().st_size > 10_000
