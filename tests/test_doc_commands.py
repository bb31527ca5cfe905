"""The commands the docs show are what amp_lab takes: every command with a run's overrides composes
(each value of a sweep), so do the README's config examples and --help's examples; the README's
bad-input lines are what amp_lab prints; every --option given to a tool is one it has."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from functools import cache

import pytest
from helpers import CONF_DIR, ROOT, run_cli
from helpers.docs import PAGES, page, section
from hydra.core.override_parser.overrides_parser import OverridesParser

from amp_lab.__main__ import TOOLS  # each has its own parser and tests
from amp_lab.compose import compose_settings

# `python -m amp_lab ARGS`, `amp_lab ARGS`, `torchrun ... -m amp_lab ARGS`, after any VAR=value;
# `python -m amp_lab doctor ARGS` too: the doctor, the audit and numerics take a run's overrides
TRAIN = re.compile(
    r"^(?:[A-Z_]+=\S+ )*(?:python -m amp_lab(?:\.doctor)?|amp_lab|torchrun .*?-m amp_lab)\s(.*)$"
)
OVERRIDE_TOOLS = {"doctor", "audit", "numerics"}
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
TOOL_COMMAND = re.compile(r"(?:python -m (benchmarks\.\w+)|amp_lab (\w+))\s(.*)$")
# the checkout's benchmarks the docs show beside the tools, each with its own --help
BENCHMARKS = ["benchmarks.bench", "benchmarks.doctor_suite", "benchmarks.lead_time"]


def training_commands(markdown: str) -> list[list[str]]:
    """The overrides of each command in the page's bash and console blocks that takes a run's
    overrides: a training run, the doctor, the audit, numerics."""
    commands = []
    for kind, block in re.findall(r"^```(bash|console)\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if kind == "console" and not line.startswith("$ "):
                continue  # what a command printed
            found = TRAIN.match(line.removeprefix("$ ").split(" #")[0].strip())
            words = shlex.split(found.group(1).replace("$HOME", "/home/user")) if found else []
            if words[:1] and words[0] in TOOLS:
                if words[0] not in OVERRIDE_TOOLS:
                    continue  # report and bench take paths and options
                words = words[1:]
            if found:
                commands.append([w for w in words if "=" in w and not w.startswith(("<", "-"))])
    return commands


def each_value(overrides: list[str]) -> list[list[str]]:
    """A sweep's command lines, one per value of each swept key (the other keys at their first
    value): every value the sweep would run is composed once."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [
        [f"{o.get_key_element()}={v}" for v in _ends(o)]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    first = [v[0] for v in values]
    return [first] + [
        [*first[:i], value, *first[i + 1 :]] for i, v in enumerate(values) for value in v[1:]
    ]


def _ends(override) -> list[str]:
    """A sweep's values; a search's interval (`tag(log, interval(1e-4, 1e-2))`) at its ends."""
    if override.is_interval_sweep():
        return [str(override.value().start), str(override.value().end)]
    return list(override.sweep_string_iterator())


@cache
def composes(overrides: tuple[str, ...]) -> None:
    """compose_settings, once per command line in the session (pages repeat their examples)."""
    compose_settings(list(overrides))  # ConfigError names the bad override


@pytest.mark.slow  # a Hydra compose per command line: about 0.3 s each
@pytest.mark.parametrize("doc", PAGES)
def test_every_training_command_the_docs_show_composes(doc):
    for command in training_commands(page(doc)):
        for overrides in each_value(command):
            composes(tuple(overrides))


def test_the_docs_show_training_commands_where_expected():
    """The extraction finds the commands (a regex that matched nothing would pass above)."""
    counts = {doc: len(training_commands(page(doc))) for doc in PAGES}
    assert counts["README.md"] >= 3 and counts["sweeps.md"] >= 6 and counts["fsdp.md"] >= 6
    assert counts["precision.md"] >= 6 and counts["recipes.md"] >= 6
    assert ["precision=fp32,bf16"] in [
        [w for w in c if w.startswith("precision=")] for c in training_commands(page("README.md"))
    ]


