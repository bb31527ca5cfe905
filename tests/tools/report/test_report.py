"""`python -m amp_lab report` on real runs: groups, references, deltas, health, verdicts, context,
unfinished and damaged runs, bad input, the W&B spec; asserted through report.json."""

from __future__ import annotations

import json
import math
import os

import pytest
import yaml
from helpers.reports import OVERFLOW, cells, report, run, summary
from rich.console import Console

from amp_lab.health.compare import BETTER, MATCHES, WORSE, Difference
from amp_lab.tools.report.compare import main
from amp_lab.tools.report.figures import Comparison, Stat
from amp_lab.tools.report.runs import load_runs
from amp_lab.tools.report.tables import print_tables
from amp_lab.tools.report.verdicts import accuracy_words
from amp_lab.tools.report.wandb_report import load_spec


def test_groups_never_mix_batch_sizes_and_the_reference_is_exactly_zero(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    dirs = {
        (p, b): run(
            sweep,
            f"{i}_precision={p},trainer.batch_size={b}",
            f"precision={p}",
            f"trainer.batch_size={b}",
        )
        for i, (p, b) in enumerate([("fp32", 16), ("bf16", 16), ("fp32", 8), ("bf16", 8)])
    }
    data = report(str(sweep))
    assert data["axis"] == "precision" and "precision.name" in data["axis_keys"]
    groups = {g["name"]: g for g in data["groups"]}
    assert set(groups) == {"trainer.batch_size=16", "trainer.batch_size=8"}
    for batch in (16, 8):
        group = groups[f"trainer.batch_size={batch}"]
        assert group["reference"] == "fp32"
        ref, bf16 = cells(group)["fp32"], cells(group)["bf16"]
        assert ref["reference"] and ref["runs"] == [
            f"{list(dirs).index(('fp32', batch))}_precision=fp32,trainer.batch_size={batch}"
        ]
        assert ref["delta"]["acc"]["mean"] == 0.0 and ref["delta"]["loss"]["mean"] == 0.0
        assert ref["delta"]["speedup"] == 1.0
        mine, theirs = summary(dirs[("bf16", batch)]), summary(dirs[("fp32", batch)])
        assert bf16["delta"]["acc"]["mean"] == pytest.approx(
            mine["final_val_acc"] - theirs["final_val_acc"]
        )
        assert bf16["delta"]["loss"]["mean"] == pytest.approx(
            mine["final_val_loss"] - theirs["final_val_loss"]
        )
        assert bf16["delta"]["speedup"] == pytest.approx(
            mine["mean_samples_per_s"] / theirs["mean_samples_per_s"]
        )
        assert bf16["figures"]["final_val_loss"]["mean"] == mine["final_val_loss"]
        assert group["verdict"].startswith("bf16 ")  # one sentence from the numbers
        assert "faster" not in group["verdict"]  # CPU speed is not a finding
    assert not data["context"]["speed_representative"]
    assert "CPU" in data["context"]["speed_note"] and data["context"]["devices"] == ["cpu"]
    assert data["context"]["host"]["torch"] and data["context"]["host"]["timm"]
    md = (sweep / "report" / "report.md").read_text()
    assert "Speed and memory are **not representative**" in md and data["rules"] in md
    assert "verdict: bf16" in capsys.readouterr().out  # the terminal tables
    # ... as an 80-column terminal shows them, one column per cell: each figure whole
    terminal = Console(width=80, record=True)
    print_tables(terminal, data)
    lines = terminal.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    heads = [[c.strip() for c in line.strip("┃ ").split("┃")] for line in lines if "┃" in line]
    assert heads == [["precision", "fp32 (ref)", "bf16"]] * 2
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines if "│" in line]
    assert ["status", "completed", "completed"] in rows
    for group in data["groups"]:
        delta = cells(group)["bf16"]["delta"]["acc"]["mean"]
        assert ["Δacc pp", "+0.0", f"{100 * delta:+.1f}"] in rows
    both = ("--by", "precision,trainer.batch_size", "--out", str(tmp_path / "both"))
    [group] = report(str(sweep), *both)["groups"]  # a mode's name by its group: not a bare fp32
    assert list(cells(group)) == [
        f"precision={p} batch_size={b}"
        for p, b in [("fp32", 16), ("bf16", 16), ("fp32", 8), ("bf16", 8)]
    ]
    assert group["reference"] == "precision=fp32 batch_size=16"  # fp32, first seen
    [group] = report(str(sweep), *both, "--ref", "bf16")["groups"]  # the first key's value
    assert group["reference"] == "precision=bf16 batch_size=16"


