"""A user's first hour, as the README shows it: the tour's commands run in a fresh clone exit 0
and print the lines the README shows (numbers aside), and every link of the README and docs/
leads somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

TOUR = "## A tour in five commands"
# A number standing on its own (not the 16 of fp16 or the 2 of fc2): values that vary between
# machines and runs, so the README's figures are examples, the words around them the claim.
NUMBER = re.compile(r"(?<![\w.])[-+±]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tour(text: str) -> list[tuple[str, list[str]]]:
    """The tour's commands, each with the lines the README shows under it (`...` elides)."""
    start = text.index(f"\n{TOUR}\n")
    section = text[start : text.index("\n## ", start + 1)]
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```console\n(.*?)^```", section, flags=re.M | re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif line.strip() != "...":
                steps[-1][1].append(line)
    return steps


def _collapsed(text: str) -> str:
    return " ".join(text.split())


def shown_pattern(line: str) -> re.Pattern[str]:
    """The README's line as a pattern: its words as written, any number where it has one; a
    report's verdict by its cells in order (its words follow the numbers: `matches` on one
    machine is `inconclusive` on another)."""
    if line.startswith("verdict: "):
        cells = [clause.split()[0] for clause in line.removeprefix("verdict: ").split("; ")]
        return re.compile("verdict: " + ".*?; ".join(f"{re.escape(cell)} " for cell in cells))
    line, parts, last = _collapsed(line), [], 0
    for number in NUMBER.finditer(line):
        parts += [re.escape(line[last : number.start()]), NUMBER.pattern]
        last = number.end()
    parts.append(re.escape(line[last:]))
    return re.compile("".join(parts))


def test_the_tour_has_its_five_commands():
    steps = tour((ROOT / "README.md").read_text())
    commands = [command for command, _ in steps]
    assert commands[0].startswith("python -m amp_lab model=")
    assert commands[1].startswith("python -m amp_lab -m ")
    assert commands[2].startswith("python -m amp_lab report ")
    assert commands[3].startswith("python -m amp_lab doctor ")
    assert "+experiment/cpu=" in commands[4]
    assert all(shown for _, shown in steps), "every command shows what it prints"


def test_shown_lines_match_their_output_with_other_numbers():
    pattern = shown_pattern("│ final_val_acc │ 0.8914 │ fp16 vs fp32: Δacc +0.0 pp, ±5.3")
    assert pattern.search(_collapsed("│ final_val_acc   │ 0.7 │ fp16 vs fp32: Δacc -1.2 pp, ±0.25"))
    assert not pattern.search("│ final_val_acc │ 0.7 │ fp32 vs fp32: Δacc -1.2 pp, ±0.25")
    verdict = shown_pattern("verdict: fp16 matches fp32 (Δacc +0.0 pp); bf16 vs fp32: inconclusive")
    assert verdict.search("verdict: fp16 vs fp32: inconclusive: 2 seeds; bf16 matches fp32 (...)")
    assert not verdict.search("verdict: bf16 matches fp32 (...); fp16 vs fp32: inconclusive")


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", markdown, flags=re.M)
    }


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading(doc):
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: {target}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text()), f"{doc.name}: {target}"


def test_the_help_names_pages_that_exist():
    help_text = (ROOT / "amp_lab" / "conf" / "hydra" / "help" / "amp_lab.yaml").read_text()
    pages = re.findall(r"\b((?:docs/)?[\w/]+\.md)\b", help_text)
    assert "docs/configuration.md" in pages
    for page in pages:
        assert (ROOT / page).is_file(), page


@pytest.mark.parametrize("doc", ["README.md", "docs/precision.md"])
def test_every_precision_mode_has_a_row_in_the_mode_tables(doc):
    from amp_lab.precision.modes import PRECISION_MODES

    rows = re.findall(r"^\| `(\w+)` \| (?:off|bf16|fp16) \|", (ROOT / doc).read_text(), flags=re.M)
    assert sorted(rows) == sorted(PRECISION_MODES)


@pytest.mark.slow
def test_the_readme_tour_runs_in_a_fresh_clone(tmp_path):
    clone = tmp_path / "amp_lab"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "PYTHONPATH": str(clone), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    for command, shown in tour((clone / "README.md").read_text()):
        words = command.split()
        assert words[0] == "python", command
        result = subprocess.run(
            [sys.executable, *words[1:]],
            cwd=clone,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, (command, result.stdout[-3000:])
        printed, position = _collapsed(result.stdout), 0
        for line in shown:  # in the README's order
            found = shown_pattern(line).search(printed, position)
            assert found, (command, line, result.stdout[-3000:])
            position = found.end()