@pytest.mark.slow
def test_every_example_of_the_readmes_config_table_composes():
    rows = [r for r in section("README.md", "Config groups").splitlines() if r.startswith("| `")]
    examples = [e for row in rows for e in re.findall(r"`([^`]+)`", row.rsplit(" | ", 1)[1])]
    assert len(examples) > 30
    for example in examples:
        words = [w.replace("$HOME", "/home/user") for w in example.split() if w != "-m"]
        for overrides in each_value(words):
            composes(tuple(overrides))


def test_the_readmes_bad_input_lines_are_what_amp_lab_prints(tmp_path):
    [block] = re.findall(r"^```text\n(.*?)^```", section("README.md", "Config groups"), re.M | re.S)
    lines = block.splitlines()
    shown = {lines[i][len("$ amp_lab ") :]: lines[i + 1] for i in range(0, len(lines), 2)}
    assert len(shown) == 3
    for override, line in shown.items():
        result = run_cli(override, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [line]
    assert "(`HYDRA_FULL_ERROR=1` shows Hydra's own report instead)" in page("README.md")
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}
    full = subprocess.run(
        [sys.executable, "-m", "amp_lab", "precision=fp17"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "Traceback" in full.stderr
    assert "MissingConfigException: In 'config': Could not find 'precision/fp17'" in full.stderr


def test_the_help_names_every_tool_and_its_training_examples_compose():
    footer = (CONF_DIR / "hydra" / "help" / "amp_lab.yaml").read_text().split("footer: |")[1]
    named = re.findall(r"`amp_lab ([\w|]+) ARGS`", footer)  # `amp_lab doctor|report|bench ARGS`
    assert sorted(t for words in named for t in words.split("|")) == sorted(TOOLS)
    examples = [TRAIN.match(line.split(" #")[0].strip()) for line in footer.splitlines()]
    runs = [shlex.split(m.group(1)) for m in examples if m]
    runs = [words for words in runs if not set(words[:1]) & set(TOOLS)]
    assert len(runs) >= 4
    for words in runs:
        for overrides in each_value([w for w in words if "=" in w]):
            composes(tuple(overrides))


def test_help_does_not_import_wandb(tmp_path):
    """tracking.md: "`wandb` is imported when a run starts, never at `--help`"."""
    assert "`wandb` is imported when a run starts, never at `--help`" in page("tracking.md")
    script = (
        "import sys\nsys.argv = ['amp_lab', '--help']\nfrom amp_lab.__main__ import cli\n"
        "try:\n    cli()\nexcept SystemExit:\n    pass\n"
        "print('wandb' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert "Config groups" in done.stdout and done.stdout.splitlines()[-1] == "False"


def _options(tool: str) -> set[str]:
    """The --options a tool's (or a benchmark's) --help lists."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        importlib.import_module(TOOLS.get(tool, tool)).main(["--help"])
    return set(OPTION.findall(printed.getvalue()))


def test_every_option_the_docs_pass_to_a_tool_is_one_it_has():
    """`amp_lab bench --parts ...`, `amp_lab doctor --search-fp32`, `python -m benchmarks.bench
    --parts peer ...` in code blocks and inline code: each option is in the tool's --help."""
    known = {tool: _options(tool) for tool in [*TOOLS, *BENCHMARKS]}
    used = 0
    for doc in PAGES:
        text = page(doc)
        blocks = re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S)
        lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`([^`\n]+)`", text)
        for line in lines:
            for found in TOOL_COMMAND.finditer(line.removeprefix("$ ").split(" #")[0]):
                tool = found.group(1) or found.group(2)
                if tool in known:
                    options = OPTION.findall(found.group(3))
                    assert set(options) <= known[tool], (doc, line)
                    used += len(options)
    assert used > 50
