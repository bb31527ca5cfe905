"""The project's pages as the doc tests read them: README.md, CONTRIBUTING.md and docs/*.md."""

from __future__ import annotations

from helpers.compose import ROOT

PAGES = ["README.md", "CONTRIBUTING.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]


def page(name: str) -> str:
    """README.md and CONTRIBUTING.md from the root, any other page from docs/."""
    folder = ROOT if name in ("README.md", "CONTRIBUTING.md") else ROOT / "docs"
    return (folder / name).read_text()


def section(name: str, title: str) -> str:
    """A page's `## title` section, up to the next `## ` heading."""
    text = page(name)
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]
