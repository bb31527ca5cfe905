"""The docs' tables, lists and figures are the code's: the modes' tables, FSDP's auto policy, the
settings free on resume, the bench's options and the GPU check's settings, the studies, a run's
files and record keys, the committed GPU figures, the numeric cliff."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import CONF_DIR, FAST, ROOT, settings
from helpers.docs import page, section

from amp_lab.build import build
from amp_lab.config import free_on_resume
from amp_lab.trainer import Trainer


def test_the_resume_rule_names_exactly_the_settings_free_on_resume():
    text = " ".join(page("sweeps.md").split())
    listed = text.split("marked `FREE_ON_RESUME` beside their field in `amp_lab/config.py` (")[1]
    listed = listed.split(";")[0]
    assert set(re.findall(r"`([\w.]+)`", listed)) == free_on_resume()


def _table_defaults(text: str) -> dict[str, str]:
    """Each `--option` row of a markdown table: its default cell."""
    rows = {}
    for row in (r for r in text.splitlines() if r.startswith("| `--")):
        names, default = row.split(" | ")[:2]
        for name in re.findall(r"`(--[a-z-]+)`", names):
            rows[name] = default
    return rows


def test_the_bench_options_tables_list_every_option_with_its_default(capsys):
    """benchmarks.md's Options: `amp_lab bench`'s table, then the one of what
    `python -m benchmarks.bench` adds."""
    from amp_lab.tools.bench.cli import DEFAULTS, parse_args
    from benchmarks.bench import PARTS, options

    def listed(*args) -> set[str]:
        with pytest.raises(SystemExit):
            parse_args(["--help"], *args)
        return set(re.findall(r"^\s+(--[a-z-]+)", capsys.readouterr().out, flags=re.M)) - {"--help"}

    shipped, repository = section("benchmarks.md", "Options").split("takes these too")
    rows, more = _table_defaults(shipped), _table_defaults(repository)
    assert set(rows) == listed()
    assert set(more) == listed(PARTS, "python -m benchmarks.bench", options) - set(rows)
    defaults = vars(parse_args([], PARTS, "python -m benchmarks.bench", options))
    for name, cell in {**rows, **more}.items():
        value = defaults[name[2:].replace("-", "_")]
        if isinstance(value, int):  # the numeric defaults the table states as `N`
            assert cell.strip("| ") == f"`{value}`", name
    for key, kinds in DEFAULTS.items():  # defaults per device: "CPU: ...; CUDA: ..."
        cells = rows[f"--{key.replace('_', '-')}"].split("CUDA:")
        for value, cell in zip(kinds, cells, strict=True):
            shown = " ".join(value) if isinstance(value, list) else str(value)
            assert shown in cell, key


def test_the_readme_and_sweeps_md_count_and_name_every_study():
    studies = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    numbers = "one two three four five six seven eight nine ten eleven twelve thirteen".split()
    count = re.search(r"`experiments/` holds (\w+) studies", page("README.md"))
    assert count and numbers.index(count.group(1)) + 1 == len(studies)
    named = section("sweeps.md", "Studies")
    assert [s for s in studies if f"`{s}`" not in named] == []


def test_every_file_and_record_key_a_run_writes_is_in_tracking_md(tmp_path):
    """A run with W&B offline and a checkpoint; Hydra's own files (`.hydra/`, the job log) come
    from the command line and are not written here. The records' and the summary's keys the
    page names are in what the run wrote."""
    overrides = [o for o in FAST if not o.startswith("logger.")]
    run = settings(*overrides, "checkpoint.every_steps=3", fast=False)
    summary = Trainer(build(run, tmp_path)).fit()
    text = page("tracking.md")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = {
        kind: set().union(*(r for r in records if r["kind"] == kind)) for kind in ("train", "val")
    }
    paragraph = text[
        text.index("\nTrain records hold") : text.index("\n## The W&B run: how to use")
    ]
    train, val = paragraph.split("Val records hold")
    assert len(set(re.findall(r"`(\w+/\w+)`", train))) >= 10
    assert set(re.findall(r"`(\w+/\w+)`", train)) - keys["train"] == set()
    assert set(re.findall(r"`(\w+/\w+)`", val.split(".")[0])) - keys["val"] == set()
    named = set(re.findall(r"`(\w+_(?:s|bytes))`", paragraph)) - {"time_s"}
    assert len(named) >= 7 and named - set(summary) == set() and "time_s" in keys["train"]
    table = text[text.index("\n## What a run writes") : text.index("\nTrain records hold")]
    named = " ".join(re.findall(r"^\| (.*?) \|", table, flags=re.M))
    written = sorted(p.name for p in tmp_path.iterdir())
    assert {"summary.json", "precision_audit.json", "wandb", "checkpoints"} <= set(written)
    assert [name for name in written if f"`{name}" not in named] == []
    [example] = re.findall(r"`(step_\d+\.pt)`", table)  # N in as many digits as the example's
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [
        f"step_{3:0{len(example) - len('step_.pt')}d}.pt"
    ]


def test_the_readmes_gpu_figures_are_the_committed_gpu_checks():
    """Each figure of the README's GPU table is in the bench.json files of the check it cites."""
    [folder] = re.findall(
        r"\]\((docs/gpu_check/[^/)]+)/README\.md\)", section("README.md", "GPU figures")
    )
    samples, overhead = {}, {}
    for path in (ROOT / folder).glob("*.json"):
        bench = json.loads(path.read_text())
        for r in bench["throughput"]:
            key = (r["model"], r["compile"], r["precision"])
            samples.setdefault(key, set()).add(round(r["samples_per_s"]))
        for r in bench["overhead"]:
            if r["variant"].startswith("default"):
                overhead[r["precision"]] = round(r["median_ratio"], 3)
    rows = [r.strip("|").split("|") for r in section("README.md", "GPU figures").splitlines()]
    [modes] = [[c.strip() for c in r[1:]] for r in rows if len(r) > 1 and r[0].strip() == ""]
    checked = 0
    for label, *cells in (r for r in rows if len(r) == len(modes) + 1 and r[0].strip()):
        label = label.strip()
        if set(label) <= set("-"):
            continue
        for mode, cell in zip(modes, cells, strict=True):
            figure = float(cell.split()[0])
            if label.startswith("overhead"):
                assert overhead[mode] == figure, (label, mode)
            else:
                model = "resnet50" if "resnet50" in label else "vit_base_patch16_224"
                assert figure in samples[(model, "compiled" in label, mode)], (label, mode)
            checked += 1
    assert checked == 16


