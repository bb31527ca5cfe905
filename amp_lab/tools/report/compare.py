"""`python -m amp_lab report PATH... [--by KEY] [--ref RUN|VALUE] [--out DIR] [--wandb]`.

Compares runs group by group along one axis (groups.py), or a search's studies (search.py);
prints the tables and verdicts, writes report.json, report.md and a picture to DIR (default:
`<PATH>/report`), and with --wandb the same comparison as a W&B Report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from amp_lab.command import error, parser
from amp_lab.tools.report.document import build
from amp_lab.tools.report.groups import study_axis
from amp_lab.tools.report.runs import ReportError, load_runs
from amp_lab.tools.report.search import is_search, print_search, search_data
from amp_lab.tools.report.search import markdown as search_markdown
from amp_lab.tools.report.tables import findings, print_tables, report_markdown, write_block


def make_report(args: argparse.Namespace, argv: list[str]) -> Path:
    """Load the runs, compare them (a search's sweep folder: its studies), print and write the
    report; returns report.md. `argv`: the command line, for the report's context."""
    from amp_lab.tools.report.plots import plot_overview, plot_search

    paths, readme = args.paths, args.readme
    console = Console()
    if not console.is_terminal:
        console.width = 200  # logs and pipes: whole rows, not 80-column wrapping
    if readme is not None and (not readme.is_file() or readme.suffix != ".md"):
        raise ReportError(f"--readme {readme} is not a markdown file; pass an existing .md file")
    common = paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    out = args.out or common / "report"
    search = is_search(paths)  # a search's sweep folder: its studies, not a comparison of runs
    if search and (args.by is not None or args.ref is not None):
        raise ReportError(
            f"{paths[0]} is an LR search: its report compares each study's best LR, along "
            "no --by and against no --ref; drop them (or pass its trials' run folders)"
        )
    runs = [] if search else load_runs(paths)
    by, ref = (args.by, None) if args.by else study_axis(runs)  # --ref wins over either
    data = search_data(paths[0], argv) if search else build(runs, by, args.ref or ref, argv)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = "it is a file" if out.is_file() else str(err.strerror).lower()
        raise ReportError(
            f"cannot write the report to {out}: {why}; pass --out DIR, a folder you can write"
        ) from None
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    if search:  # `view`: the findings, given the picture's path
        print_search(console, data)
        picture, view = plot_search(data, out), search_markdown
        text = f"# amp_lab search: {paths[0]}\n\n{view(data, picture.name)}"
    else:
        print_tables(console, data)
        picture, view = plot_overview(runs, data, out), findings
        text = report_markdown(data, picture.name)
    report = out / "report.md"
    report.write_text(text + "\n")
    console.print(f"report: {report}")
    if readme is not None:
        write_block(readme, view(data, os.path.relpath(picture, readme.parent)))
        console.print(f"findings written into {readme}")
    if args.wandb and not search:
        from amp_lab.tools.report.wandb_report import publish

        publish(runs, data, out, console)
    return report


def main(argv: list[str] | None = None) -> int:
    """The command line; exit code 2 on bad input."""
    cli = parser(
        "python -m amp_lab report",
        tool="amp_lab report",
        description="Compare amp_lab runs group by group along one axis: tables, verdicts, "
        "report.json, report.md and plots.",
    )
    cli.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="multirun directories or run directories",
    )
    cli.add_argument(
        "--by",
        metavar="KEY",
        help="the axis compared: a settings group or key, e.g. scaler.init_scale (default: "
        "the runs' report.by, which a study's config sets, else precision)",
    )
    cli.add_argument(
        "--ref",
        metavar="RUN|VALUE",
        help="each group's reference: a value on the axis (e.g. 65536), or a "
        "run's label or directory (default: the runs' report.ref, else fp32 or the key's "
        "default)",
    )
    cli.add_argument(
        "--out", type=Path, metavar="DIR", help="output folder (default: <PATH>/report)"
    )
    cli.add_argument(
        "--wandb", action="store_true", help="also build a W&B Report (offline: its spec as JSON)"
    )
    cli.add_argument(
        "--readme",
        type=Path,
        metavar="FILE",
        help="also write the verdicts, tables and overview into FILE, between "
        "its amp_lab.tools.report markers (a study's README)",
    )
    args = cli.parse_args(argv)
    try:
        make_report(args, sys.argv[1:] if argv is None else argv)
    except ReportError as err:
        return error(str(err), "amp_lab report")
    return 0
