"""The build's parts stand below the build: no module the build uses imports the build, the Run,
the loop or a command that drives them, not even inside a function (CONTRIBUTING.md, Where
things go)."""

import ast
from importlib.util import resolve_name
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "amp_lab"
PARTS = [
    *("components", "precision", "checkpoint", "tracking", "health", "audit", "numerics", "search"),
    *("step.py", "config.py", "choices.py", "records.py", "errors.py"),
]
ABOVE = ["build", "run", "trainer", "__main__", "audit_cli", "bench", "doctor", "report", "finder"]


def imported(source: str, package: str) -> set[str]:
    """Every amp_lab module `source` (a module of `package`) imports, wherever the import
    stands, relative ones resolved."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = resolve_name("." * node.level + (node.module or ""), package)
            names |= {module, *(f"{module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("amp_lab.")}


@pytest.mark.parametrize("part", PARTS)
def test_no_part_of_the_build_imports_what_stands_above_it(part):
    files = [PACKAGE / part] if part.endswith(".py") else sorted((PACKAGE / part).rglob("*.py"))
    assert files and all(f.is_file() for f in files)
    above = tuple(f"amp_lab.{name}" for name in ABOVE)
    found = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in files
        for name in imported(
            path.read_text(), ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
        )
        if name in above or name.startswith(tuple(f"{a}." for a in above))
    }
    assert not found


@pytest.mark.parametrize(
    "code",
    [
        "def f():\n    from amp_lab.build import build\n",
        "import amp_lab.build as b\n",
        "from ..build import build\n",
        "from .. import build\n",
    ],
)
def test_the_check_sees_every_way_to_import(code):
    assert "amp_lab.build" in imported(code, "amp_lab.numerics")
