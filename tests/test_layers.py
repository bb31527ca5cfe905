"""The build's parts stand below the build: no module the build uses imports the build, the Run,
the loop or a command that drives them, not even inside a function (CONTRIBUTING.md, Where
things go)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "amp_lab"
PARTS = ["components", "precision", "checkpoint", "tracking", "health", "audit", "numerics"]
ABOVE = ["build", "run", "trainer", "__main__", "audit_cli", "bench", "doctor", "report", "finder"]


def imported(path: Path) -> set[str]:
    """Every amp_lab module `path` imports, wherever the import stands."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("amp_lab.")}


@pytest.mark.parametrize("package", PARTS)
def test_no_part_of_the_build_imports_what_stands_above_it(package):
    above = tuple(f"amp_lab.{name}" for name in ABOVE)
    found = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in (PACKAGE / package).rglob("*.py")
        for name in imported(path)
        if name in above or name.startswith(tuple(f"{a}." for a in above))
    }
    assert not found


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from amp_lab.build import build\n")
    assert "amp_lab.build" in imported(module)
