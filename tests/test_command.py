"""Every tool's argument errors are one line on stderr and exit code 2 (argparse's usage block
would be a second line), naming the tool's --help; the tools that take overrides take them
before, between and after their options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

from amp_lab.tools import audit as audit_tool
from amp_lab.tools.audit import main as audit
from amp_lab.tools.bench.cli import main as bench
from amp_lab.tools.doctor.arguments import parse_args as doctor_args
from amp_lab.tools.doctor.cli import main as doctor
from amp_lab.tools.numerics import cli as numerics_cli
from amp_lab.tools.numerics.cli import main as numerics
from amp_lab.tools.report.compare import main as report


@pytest.mark.parametrize(
    "main, argv, start, end",
    [
        (
            audit,
            ["--nope"],
            "amp_lab: error: unrecognized arguments: --nope",
            "(amp_lab audit --help)",
        ),
        (numerics, ["--vs", "fp8"], "amp_lab: error: argument --vs: invalid choice", "--help)"),
        (doctor, ["--steps", "x"], "amp_lab: error: argument --steps: invalid int", "--help)"),
        (report, [], "amp_lab report: error: the following arguments are required", "--help)"),
        (bench, ["--rounds", "0"], "amp_lab bench: error: --steps, --rounds", "--help)"),
    ],
)
def test_an_argument_error_is_one_line_and_exit_2(capsys, main, argv, start, end):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2
    assert len(lines) == 1 and lines[0].startswith(start) and lines[0].endswith(end), lines


# each tool's options, each with its values; the overrides go in between them
OPTIONS = {
    "audit": (audit_tool.parse_args, [["--out", "a=b"]]),  # a one-value option's value keeps its =
    "doctor": (doctor_args, [["--steps", "8"], ["--search-fp32"], ["--budget", "5"]]),
    "numerics": (
        numerics_cli.parse_args,
        [["--vs", "fp32"], ["--also", "bf16", "fp16"], ["--steps", "2"], ["--out", "o"]],
    ),
}


@pytest.mark.parametrize("tool", OPTIONS)
def test_overrides_and_options_parse_in_any_order(tool):
    parse, options = OPTIONS[tool]
    overrides = ["precision=fp16", "model=test_convnext"]
    expected = parse([*overrides, *(word for option in options for word in option)])
    assert expected.overrides == overrides
    for first in range(len(options) + 1):
        for second in range(first, len(options) + 1):
            words = [*options[:first], [overrides[0]], *options[first:second], [overrides[1]]]
            words += options[second:]
            assert parse([w for group in words for w in group]) == expected, words


@pytest.mark.parametrize(
    "main, argv",
    [
        (audit, ["precision=fp16", "--out", "audit", "model=nope"]),
        (doctor, ["precision=fp16", "--steps", "8", "model=nope"]),
        (numerics, ["precision=fp16", "--vs", "fp32", "model=nope"]),  # the order
        (numerics, ["--also", "bf16", "model=nope"]),
    ],
)
def test_an_override_after_an_option_reaches_the_config(capsys, main, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output folders
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "model=nope is not an option of the model group" in lines[0]


HELP_WITHOUT_TORCH = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as stop:
    print("exit", stop.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "command",
    [
        ["amp_lab", "audit", "--help"],
        ["amp_lab", "numerics", "--help"],
        ["amp_lab", "doctor", "--help"],
        ["amp_lab", "doctor", "--steps", "x"],
        ["amp_lab", "report", "--help"],
        ["amp_lab", "bench", "--help"],
        ["amp_lab", "bench", "--rounds", "0"],
        ["benchmarks.bench", "--help"],
        ["benchmarks.doctor_suite", "--help"],
    ],
)
def test_a_tools_help_and_argument_errors_answer_before_torch_loads(command):
    """--help and a bad argument are read before torch, timm and wandb load (8-9 s each here)."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH, *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.splitlines()[-1] == f"exit {0 if '--help' in command else 2} False", (
        done.stdout[-2000:],
        done.stderr[-2000:],
    )
