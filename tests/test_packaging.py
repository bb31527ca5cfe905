"""The built wheel runs anywhere; CI, `make check` and pre-commit run the same checks; the layout
and the recipes CONTRIBUTING.md gives hold.

The wheel test installs into a fresh venv whose only link to the test's environment is a .pth
file naming that environment's site-packages (torch and the other dependencies, without a
second multi-GB install); the commands run from a directory outside the repo, without
PYTHONPATH, so only the installed package can answer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers import CONF_DIR, ROOT, settings

from amp_lab.choices import PrecisionName
from amp_lab.precision.modes import PRECISION_MODES

SMALL = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "trainer.device=cpu",
    "trainer.progress=false",
    "logger.mode=disabled",
]


def _run(*command: str | Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's amp_lab only
    return subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env={**env, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _build_wheel(tmp: Path) -> Path:
    """`pip wheel` from a copy of the sources (the build leaves build/ and *.egg-info behind)."""
    src = tmp / "src"
    for package in ("amp_lab", "hydra_plugins"):
        shutil.copytree(
            ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    result = _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        src,
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp / "dist",
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("amp_lab-*.whl")
    return wheel


def _venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv seeing this environment's packages through a .pth file; the wheel in it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv
        ).stdout.strip()
    )
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "amp_lab_test_deps.pth").write_text("\n".join(ours) + "\n")
    result = _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        wheel,
        cwd=venv,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("build"))


@pytest.mark.slow
def test_the_wheel_holds_every_config_the_search_sweeper_and_no_search_path_plugin(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.relative_to(ROOT).as_posix() for p in CONF_DIR.rglob("*.yaml")}
    assert configs and configs <= names, sorted(configs - names)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "amp_lab").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert {n for n in names if n.startswith("hydra_plugins/")} == {
        "hydra_plugins/amp_lab_search/__init__.py",
        "hydra_plugins/amp_lab_search/search_sweeper.py",
    }


@pytest.mark.slow
def test_the_installed_wheel_trains_sweeps_and_reports_outside_the_repo(wheel, tmp_path):
    site = _venv_with(wheel, tmp_path / "venv")
    command = tmp_path / "venv" / "bin" / "amp_lab"
    work = tmp_path / "work"  # outside the repo, no conf/ anywhere near
    work.mkdir()

    where = _run(
        tmp_path / "venv" / "bin" / "python",
        "-c",
        "import amp_lab; print(amp_lab.__file__)",
        cwd=work,
    )
    assert Path(where.stdout.strip()) == site / "amp_lab" / "__init__.py"

    result = _run(command, "--help", cwd=work)
    assert result.returncode == 0 and "Config groups" in result.stdout, result.stderr[-2000:]
    result = _run(command, "+search=lr", "--cfg", "hydra", cwd=work)  # Hydra finds the sweeper
    assert "amp_lab_search.search_sweeper.SearchSweeper" in result.stdout, result.stderr[-2000:]

    result = _run(
        command,
        *SMALL,
        "trainer.max_steps=10",
        "trainer.log_every=5",
        "hydra.run.dir=run",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10]

    # a packaged study, narrowed to one model and two seeds (its 18 jobs compose and build in
    # tests/test_experiments.py)
    study = ["+experiment/cpu=precision_modes", "model=test_vit_patch16", "trainer.seed=0,1"]
    result = _run(command, "-m", *study, "trainer.max_steps=5", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (work / "multirun").glob("*/*")  # the default sweep dir, in the user's folder
    jobs = sorted(p for p in sweep.iterdir() if (p / "summary.json").exists())
    assert len(jobs) == 6  # fp32, fp16, bf16, 2 seeds each
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 5, job.name

    result = _run(command, "report", sweep, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((sweep / "report" / "report.json").read_text())
    [group] = report["groups"]
    cells = {cell["value"]: cell for cell in group["cells"]}
    assert set(cells) == {"fp32", "fp16", "bf16"} and cells["fp32"]["reference"]
    assert all(cell["n"] == 2 for cell in cells.values())  # the seeds
    assert list((sweep / "report").glob("*.png"))

    result = _run(command, "doctor", "--help", cwd=work)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]


def _make_targets() -> dict[str, str]:
    """Every target in the Makefile with its `## ` description ('' when it has none)."""
    found = re.findall(
        r"^([a-z][a-z_-]*):[^=\n]*?(?:##\s*(.*))?$", (ROOT / "Makefile").read_text(), flags=re.M
    )
    return {name: (doc or "").strip() for name, doc in found}


def test_make_help_lists_every_target():
    targets = _make_targets()
    assert {"help", "run", "test", "test-fast", "bench", "check"} <= set(targets)
    assert not [name for name, doc in targets.items() if not doc]  # every one documented
    result = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listed = dict(line.split(maxsplit=1) for line in result.stdout.strip().splitlines())
    assert listed == targets


def test_ci_and_pre_commit_run_the_same_checks_as_make_check():
    check = re.search(r"^check:([^#\n]*)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert check is not None
    parts = check.group(1).split()
    assert parts == ["lint", "format-check", "typecheck"]
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
    entries = [h["entry"] for repo in hooks for h in repo["hooks"]]
    assert entries == [f"make {p}" for p in parts]
    ci = [line.split("#")[0].split() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [words[:2] for words in ci]
    assert commands.index(["make", "check"]) < commands.index(["make", "test"])


def test_a_precision_mode_is_one_table_row_plus_one_config_file():
    files = {p.stem for p in (CONF_DIR / "precision").glob("*.yaml")}
    assert files == set(PRECISION_MODES) == {member.value for member in PrecisionName}
    assert all(settings(f"precision={name}").precision.name == name for name in files)


@pytest.mark.parametrize(
    "doc, section",
    [
        ("CONTRIBUTING.md", r"^amp_lab/\n(.*?)^```"),  # the tree
        ("CONTRIBUTING.md", r"^## Where things go\n(.*?)^## "),
    ],
)
def test_the_documented_layout_names_every_package(doc, section):
    found = re.search(section, (ROOT / doc).read_text(), flags=re.M | re.S)
    assert found is not None
    packages = {p.parent.name for p in (ROOT / "amp_lab").glob("**/__init__.py")} - {"amp_lab"}
    named = set(re.findall(r"\b([a-z_]+)/", found.group(1)))
    assert packages | {"conf"} <= named, sorted(packages - named)


def test_the_tests_mirror_the_packages():
    """tests/tools/report/ tests amp_lab/tools/report/, tests/sweeps/ amp_lab/sweeps/
    (tools/audit.py, a module, is tested in tests/audit/ beside the audit it runs);
    tests/benchmarks/ tests the checkout's benchmarks/."""
    packages = {"benchmarks"} | {
        p.parent.relative_to(ROOT / "amp_lab").as_posix()
        for p in (ROOT / "amp_lab").glob("**/__init__.py")
        if "conf" not in p.parts and p.parent != ROOT / "amp_lab" / "tools"
    } - {"."}
    mirrored = {
        p.parent.relative_to(ROOT / "tests").as_posix()
        for p in (ROOT / "tests").glob("**/test_*.py")
        if p.parent != ROOT / "tests"
    }
    assert mirrored <= packages, sorted(mirrored - packages)  # no folder for what does not exist
    assert packages <= mirrored, sorted(packages - mirrored)