def test_make_studies_job_count_in_tracking_md_is_the_studies_cpu_jobs():
    """The index's CPU job counts are checked against the configs in tests/test_experiments.py."""
    index = (ROOT / "experiments" / "README.md").read_text()
    cpu_jobs = [int(n) for n in re.findall(r"^\| \[\w+\].*\| \d+ / (\d+) \|$", index, flags=re.M)]
    assert len(cpu_jobs) == len(list((CONF_DIR / "experiment" / "cpu").glob("*.yaml")))
    shown = re.search(
        r"`make studies` reruns every study's CPU variant \((\d+) jobs", page("tracking.md")
    )
    assert shown and int(shown.group(1)) == sum(cpu_jobs)


@pytest.mark.parametrize("doc", ["README.md", "precision.md"])
def test_the_mode_tables_autocast_and_loss_scaling_are_each_modes(doc):
    from amp_lab.precision.modes import PRECISION_MODES, dtype_name

    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| ([^|]+) \| ([^|]+) \|", page(doc), flags=re.M)
    assert sorted(name for name, *_ in rows) == sorted(PRECISION_MODES)
    for name, autocast, scaling, weights in rows:
        mode = PRECISION_MODES[name]
        assert autocast == (dtype_name(mode.autocast_dtype) if mode.autocast_dtype else "off")
        assert scaling.strip() == ("dynamic (GradScaler)" if mode.dynamic_scaling else "none")
        if doc == "README.md":
            assert weights.split(";")[0].split(",")[0].split(":")[0] == dtype_name(mode.param_dtype)


def test_fsdp_mds_policy_table_is_what_auto_resolves_to():
    from amp_lab.components.fsdp import resolve_plan
    from amp_lab.precision.modes import dtype_name

    text = page("fsdp.md")
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (\w+) \| (\w+) \|", text, flags=re.M)
    assert len(rows) == 4
    for name, param, reduce, autocast in rows:
        plan = resolve_plan(settings(f"precision={name}"))
        assert (dtype_name(plan.param_dtype), dtype_name(plan.reduce_dtype)) == (param, reduce)
        assert autocast == ("off" if name == "fp32" else param)


