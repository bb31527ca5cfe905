"""A report's findings written into a markdown file (a study's README), between two markers.

Everything between `<!-- amp_lab.report:start -->` and `<!-- amp_lab.report:end -->` is replaced;
a file without the markers gets them, with the findings, at its end. The text around them (the
question, how to read the report, what a finding means) stays the author's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from amp_lab.report.context import markdown as context_markdown
from amp_lab.report.tables import group_sections

START, END = "<!-- amp_lab.report:start -->", "<!-- amp_lab.report:end -->"


def findings(data: dict[str, Any], picture: str) -> str:
    """The commands, the context, the rules, each group's verdict and table, the overview."""
    return "\n".join(
        [
            context_markdown(data["context"]),
            "",
            data["rules"],
            "",
            *group_sections(data, "####"),
            f"![overview of the report]({picture})",
        ]
    )


def write_block(readme: Path, body: str) -> None:
    """Replace what lies between the markers of `readme` with `body` (appended with markers
    when it has none)."""
    text = readme.read_text()
    block = f"{START}\n{body}\n{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(text)
