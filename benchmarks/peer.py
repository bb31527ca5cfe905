"""`--parts peer`: amp_lab against timm's own train.py, whole runs, alternated.

Each round runs the peer (`--peer-script`), then `python -m amp_lab`, as subprocesses on the same
ImageFolder for the same epochs (`--data-dir`, or synthetic JPEGs: timm's train.py has no
in-memory data). Per run: training samples/s after warm-up (amp_lab's `mean_samples_per_s`, the
peer's logged rates, see timm_peer.py) and the whole process's wall time. The comparison takes
medians over rounds, of each program's figures and of each round's ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from amp_lab.components.distributed import resolve_device
from amp_lab.compose import compose_settings
from amp_lab.config import ConfigError
from amp_lab.records import SUMMARY_FILE
from amp_lab.tools.bench import record
from amp_lab.tools.bench.runs import Report, run_overrides
from benchmarks.compile_cache import last_line, run_logged
from benchmarks.image_folder import write_image_folder
from benchmarks.timm_peer import timm_args, timm_rate


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
    ratios: list[float] = field(default_factory=list)  # per round: amp_lab's samples/s / peer's
    ratio: float | None = None  # the median round's (> 1: amp_lab trains faster)
    wall_ratio: float | None = None  # the median round's wall time ratio (< 1: amp_lab sooner)

    def median(self, program: str, key: str) -> float:
        """The median over rounds of one program's figure."""
        return statistics.median(getattr(r, key) for r in self.runs if r.program == program)

    def add(self, run: PeerRun) -> None:
        """Record a run; once a round has both, its ratios. A round's two runs are neighbours in
        time: their ratio cancels a machine's slow drift in load, which a ratio of medians over
        all rounds would not."""
        self.runs.append(run)
        rounds: dict[int, dict[str, PeerRun]] = {}
        for r in self.runs:
            rounds.setdefault(r.round, {})[r.program] = r
        pairs = [(p["amp_lab"], p["peer"]) for p in rounds.values() if len(p) == 2]
        if pairs:
            self.ratios = [amp.samples_per_s / peer.samples_per_s for amp, peer in pairs]
            self.ratio = statistics.median(self.ratios)
            self.wall_ratio = statistics.median(amp.wall_s / peer.wall_s for amp, peer in pairs)


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


def peer_data(args: argparse.Namespace) -> Path:
    """The ImageFolder both programs read: --data-dir (checked), or synthetic JPEGs written once
    to OUT/peer_images: --steps batches of --img-size px for training, one for validation."""
    if args.data_dir is not None:
        return args.data_dir
    root = args.out / "peer_images"
    if not (root / "val").is_dir():  # train/ is written first: val/ means complete
        write_image_folder(root, args.img_size, args.steps * args.batch_size, args.batch_size)
    return root.resolve()


def _run(name: str, command: list[str], log: Path, cwd: Path, threads: int | None) -> float:
    """Run one whole process, its output to `log`; its wall time, or a one-line error."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    code = run_logged(command, log, env, cwd)
    if code:
        raise ConfigError(f"{name} failed (exit {code}): {last_line(log)}; its whole log: {log}")
    return time.perf_counter() - start


def _amp_lab_rate(run_dir: Path, warmup: int) -> tuple[float, int]:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    counted = summary["steps"] - warmup
    if not summary.get("mean_samples_per_s") or counted < 1:
        raise ConfigError(
            f"amp_lab ran {summary['steps']} steps, none timed after "
            f"trainer.timing_warmup={warmup}; raise trainer.epochs"
        )
    return float(summary["mean_samples_per_s"]), counted


def compare(
    args: argparse.Namespace, overrides: list[str], data_dir: Path
) -> Iterator[PeerComparison]:
    """--rounds x (--peer-script, then amp_lab), each a whole run of `overrides`' settings on
    `data_dir`; yields the comparison after every run."""
    settings = compose_settings(overrides)
    device = resolve_device(str(settings.trainer.device))
    classes = len([p for p in (data_dir / "train").iterdir() if p.is_dir()])
    folder = args.out / "peer" / f"{settings.model.name}_{settings.precision.name}"
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
            str(args.peer_script),
            *timm_args(settings, data_dir, classes, device, folder / "peer_R"),
        ],
    )
    warmup = settings.trainer.timing_warmup
    for r in range(args.rounds):
        started, peer_out = time.time(), folder / f"peer_{r}"
        peer_out.mkdir(exist_ok=True)
        command = comparison.peer_command[:-1] + [str(peer_out)]  # --output: its own folder
        wall = _run(str(args.peer_script), command, folder / f"peer_{r}.log", folder, args.threads)
        rate, counted = timm_rate((folder / f"peer_{r}.log").read_text(errors="replace"), warmup)
        comparison.add(PeerRun("peer", r, rate, counted, wall, started))
        yield comparison
        started, run_dir = time.time(), folder / f"amp_lab_{r}"
        command = comparison.amp_lab_command[:-1] + [f"hydra.run.dir={run_dir}"]
        wall = _run("amp_lab", command, folder / f"amp_lab_{r}.log", folder, args.threads)
        comparison.add(PeerRun("amp_lab", r, *_amp_lab_rate(run_dir, warmup), wall, started))
        yield comparison


def part(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Each model x precision: the peer and amp_lab, alternated for --rounds rounds."""
    root = peer_data(args)
    done: list[PeerComparison] = []
    for model, precision in itertools.product(args.models, args.peer_precisions):
        overrides = run_overrides(  # whole runs, as a user runs them
            args,
            model,
            precision,
            "data=imagefolder",
            f"data.root={root}",
            f"data.num_workers={args.workers}",
            f"trainer.epochs={args.epochs}",
        )
        for comparison in compare(args, overrides, root):
            report(peer=[*done, comparison])
        done.append(comparison)
        amp_lab, peer = (comparison.median(p, "samples_per_s") for p in ("amp_lab", "peer"))
        print(
            f"peer {model} {precision}: amp_lab {amp_lab:.1f} vs peer {peer:.1f} samples/s "
            f"({comparison.ratio:.3f}x)",
            file=sys.stderr,
        )


def section(results: dict[str, list[Any]]) -> list[str]:
    comparisons: list[PeerComparison] = results.get("peer", [])
    rows = [  # a comparison without a ratio yet is the first round's peer run alone
        [c.model, c.precision, str(c.batch_size), str(c.img_size), str(c.epochs)]
        + [str(len(c.ratios)), f"{c.median('amp_lab', 'samples_per_s'):.1f}"]
        + [f"{c.median('peer', 'samples_per_s'):.1f}"]
        + [f"**{c.ratio:.3f}** ({min(c.ratios):.2f}–{max(c.ratios):.2f})"]
        + [f"{c.median(p, 'wall_s'):.1f}" for p in ("amp_lab", "peer")]
        + [f"{c.wall_ratio:.3f}"]
        for c in comparisons
        if c.ratio is not None
    ]
    return record.section(
        "Peer: amp_lab vs timm's train.py (training samples/s after warm-up and whole-process "
        "wall time, medians of rounds; ratios amp_lab / peer, the median round's)",
        "model | precision | batch | image | epochs | rounds | amp_lab samples/s | "
        "peer samples/s | **ratio** (rounds' range) | amp_lab wall s | peer wall s | wall ratio",
        rows,
        [f"- data: {c.data}; peer: `{' '.join(c.peer_command[1:])}`" for c in comparisons],
    )
