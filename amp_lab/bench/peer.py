"""`--parts peer`: amp_lab against timm's own train.py, whole runs, alternated.

Each round runs the peer (`--peer-script`), then `python -m amp_lab`, as subprocesses on the same
ImageFolder for the same epochs (`--data-dir`, or synthetic JPEGs: timm's train.py has no
in-memory data). Per run: training samples/s after warm-up (amp_lab's `mean_samples_per_s`, the
peer's logged rates, see timm_peer.py) and the whole process's wall time. The comparison takes
medians over rounds, of each program's figures and of each round's ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from amp_lab.bench.image_folder import write_image_folder
from amp_lab.bench.timm_peer import timm_args, timm_rate
from amp_lab.components.distributed import resolve_device
from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.records import SUMMARY_FILE


@dataclass
class PeerRun:
    program: str  # "amp_lab" or "peer"
    round: int
    samples_per_s: float  # training throughput after warm-up, as the module docstring says
    counted_steps: int
    wall_s: float  # the whole process
    started: float  # time.time() at the start: the runs' order


@dataclass
class PeerComparison:
    model: str
    precision: str
    batch_size: int
    img_size: int
    epochs: int
    data: str  # the ImageFolder both read
    amp_lab_command: list[str]
    peer_command: list[str]
    runs: list[PeerRun] = field(default_factory=list)

    def _median(self, program: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in self.runs if r.program == program)

    @property
    def amp_lab_samples_per_s(self) -> float:
        return self._median("amp_lab", "samples_per_s")

    @property
    def peer_samples_per_s(self) -> float:
        return self._median("peer", "samples_per_s")

    def _round_ratios(self, key: str) -> list[float]:
        # a round's two runs are neighbours in time: their ratio cancels a machine's slow drift
        # in load, which a ratio of medians over all rounds would not
        pairs: dict[int, dict[str, float]] = {}
        for r in self.runs:
            pairs.setdefault(r.round, {})[r.program] = getattr(r, key)
        return [p["amp_lab"] / p["peer"] for p in pairs.values() if len(p) == 2]

    @property
    def ratios(self) -> list[float]:
        """Per round: amp_lab's training throughput over the peer's."""
        return self._round_ratios("samples_per_s")

    @property
    def ratio(self) -> float:
        """The median round's throughput ratio (> 1: amp_lab trains faster)."""
        return statistics.median(self.ratios)

    @property
    def wall_ratio(self) -> float:
        """The median round's whole-process time ratio (< 1: amp_lab finishes sooner)."""
        return statistics.median(self._round_ratios("wall_s"))


def check_peer_script(path: Path | None) -> Path:
    if path is None or not path.is_file():
        raise ConfigError(
            f"--parts peer needs --peer-script path/to/timm/train.py (the file of a timm "
            f"checkout; pip's timm does not ship it), not {path}"
        )
    return path.resolve()


def check_data_dir(data_dir: Path) -> Path:
    if not ((data_dir / "train").is_dir() and (data_dir / "val").is_dir()):
        raise ConfigError(
            f"--data-dir {data_dir} needs train/<class>/ and val/<class>/ inside (timm's "
            "train.py reads those splits)"
        )
    return data_dir.resolve()


def peer_data(data_dir: Path | None, out: Path, batch_size: int, steps: int, size: int) -> Path:
    """The ImageFolder both programs read: the user's, or synthetic JPEGs written once."""
    if data_dir is not None:
        return check_data_dir(data_dir)
    root = out / "peer_images"
    if not (root / "val").is_dir():  # train/ is written first: val/ means complete
        write_image_folder(root, size, train=steps * batch_size, val=batch_size)
    return root.resolve()


def _run(name: str, command: list[str], log: Path, cwd: Path, threads: int | None) -> float:
    """Run one whole process, its output to `log`; its wall time, or a one-line error."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if code.returncode:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1] if lines else "no output"
        raise ConfigError(f"{name} failed (exit {code.returncode}): {last}; its whole log: {log}")
    return wall


def _amp_lab_rate(run_dir: Path, settings: AmpLabConfig) -> tuple[float, int]:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    counted = summary["steps"] - settings.trainer.timing_warmup
    if not summary.get("mean_samples_per_s") or counted < 1:
        raise ConfigError(
            f"amp_lab ran {summary['steps']} steps, none timed after "
            f"trainer.timing_warmup={settings.trainer.timing_warmup}; raise trainer.epochs"
        )
    return float(summary["mean_samples_per_s"]), counted


def compare(
    overrides: list[str],
    peer_script: Path,
    data_dir: Path,
    out: Path,
    rounds: int,
    threads: int | None,
    on_run: Callable[[PeerComparison], None],
) -> PeerComparison:
    """`rounds` x (the peer, then amp_lab), each a whole run of `overrides`' settings;
    `on_run` sees the comparison after every run."""
    settings = compose_settings(overrides)
    device = resolve_device(str(settings.trainer.device))
    classes = len([p for p in (data_dir / "train").iterdir() if p.is_dir()])
    name = f"{settings.model.name}_{settings.precision.name}"
    folder = out / "peer" / name
    folder.mkdir(parents=True, exist_ok=True)
    comparison = PeerComparison(
        settings.model.name,
        str(settings.precision.name),
        settings.trainer.batch_size,
        settings.data.img_size,
        settings.trainer.epochs,
        str(data_dir),
        # the commands as run, R standing for the round
        [sys.executable, "-m", "amp_lab", *overrides, f"hydra.run.dir={folder / 'amp_lab_R'}"],
        [
            sys.executable,
            str(peer_script),
            *timm_args(settings, data_dir, classes, device, folder / "peer_R"),
        ],
    )
    for r in range(rounds):
        started, peer_out = time.time(), folder / f"peer_{r}"
        peer_out.mkdir(exist_ok=True)
        command = comparison.peer_command[:-1] + [str(peer_out)]  # --output: its own folder
        wall = _run(str(peer_script), command, folder / f"peer_{r}.log", folder, threads)
        text = (folder / f"peer_{r}.log").read_text(errors="replace")
        rate, counted = timm_rate(text, settings.trainer.timing_warmup)
        comparison.runs.append(PeerRun("peer", r, rate, counted, wall, started))
        on_run(comparison)
        started, run_dir = time.time(), folder / f"amp_lab_{r}"
        command = comparison.amp_lab_command[:-1] + [f"hydra.run.dir={run_dir}"]
        wall = _run("amp_lab", command, folder / f"amp_lab_{r}.log", folder, threads)
        rate, counted = _amp_lab_rate(run_dir, settings)
        comparison.runs.append(PeerRun("amp_lab", r, rate, counted, wall, started))
        on_run(comparison)
    return comparison