def test_benchmarks_md_lists_every_setting_the_gpu_check_script_reads():
    """The script's header documents its environment; the docs' table names the same."""
    header = (ROOT / "scripts" / "gpu_check.sh").read_text().split("set -uo pipefail")[0]
    documented = re.findall(r"^#   ([A-Z_]+(?:, [A-Z_]+)*) ", header, flags=re.M)
    in_script = {name for names in documented for name in names.split(", ")}
    text = page("benchmarks.md")
    table = text[text.index("| variable | default |") : text.index("GPU time is scarce")]
    in_docs = set(
        re.findall(r"`([A-Z_]+)`", " ".join(r.split(" | ")[0] for r in table.splitlines()))
    )
    assert in_script >= {"BUDGET_S", "STEPS", "OVERHEAD_STEPS"} and in_docs == in_script


def test_the_hot_path_tables_modules_and_tests_exist():
    """benchmarks.md's "The hot path": each module under amp_lab/ and each test it names."""
    rows = [r.split(" | ") for r in section("benchmarks.md", "The hot path").splitlines()[5:]]
    rows = [r for r in rows if len(r) == 3]
    assert len(rows) >= 10
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for _, where, checked_by in rows:
        for module in re.findall(r"`([\w/]+\.py)`", where):
            assert (ROOT / "amp_lab" / module).is_file(), module
        for name in re.findall(r"`(test_\w+)`", checked_by):
            assert f"def {name}(" in tests, name
        for path in re.findall(r"`(tests/[\w/]+\.py)`", checked_by):
            assert (ROOT / path).is_file(), path


def test_sweeps_md_names_every_setting_and_the_partition_of_the_test_cluster():
    script = (ROOT / "scripts" / "slurm_cluster.sh").read_text()
    settings_read = set(re.findall(r"^#   (SLURM_CLUSTER_\w+) ", script, flags=re.M))
    named = " ".join(section("sweeps.md", "A SLURM to test against").split())
    assert len(settings_read) == 4 and settings_read == set(re.findall(r"SLURM_CLUSTER_\w+", named))
    assert "PartitionName=debug " in script and "MaxTime=04:00:00" in script
    assert "partition `debug`, no GPUs, a 4-hour time limit" in named


def _rounded(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=torch.float64).to(dtype).double().item()


def _short(x: float) -> str:
    """Two significant figures as the docs write them: 6.1e-9, 2.4e-4."""
    return re.sub(r"e(-?)0*(\d+)", r"e\1\2", f"{x:.1e}")


def test_amp_pitfalls_numeric_cliff_is_what_each_dtype_rounds_to():
    table = section("amp_pitfalls.md", "1. The numeric cliff").split("\n- Overflow")[0]
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    rows = [r.strip("|").split(" | ") for r in table.splitlines() if r.startswith("| ")][1:]
    assert len(rows) == 4
    for first, *cells, _ in rows[:3]:
        value = float(re.findall(r"[\d.]+(?:e-?\d+)?", first)[-1])
        for dtype, cell in zip(dtypes, cells, strict=True):
            got = _rounded(value, dtype)
            if cell == "exact":
                assert got == value
            elif cell.startswith("0: flushed"):
                assert got == 0.0
            elif cell.startswith("inf"):
                assert got == math.inf and f"max {torch.finfo(dtype).max:.0f}" in cell
            else:
                [shown] = re.findall(r"\(([\d.e-]+) relative", cell)
                assert _short(abs(got - value) / value) == shown, (first, dtype, cell)
    fp16, bf16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
    assert f"smallest subnormal ≈ {2.0**-24:.0e}".replace("e-08", "e-8") in table
    assert f"smallest normal ≈ {_short(fp16.smallest_normal)}" in table
    off = _rounded(1e-7, torch.float16) / 1e-7 - 1
    assert f"1e-7 survives as a subnormal, {off:.0%} off" in table
    assert f"at most {_short(fp16.eps / 2)}" in table and f"at most {_short(bf16.eps / 2)}" in table
    assert _rounded(1e5, torch.bfloat16) == 99840 and "99840" in table
    assert f"1e-5 is {_short(abs(_rounded(1e-5, torch.float16) - 1e-5) / 1e-5)} off" in table
    assert _rounded(2.9e-8, torch.float16) == 0 and "below 3e-8 it is 0" in table
