"""How early the early warnings come: `python -m benchmarks.lead_time`
(`make warnings-bench`).

Every case runs at the default settings (a log window every 10 steps, a probe every 100). Whether
and where a run diverged is the health judge's `diverged` finding (summary.json `health`); for
each early warning (rules.EARLY) the table gives the steps between the log step it fired at and
that divergence. The healthy runs are the seed-0 jobs of each CPU study but those built to fail
(PHENOMENA), single-process ones: a warning that fires on one of them, while no other rule does,
is a false alarm; a study run that another rule judged is listed apart. Writes lead_time.json.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from amp_lab import command
from amp_lab.compose import CONF_DIR, compose_settings
from amp_lab.config import AmpLabConfig, ConfigError, flat_settings, register
from amp_lab.health.rules import DIVERGED, EARLY
from amp_lab.records import METRICS_FILE, SETTINGS_FILE, SUMMARY_FILE
from amp_lab.tools import probe

# the CPU studies' ViT (4 tokens on 16 px digits, it learns within 60 steps), no evaluation but
# the last; everything else at its default
BASE = ["model=test_vit_patch8", "data.img_size=16", "trainer.device=cpu", "trainer.progress=false"]
QUIET_EVAL = ["trainer.eval_every=0"]
# Wortsman et al.'s protocol at CPU size: a linear warmup to the peak LR, then cosine decay. The
# run learns first; at a high peak its attention logits grow and the loss climbs back.
WARMUP_THEN_PEAK = ["lr.warmup_steps=60", "trainer.max_steps=200"]
LEARN_THEN_DIVERGE = {
    f"{precision}_lr{lr}": [f"precision={precision}", f"lr.base={lr}", *WARMUP_THEN_PEAK]
    for precision in ("fp32", "bf16", "fp16")
    for lr in ("1e-2", "2e-2", "3e-2", "5e-2")
}
AT_ONCE = ["trainer.max_steps=40"]
DIVERGING = {  # the Wortsman grid, then the failures that break a run within its first steps
    **LEARN_THEN_DIVERGE,
    "attention_logits_bf16": ["precision=bf16", "lr.base=0.3", *AT_ONCE],
    "attention_logits_fp32": ["precision=fp32", "lr.base=0.3", *AT_ONCE],
    "fp16_state_eps": ["optim.state_dtype=fp16", "lr.base=3e-3", *AT_ONCE],
    "half_model_eps": ["pitfall=half_model", "precision=fp16", "lr.base=3e-3", *AT_ONCE],
    "fp16_overflow_growth": ["precision=fp16", "lr.base=0.1", "scaler.init_scale=1e4", *AT_ONCE],
    "fp16_underflow": [
        "precision=fp16_noscale",
        "fault.loss_multiplier=1e-6",
        "lr.base=1e-2",
        *AT_ONCE,
    ],
}
# the same grid with the doctor's fix for growing logits: a warning or a divergence here is the
# fix's failure (Wortsman et al.: qk-layernorm removes the instability)
QK_NORM = {
    f"{name}+qk_norm": [*case, "++model.kwargs.qk_norm=true"]
    for name, case in LEARN_THEN_DIVERGE.items()
}
LEAD_TARGET = 10  # steps: a warning this early is in time to act on
# the figures each log step's record holds for the early-warning rules (what another threshold
# would have seen), the exact logit of a probe step too
FIGURES = (
    "train/loss",
    "train/loss_spike",
    "train/grad_spike",
    "diag/attn_logit_bound",
    "diag/attn_logit_max",
    "diag/kurtosis_max",
    "diag/adam_rms_max",
)
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
    # per log step: its step and the FIGURES its record holds (what another threshold would see)
    figures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lead(self) -> int | None:
        """Steps between the first warning and the divergence (negative: it came after)."""
        if self.diverged_at is None or not self.warned:
            return None
        return self.diverged_at - min(self.warned.values())


def first_reaching(figures: list[dict[str, Any]], figure: str, threshold: float) -> int | None:
    """The first log step whose `figure` reached `threshold` (in a CaseResult's `figures`, or
    its JSON): where a rule on it at that threshold would have fired."""
    reached = (
        f["step"] for f in figures if isinstance(v := f.get(figure), float) and v >= threshold
    )
    return next(reached, None)


def _finished(folder: Path, settings: AmpLabConfig) -> bool:
    """The folder holds a finished run of exactly these settings."""
    if not (folder / SUMMARY_FILE).exists():
        return False
    return json.loads((folder / SETTINGS_FILE).read_text()) == flat_settings(settings)


def run_case(name: str, overrides: list[str], out: Path) -> CaseResult:
    """Train one case in-process (its own output folder) and read what it says of itself."""
    # a quiet run (nothing to W&B): the bench measures the run's own judgement
    folder = out / name
    settings = probe.settings(overrides)
    if _finished(folder, settings):  # a case a stopped bench finished is read, not rerun
        summary = json.loads((folder / SUMMARY_FILE).read_text())
    else:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            summary = probe.fit(settings, folder)
    rows = [json.loads(r) for r in (folder / METRICS_FILE).read_text().splitlines()]
    health = summary.get("health") or []
    result = CaseResult(
        name,
        overrides,
        next((e["step"] for e in health if e["rule"] == DIVERGED), None),
        {e["rule"]: e["step"] for e in health if e["rule"] in EARLY},
        [e["rule"] for e in health if e["rule"] not in EARLY],
        [
            {"step": r["step"], **{k.split("/")[1]: r[k] for k in FIGURES if r.get(k) is not None}}
            for r in rows
            if r["kind"] == "train"
        ],
    )
    print(f"{name}: diverged at {result.diverged_at}, warned {result.warned}", flush=True)
    return result


def study_jobs(study: str) -> list[list[str]]:
    """A CPU study's sweep jobs of seed 0 (its `hydra.sweeper.params` grid), as it runs them."""
    from hydra import compose, initialize_config_dir

    experiment = f"+experiment/cpu={study}"
    register()  # the schema the configs name
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose("config", [experiment], return_hydra_config=True).hydra.sweeper.params
    axes = [
        [f"{key}={value}" for value in str(values).split(",")]
        for key, values in params.items()
        if key != "trainer.seed" and "(" not in str(values)  # a search's ranges are drawn
    ]
    return [[experiment, "trainer.seed=0", *job] for job in itertools.product(*axes)]


