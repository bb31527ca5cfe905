"""How early the early warnings come: `python -m amp_lab.health.lead_time` (`make warnings-bench`).

Diverging cases run with a probe and a log window at every step; a run diverges at its first step
whose loss is non-finite or above twice the lowest loss before it. For each early warning
(rules.EARLY) the table gives the steps between its firing and that divergence. The healthy
runs are the seed-0 jobs of each CPU study but those built to fail (PHENOMENA), single-process
ones: a warning that fires on one of them, while no other rule does, is a false alarm. Writes
lead_time.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from amp_lab.compose import CONF_DIR, compose_settings
from amp_lab.config import register
from amp_lab.health.rules import EARLY
from amp_lab.records import METRICS_FILE

# test_vit on 16 px digits: 40 steps with a probe and a judged window at every step
BASE = ["model=test_vit", "data.img_size=16", "trainer.device=cpu", "trainer.progress=false"]
EVERY_STEP = ["trainer.log_every=1", "diagnostics.every=1", "trainer.eval_every=0"]
DIVERGING = {  # the published phenomena that end in divergence, and fp16's own failures
    "attention_logits_bf16": ["precision=bf16", "lr.base=0.3"],
    "attention_logits_fp32": ["precision=fp32", "lr.base=0.3"],
    "fp16_state_eps": ["optim.state_dtype=fp16", "lr.base=3e-3"],
    "half_model_eps": ["pitfall=half_model", "precision=fp16", "lr.base=3e-3"],
    "fp16_overflow_growth": ["precision=fp16", "lr.base=0.1", "scaler.init_scale=1e4"],
    "fp16_underflow": ["precision=fp16_noscale", "fault.loss_multiplier=1e-6", "lr.base=1e-2"],
}
LEAD_TARGET = 10  # steps: a warning this early is in time to act on
# studies built to show a failure: their broken cells are the phenomena, not healthy runs
PHENOMENA = ("attention_logits", "pure_bf16_updates", "silent_noops")


@dataclass
class CaseResult:
    """One run: its first divergence step (None: it never diverged) and each warning's step."""

    name: str
    overrides: list[str]
    diverged_at: int | None
    warned: dict[str, int] = field(default_factory=dict)  # early rule -> the step it fired
    other: list[str] = field(default_factory=list)  # the other rules that fired

    @property
    def lead(self) -> int | None:
        """Steps between the first warning and the divergence (negative: it came after)."""
        if self.diverged_at is None or not self.warned:
            return None
        return self.diverged_at - min(self.warned.values())


def divergence_step(losses: list[tuple[int, float]]) -> int | None:
    """The first step whose loss is non-finite or above twice the lowest loss before it."""
    lowest = math.inf
    for step, loss in losses:
        if not math.isfinite(loss) or loss > 2 * lowest:
            return step
        lowest = min(lowest, loss)
    return None


def run_case(name: str, overrides: list[str], out: Path) -> CaseResult:
    """Train one case in-process (its own output folder) and read what it says of itself."""
    from amp_lab.build import build  # torch loads only when a case runs
    from amp_lab.trainer import Trainer

    settings = compose_settings([*overrides, "trainer.resume=false", "checkpoint.enabled=false"])
    trainer = Trainer(build(settings, out / name))
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        summary = trainer.fit()
    rows = [json.loads(r) for r in (out / name / METRICS_FILE).read_text().splitlines()]
    losses = [(r["step"], r["train/loss"]) for r in rows if r["kind"] == "train"]
    health = summary.get("health") or []
    return CaseResult(
        name,
        overrides,
        divergence_step(losses),
        {e["rule"]: e["step"] for e in health if e["rule"] in EARLY},
        [e["rule"] for e in health if e["rule"] not in EARLY],
    )


def study_jobs(study: str) -> list[list[str]]:
    """A CPU study's sweep jobs of seed 0 (its `hydra.sweeper.params` grid), probed every 10
    steps."""
    from hydra import compose, initialize_config_dir

    experiment = f"+experiment/cpu={study}"
    register()  # the schema the configs name
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose("config", [experiment], return_hydra_config=True).hydra.sweeper.params
    axes = [
        [f"{key}={value}" for value in str(values).split(",")]
        for key, values in params.items()
        if key != "trainer.seed"
    ]
    # a probe at every log step (the CPU studies log every 10), so every warning is judged
    probe = ["diagnostics.every=10"]
    return [[experiment, "trainer.seed=0", *job, *probe] for job in itertools.product(*axes)]


def healthy_studies() -> list[str]:
    """The CPU studies whose runs are meant to train: all but PHENOMENA."""
    names = sorted(p.stem for p in (CONF_DIR / "experiment" / "cpu").glob("*.yaml"))
    return [n for n in names if n not in PHENOMENA]


def table(diverging: list[CaseResult], healthy: list[CaseResult]) -> Table:
    """Per warning: its lead on each diverging case, and its false alarms on healthy runs."""
    grid = Table(title="early warnings: steps before divergence (loss non-finite or > 2x min)")
    grid.add_column("warning")
    for case in diverging:
        grid.add_column(f"{case.name}\n(diverged at {case.diverged_at or '-'})", justify="right")
    grid.add_column(f"false alarms\n(of {len(healthy)} healthy)", justify="right")
    for rule in (*EARLY, "any"):
        cells = []
        for case in diverging:
            step = (
                min(case.warned.values(), default=None) if rule == "any" else case.warned.get(rule)
            )
            cells.append(
                "-" if step is None or case.diverged_at is None else str(case.diverged_at - step)
            )
        alarms = sum(bool(h.warned) if rule == "any" else rule in h.warned for h in healthy)
        grid.add_row(rule, *cells, str(alarms))
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amp_lab.health.lead_time", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("outputs/lead_time"))
    parser.add_argument("--cases", nargs="*", default=list(DIVERGING), choices=list(DIVERGING))
    parser.add_argument("--steps", type=int, default=40, help="steps of each diverging case")
    parser.add_argument(
        "--studies",
        nargs="*",
        default=None,
        help="CPU studies whose seed-0 jobs are the healthy runs (default: all but PHENOMENA)",
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the cases' own warnings are what is measured
    steps = [f"trainer.max_steps={args.steps}"]
    diverging = [
        run_case(n, [*BASE, *EVERY_STEP, *steps, *DIVERGING[n]], args.out / "cases")
        for n in args.cases
    ]
    healthy = []
    for study in healthy_studies() if args.studies is None else args.studies:
        for i, job in enumerate(study_jobs(study)):
            if compose_settings(job).trainer.strategy != "single":
                break  # a study of several ranks runs under torchrun, not here
            result = run_case(f"{study}_{i}", job, args.out / "healthy")
            if result.diverged_at is None and not result.other:  # healthy by every other rule
                healthy.append(result)
    Console(width=200).print(table(diverging, healthy))
    leads = [c.lead for c in diverging if c.diverged_at is not None]
    early = sum(lead is not None and lead >= LEAD_TARGET for lead in leads)
    print(
        f"{early} of {len(leads)} diverging cases warned >= {LEAD_TARGET} steps ahead; "
        f"{sum(bool(h.warned) for h in healthy)} of {len(healthy)} healthy runs warned"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lead_time.json").write_text(
        json.dumps(
            {
                "diverging": [asdict(c) | {"lead": c.lead} for c in diverging],
                "healthy": [asdict(h) for h in healthy],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