def test_diverged_mode_is_named_with_its_step_and_scale(tmp_path):
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32", *OVERFLOW, steps=8)
    fp16 = run(sweep, "1_precision=fp16", "precision=fp16", *OVERFLOW, steps=8)
    data = report(str(sweep))
    [group] = data["groups"]
    first = summary(fp16)["diagnostics"]["nonfinite"]["first_step"]
    scales = [
        r["amp/loss_scale"]
        for r in map(json.loads, (fp16 / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    collapsed = f"diverged at step {first} (loss scale fell to 2^{math.log2(min(scales)):.0f})"
    assert cells(group)["fp16"]["health"] == [collapsed]
    assert group["verdict"].startswith(f"fp16: {collapsed}")
    assert cells(group)["fp16"]["status"] == "diverged"
    [row] = [r for r in data["runs"] if r["value"] == "fp16"]
    assert row["health"] == [collapsed]


def test_ref_by_value_and_by_label_and_a_group_without_reference(tmp_path):
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=bf16", "precision=bf16")
    run(sweep, "1_precision=fp16", "precision=fp16")
    data = report(str(sweep))
    [group] = data["groups"]
    assert group["reference"] is None and "no precision=fp32 run" in group["reference_note"]
    assert group["verdict"].startswith("No reference: no precision=fp32 run in this group")
    assert all(c["delta"]["acc"]["mean"] is None for c in group["cells"])
    by_value = report(str(sweep), "--ref", "bf16")
    assert by_value["groups"][0]["reference"] == "bf16"
    by_label = report(str(sweep), "--ref", "1_precision=fp16")
    assert by_label["groups"][0]["reference"] == "fp16"
    by_path = report(str(sweep), "--ref", str(sweep / "0_precision=bf16"))
    assert by_path["groups"][0]["reference"] == "bf16"


def test_a_multi_key_axis_names_each_key_in_its_labels(tmp_path):
    """silent_noops' axis: a bare `{}` (empty optim.kwargs) or `true` says nothing; each key
    that varies is named, and --ref takes a label or the first key's value."""
    sweep = tmp_path / "sweep"
    default = run(sweep, "0_default", "optim.weight_decay=0.05")
    run(sweep, "1_eps", "+optim.kwargs.eps=1e-4", "optim.weight_decay=0.05")
    run(sweep, "2_eps_no_decay", "+optim.kwargs.eps=1e-4", "optim.weight_decay=0")
    by = ("--by", "optim.kwargs,optim.weight_decay")
    data = report(str(sweep), *by)
    [group] = data["groups"]
    eps, eps_no_decay = (
        'kwargs={"eps": 0.0001} weight_decay=0.05',
        'kwargs={"eps": 0.0001} weight_decay=0',
    )
    assert list(cells(group)) == ["kwargs={} weight_decay=0.05", eps, eps_no_decay]
    assert group["reference"] == "kwargs={} weight_decay=0.05"  # optim.kwargs' default
    assert group["verdict"].startswith(f"{eps} ")
    terminal = Console(width=80, record=True)  # three such labels side by side: 82 columns
    print_tables(terminal, data)
    text = terminal.export_text()
    tops = [line for line in text.splitlines() if line.startswith("┏")]
    assert len(tops) == 2 and all(line.endswith("┓") for line in tops)  # no cell past the edge
    assert "group 1, continued" in text
    assert report(str(sweep), *by, "--ref", eps_no_decay)["groups"][0]["reference"] == eps_no_decay
    (default / "summary.json").unlink()  # still running
    [group] = report(str(sweep), *by)["groups"]
    note = "no reference: the kwargs={} weight_decay=0.05 run did not complete"
    assert group["reference_note"] == note
    assert group["verdict"].startswith(f"N{note[1:]}; kwargs={{}} weight_decay=0.05: incomplete")
    out = ("--out", str(tmp_path / "out"))
    [group] = report(str(sweep / "1_eps"), str(sweep / "2_eps_no_decay"), *by, *out)["groups"]
    assert list(cells(group)) == ["0.05", "0"]  # one key varies: its value alone
    assert group["reference_note"].startswith("no reference: no optim.kwargs={} run in this")


def test_killed_damaged_and_refused_runs_are_read_as_far_as_they_go(tmp_path, caplog):
    sweep = tmp_path / "sweep"
    killed = run(sweep, "0_precision=fp32,trainer.seed=0", "precision=fp32", "trainer.seed=0")
    run(sweep, "1_precision=fp32,trainer.seed=1", "precision=fp32", "trainer.seed=1")
    damaged = run(sweep, "2_precision=bf16,trainer.seed=0", "precision=bf16", "trainer.seed=0")
    (killed / "summary.json").unlink()  # killed before its summary: the metrics hold the rest
    (damaged / "summary.json").write_text('{"status": "compl')  # cut short on a full disk
    (damaged / ".hydra" / "config.yaml").write_text("precision: [unclosed")
    with (damaged / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")  # valid JSON, not a record
    with (damaged / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe\n")  # not even UTF-8
    refused = sweep / "3_precision=fp16,trainer.seed=0" / ".hydra"  # refused: .hydra/ only
    refused.mkdir(parents=True)
    (refused / "overrides.yaml").write_text(yaml.safe_dump(["precision=fp16", "trainer.seed=0"]))
    with caplog.at_level("WARNING", logger="amp_lab.tools.report.runs"):
        data = report(str(sweep))
    assert "summary.json is unreadable" in caplog.text
    [group] = data["groups"]  # the refused run's missing settings are the others' shared ones
    fp32, bf16, fp16 = (cells(group)[v] for v in ("fp32", "bf16", "fp16"))
    val = [
        r
        for r in map(json.loads, (killed / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "val"
    ]
    assert fp32["figures"]["final_val_acc"]["n"] == 2
    assert fp32["status"] == "1× incomplete: no summary.json, 1× completed"
    runs = {r["label"]: r for r in data["runs"]}
    assert runs["0_precision=fp32,trainer.seed=0"]["final_val_acc"] == val[-1]["val/acc"]
    assert runs["0_precision=fp32,trainer.seed=0"]["health"] == ["incomplete: no summary.json"]
    # the only completed fp32 run (seed 1) is the reference: bf16 seed 0 has no pair
    assert bf16["delta"]["acc"]["paired"] is False and bf16["delta"]["acc"]["mean"] is not None
    assert fp16["status"] == "not started: no records (refused, or never ran)"
    assert "fp16: not started" in group["verdict"]


def test_labels_are_unique_across_sweeps_and_accepted_by_ref(tmp_path):
    for sweep in ("a", "b"):
        run(tmp_path / sweep, "0_precision=fp32", "precision=fp32")
    labels = [r.label for r in load_runs([tmp_path / "a", tmp_path / "b"])]
    assert labels == ["a/0_precision=fp32", "b/0_precision=fp32"]
    data = report(
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        "--ref",
        "b/0_precision=fp32",
        "--out",
        str(tmp_path / "out"),
    )
    [group] = data["groups"]  # identical settings: one cell of two runs
    assert group["cells"][0]["runs"] == labels


def test_bad_input_is_one_line_and_loses_nothing(tmp_path, capsys):
    good = run(tmp_path / "runs", "a", "precision=bf16")
    (tmp_path / "empty").mkdir()
    capsys.readouterr()  # the run's own output
    for args, message in [
        ([str(tmp_path / "empty")], "holds no amp_lab runs"),
        ([str(tmp_path / "nope")], "is not a directory"),
        ([str(good), "--by", "scaler.nope"], "--by scaler.nope: no run has"),
        ([str(good), "--ref", "zzz"], "--ref zzz is neither a run nor a value of precision"),
        ([str(good), "--out", str(good / "summary.json")], "summary.json: it is a file; pass"),
        ([str(good), "--readme", str(good / "metrics.jsonl")], "is not a markdown file; pass"),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("amp_lab report: error: ") and message in err, err
        assert err.count("\n") == 1  # one line, no traceback
    assert (good / "summary.json").exists() and not (good / "report").exists()


def test_wandb_report_groups_like_the_report(tmp_path, monkeypatch, capsys):
    """The spec, in the library's own serialisation, loads back into a wandb_workspaces Report:
    per comparison group a heading, its reference and verdict, a run set narrowed to its
    settings whose run table groups by them plus the axis, curves grouped by the axis (mean,
    min-max band) and the summary figures as bars; then parallel coordinates over leaf keys."""
    import wandb_workspaces.reports.v2 as wr

    sweep = tmp_path / "sweep"
    for i, (p, b) in enumerate([("fp32", 16), ("bf16", 16), ("fp32", 8)]):
        run(sweep, f"{i}_p={p},b={b}", f"precision={p}", f"trainer.batch_size={b}")
        (sweep / f"{i}_p={p},b={b}" / "wandb_run_id").write_text(f"id{i}\n")
    monkeypatch.setenv("WANDB_MODE", "offline")
    capsys.readouterr()
    assert main([str(sweep), "--wandb"]) == 0
    spec = sweep / "report" / "wandb_report.json"
    [told] = [line for line in capsys.readouterr().out.splitlines() if "W&B" in line]
    assert told == (
        f"W&B report spec written to {spec} (offline); to publish it (WANDB_API_KEY set, "
        f"WANDB_MODE not offline): wandb sync {sweep}/*/wandb/offline-run-* && "
        f"python -m amp_lab report {sweep} --wandb"
    )
    report_obj = load_spec(spec.read_text())
    assert [type(b).__name__ for b in report_obj.blocks] == [
        "H1", "MarkdownBlock",
        *["H2", "MarkdownBlock", "PanelGrid"] * 2,
        "H2", "PanelGrid",
    ]  # fmt: skip
    assert report_obj.blocks[2].text == "Group 1: trainer.batch_size=16"
    assert report_obj.blocks[3].text.startswith("**Reference:** fp32\n\n**Verdict:** bf16 vs fp32")
    grids = [block for block in report_obj.blocks if isinstance(block, wr.PanelGrid)]
    ids = "(Metric(\"ID\") == 'id0' or Metric(\"ID\") == 'id1' or Metric(\"ID\") == 'id2')"
    assert [g.runsets[0].filters for g in grids[:2]] == [
        f'{ids} and Config("trainer.batch_size") == {b}' for b in (16, 8)
    ]
    # W&B stores a nested config key as section.value.key: the run table groups by precision
    assert [g.runsets[0].groupby for g in grids[:2]] == [
        ["config.trainer.value.batch_size", "config.precision.value.name"]
    ] * 2
    for grid in grids[:2]:
        lines = [p for p in grid.panels if isinstance(p, wr.LinePlot)]
        assert [p.y[0].name for p in lines] == ["train/loss", "val/acc", "amp/loss_scale"]
        assert {(p.groupby.name, p.groupby_aggfunc, p.groupby_rangefunc) for p in lines} == {
            ("precision.name", "mean", "minmax")
        }
        bars = [p for p in grid.panels if isinstance(p, wr.BarPlot)]
        assert [p.metrics[0].name for p in bars] == [
            "mean_samples_per_s", "peak_memory_mb", "skipped_steps", "final_loss_scale"
        ]  # fmt: skip
        assert {p.groupby.name for p in bars} == {"precision.name"}
    [parallel] = grids[2].panels
    names = [c.metric.name for c in parallel.columns]
    assert names[:2] == ["precision.name", "trainer.batch_size"]


def test_readme_findings_replace_only_the_marked_block(tmp_path):
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32")
    run(sweep, "1_precision=bf16", "precision=bf16")
    readme = tmp_path / "study" / "README.md"
    readme.parent.mkdir()
    readme.write_text(
        "# study\n\nintro\n<!-- amp_lab.report:start -->\nold\n"
        "<!-- amp_lab.report:end -->\n\nReading the report: ...\n"
    )
    out = tmp_path / "study" / "report"
    data = report(str(sweep), "--out", str(out), "--readme", str(readme))
    text = readme.read_text()
    assert text.startswith("# study\n\nintro\n<!-- amp_lab.report:start -->\nMade with:")
    assert text.endswith("<!-- amp_lab.report:end -->\n\nReading the report: ...\n")
    assert "stale findings" not in text and f"**Verdict:** {data['groups'][0]['verdict']}" in text
    assert "![overview of the report](report/overview.png)" in text
    assert "Speed and memory are **not representative**" in text
    assert main([str(sweep), "--readme", str(tmp_path / "missing.md")]) == 2


@pytest.mark.parametrize(
    "acc, loss, words",
    [
        (
            Difference(0.004, 0.003, 3, MATCHES),
            Difference(0.004, 0.002, 3, MATCHES),
            "bf16 matches fp32 (Δacc +0.4 ± 0.3 pp, Δloss +0.4 ± 0.2%, 3 seeds)",
        ),
        (
            Difference(-0.03, 0.01, 3, WORSE),
            Difference(0.001, 0.002, 3, MATCHES),
            "bf16 is worse than fp32 (Δacc -3.0 ± 1.0 pp, Δloss +0.1 ± 0.2%, 3 seeds)",
        ),
        (
            Difference(0.02, 0.01, 3, BETTER),
            Difference(0.05, 0.01, 3, WORSE),
            "bf16 differs from fp32 (Δacc +2.0 ± 1.0 pp, Δloss +5.0 ± 1.0%, 3 seeds)",
        ),
        (
            Difference(0.121, 1.22, 2, None),
            Difference(-0.2, 1.5, 2, None),
            "bf16 vs fp32: inconclusive: 2 seeds, noise ±122.0 pp "
            "(Δacc +12.1 ± 122.0 pp, Δloss -20.0 ± 150.0%)",
        ),
        (
            Difference(-0.03, None, 1, None),
            Difference(0.001, None, 1, None),
            "bf16 vs fp32: inconclusive: 1 seed, noise unknown (Δacc -3.0 pp, Δloss +0.1%)",
        ),
    ],
)
def test_verdict_words_say_the_judges_verdict_and_its_interval(acc, loss, words):
    comp = Comparison(
        Stat(acc.mean, 0.0, acc.n), Stat(loss.mean, 0.0, loss.n), 0, None, None, acc, loss
    )
    assert accuracy_words("bf16", "fp32", comp) == words


def test_speed_is_judged_only_on_an_unloaded_gpu(tmp_path, monkeypatch):
    """The same runs: on a (pretended) idle GPU the verdict states the speed-up and memory; with
    the load above the cores it says why not, and the verdict has no speed words."""
    import amp_lab.tools.report.context as context

    sweep = tmp_path / "sweep"
    fp32 = run(sweep, "0_precision=fp32", "precision=fp32")
    bf16 = run(sweep, "1_precision=bf16", "precision=bf16")
    monkeypatch.setattr(context, "run_device", lambda run: "cuda")
    monkeypatch.setattr(context.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    data = report(str(sweep))
    assert data["context"]["speed_representative"] and data["context"]["devices"] == ["cuda"]
    speedup = summary(bf16)["mean_samples_per_s"] / summary(fp32)["mean_samples_per_s"]
    memory = summary(bf16)["peak_memory_mb"] / summary(fp32)["peak_memory_mb"]
    speed = (
        "the same speed"
        if abs(speedup - 1) <= 0.05
        else f"{speedup:.2g}× " + ("faster" if speedup > 1 else "the speed")
    )
    if abs(memory - 1) > 0.05:
        speed += f", {abs(1 - memory):.0%} {'less' if memory < 1 else 'more'} memory"
    assert data["groups"][0]["verdict"].endswith(f"), {speed}.")
    cores = os.cpu_count() or 1
    monkeypatch.setattr(context.os, "getloadavg", lambda: (cores + 1.0, 1.0, 1.0))
    loaded = report(str(sweep))
    assert not loaded["context"]["speed_representative"]
    assert loaded["context"]["speed_note"] == (
        f"the load average ({cores + 1.0:.1f}) was above the {cores} cores"
    )
    assert loaded["groups"][0]["verdict"].endswith(").")


def test_the_runners_health_entries_are_shown_in_its_words(tmp_path):
    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32")
    bf16 = run(sweep, "1_precision=bf16", "precision=bf16")
    record = summary(bf16)
    # as amp_lab/health/rules.py writes its findings
    words = "unstable: 2 of 4 steps skipped (50%)"
    record["health"] = [{"rule": "skips", "step": 4, "words": words, "evidence": "..."}]
    (bf16 / "summary.json").write_text(json.dumps(record))
    data = report(str(sweep))
    [row] = [r for r in data["runs"] if r["value"] == "bf16"]
    assert row["health"] == [words] and cells(data["groups"][0])["bf16"]["health"] == [words]
    md = (sweep / "report" / "report.md").read_text()
    assert f"- `1_precision=bf16`: {words}" in md


def test_wandb_report_online_is_saved_for_the_keys_default_entity(tmp_path, monkeypatch, capsys):
    """With a key and a network `--wandb` calls the library's `save()` (stood in for here: no
    network) on the report the offline spec holds, its entity the key's default, and prints the
    URL; no spec is written."""
    import wandb_workspaces.reports.v2 as wr

    import amp_lab.tools.report.wandb_report as wandb_report

    sweep = tmp_path / "sweep"
    run(sweep, "0_precision=fp32", "precision=fp32")
    run(sweep, "1_precision=bf16", "precision=bf16")
    saved = []
    monkeypatch.setattr(wandb_report, "_api", lambda: type("Api", (), {"default_entity": "team"}))
    monkeypatch.setattr(wr.Report, "save", lambda self: saved.append(self))
    monkeypatch.setattr(wr.Report, "url", property(lambda self: f"https://wandb.ai/{self.entity}"))
    assert main([str(sweep), "--wandb"]) == 0
    [report_obj] = saved
    assert report_obj.entity == "team" and report_obj.project == "amp_lab"
    runsets = [rs for b in report_obj.blocks for rs in getattr(b, "runsets", [])]
    assert runsets and {(rs.entity, rs.project) for rs in runsets} == {("team", "amp_lab")}
    assert "W&B report: https://wandb.ai/team" in capsys.readouterr().out
    assert not (sweep / "report" / "wandb_report.json").exists()