def healthy_studies() -> list[str]:
    """The CPU studies whose runs are meant to train: all but PHENOMENA."""
    names = sorted(p.stem for p in (CONF_DIR / "experiment" / "cpu").glob("*.yaml"))
    return [n for n in names if n not in PHENOMENA]


def table(diverging: list[CaseResult], healthy: list[CaseResult]) -> Table:
    """Per diverging case, each warning's lead (negative: it came after); last, per warning, its
    false alarms on the healthy runs."""
    grid = Table(title="early warnings: steps before the judge's divergence (negative: after)")
    for column in ("case", "diverged at", *EARLY, "any"):
        grid.add_column(column, justify="left" if column == "case" else "right")
    for case in diverging:
        steps = [case.warned.get(rule) for rule in EARLY]
        steps.append(min(case.warned.values(), default=None))
        leads = [
            "-" if s is None or case.diverged_at is None else str(case.diverged_at - s)
            for s in steps
        ]
        grid.add_row(case.name, str(case.diverged_at or "never"), *leads)
    alarms = [sum(rule in h.warned for h in healthy) for rule in EARLY]
    alarms.append(sum(bool(h.warned) for h in healthy))
    grid.add_row(f"false alarms (of {len(healthy)} healthy)", "", *map(str, alarms))
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = command.parser("python -m benchmarks.lead_time", __doc__)
    parser.add_argument("--out", type=Path, default=Path("outputs/lead_time"))
    cases = {**DIVERGING, **QK_NORM}
    parser.add_argument("--cases", nargs="*", default=list(cases), choices=list(cases))
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="seeds of each diverging case"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for every run, e.g. health.attn_logit=30 to measure another threshold",
    )
    parser.add_argument(
        "--studies",
        nargs="*",
        default=None,
        help="CPU studies whose seed-0 jobs are the healthy runs (default: all but PHENOMENA)",
    )
    args = parser.parse_args(argv)
    try:  # a bad --set is one line before any case runs
        compose_settings([*BASE, *args.set])
    except ConfigError as err:
        return command.error(str(err))
    logging.disable(logging.WARNING)  # the cases' own warnings are what is measured
    runs = [
        run_case(
            name if seed == 0 else f"{name}_seed{seed}",
            [*BASE, *QUIET_EVAL, *cases[name], f"trainer.seed={seed}", *args.set],
            args.out / "cases",
        )
        for name in args.cases
        for seed in args.seeds
    ]
    diverging = [run for run in runs if run.name.split("_seed")[0] in DIVERGING]
    fixed = [run for run in runs if run.name.split("_seed")[0] in QK_NORM]
    # the study runs no other rule judged, and the others
    healthy: list[CaseResult] = []
    judged: list[CaseResult] = []
    for study in healthy_studies() if args.studies is None else args.studies:
        for i, job in enumerate(study_jobs(study)):
            if compose_settings(job).trainer.strategy != "single":
                break  # a study of several ranks runs under torchrun, not here
            result = run_case(f"{study}_{i}", [*job, *args.set], args.out / "healthy")
            (judged if result.diverged_at is not None or result.other else healthy).append(result)
    Console(width=200).print(table([*diverging, *fixed], healthy))
    leads = [c.lead for c in diverging if c.diverged_at is not None]
    early = sum(lead is not None and lead >= LEAD_TARGET for lead in leads)
    print(
        f"{early} of {len(leads)} diverging cases warned >= {LEAD_TARGET} steps ahead; "
        f"{sum(bool(h.warned) for h in healthy)} of {len(healthy)} healthy runs warned; "
        f"with qk_norm {sum(f.diverged_at is not None for f in fixed)} of {len(fixed)} diverged "
        f"and {sum(bool(f.warned) for f in fixed)} warned; {len(judged)} study runs judged "
        f"otherwise ({sum(j.diverged_at is not None for j in judged)} diverged)"
    )
    found = {
        "diverging": [asdict(c) | {"lead": c.lead} for c in diverging],
        "qk_norm": [asdict(f) for f in fixed],
        "healthy": [asdict(h) for h in healthy],
        "judged": [asdict(j) for j in judged],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lead_time.json").write_text(json.dumps(command.strict_json(found), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
