"""Every tool's argument errors are one line on stderr and exit code 2 (argparse's usage block
would be a second line), naming the tool's --help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

from amp_lab.tools.audit import main as audit
from amp_lab.tools.bench.cli import main as bench
from amp_lab.tools.doctor.cli import main as doctor
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
