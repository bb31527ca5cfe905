"""The lab below, its tools above: no module the build uses imports the build, the Run, the loop
or a command that drives them, and nothing outside amp_lab/tools/ imports a tool, not even inside
a function (CONTRIBUTING.md, Where things go)."""

import ast
from importlib.util import resolve_name
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "amp_lab"
PARTS = [
    *("components", "precision", "checkpoint", "tracking", "health", "audit", "diagnostics"),
    "search",
    *("step.py", "config.py", "choices.py", "records.py", "errors.py"),
]
ABOVE = ["build", "run", "trainer", "__main__", "tools"]


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


def imports_of(files: list[Path], above: list[str]) -> set[str]:
    """'file imports module' for each module under `above` (amp_lab's names) that `files` import."""
    modules = tuple(f"amp_lab.{name}" for name in above)
    return {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in files
        for name in imported(
            path.read_text(), ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
        )
        if name in modules or name.startswith(tuple(f"{a}." for a in modules))
    }


@pytest.mark.parametrize("part", PARTS)
def test_no_part_of_the_build_imports_what_stands_above_it(part):
    files = [PACKAGE / part] if part.endswith(".py") else sorted((PACKAGE / part).rglob("*.py"))
    assert files and all(f.is_file() for f in files)
    assert not imports_of(files, ABOVE)


def test_nothing_outside_the_tools_imports_a_tool():
    """The entry point names the tools by their module path (amp_lab.__main__.TOOLS) and imports
    one only when asked to run it; no other module of the lab, nor the search sweeper, imports
    one."""
    outside = [
        path
        for path in sorted(
            [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "hydra_plugins").rglob("*.py")]
        )
        if PACKAGE / "tools" not in path.parents
    ]
    assert len(outside) > 60
    assert not imports_of(outside, ["tools"])


def test_the_lab_keeps_at_most_twelve_top_level_modules():
    """One concept per module, a package per concern: the top level holds the entry point, the
    schemas, the build, the Run, the loop, the step and what every command shares."""
    assert len(list(PACKAGE.glob("*.py"))) <= 12


def test_the_shipped_package_stays_within_its_line_budget():
    """amp_lab and hydra_plugins, every .py line counted (`find amp_lab hydra_plugins -name
    '*.py' | xargs cat | wc -l`): new code is paid for by removing code no user relies on."""
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "hydra_plugins").rglob("*.py")]
    assert sum(len(path.read_text().splitlines()) for path in files) <= 14_400


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
    assert "amp_lab.build" in imported(code, "amp_lab.diagnostics")


def test_among_the_tools_only_the_probe_launcher_builds_or_trains():
    """Every tool makes its runs through amp_lab/tools/probe.py: one list of quiet overrides, one
    build-and-fit call."""
    tools = [p for p in sorted((PACKAGE / "tools").rglob("*.py")) if p.name != "probe.py"]
    assert len(tools) > 30
    assert not imports_of(tools, ["build", "trainer"])
    assert imports_of([PACKAGE / "tools" / "probe.py"], ["build", "trainer"])
