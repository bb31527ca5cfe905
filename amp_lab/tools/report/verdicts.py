"""The report's sentences: each run's health and one verdict per group, worded here and judged
by health/rules.py (a run's summary.json `health`) and health/compare.py (the paired interval)."""

from __future__ import annotations

from collections import Counter

from amp_lab.config import HealthConfig
from amp_lab.health.compare import BETTER, MATCHES, WORSE, Difference
from amp_lab.health.rules import RULES, rule_names, words_of
from amp_lab.tools.report.figures import Comparison
from amp_lab.tools.report.groups import Cell, Group
from amp_lab.tools.report.runs import RunData

THRESHOLDS = HealthConfig()  # the schema's: the report judges every sweep alike


def rules_text(cfg: HealthConfig = THRESHOLDS) -> str:
    """The verdict rules, stated once in every report."""
    return (
        f"Rules of the verdicts: per figure, the {cfg.confidence:.0%} paired t-interval of the "
        "difference from the reference over the seeds (± is its half-width). A mode "
        f"*matches* its reference when the interval lies within ±{cfg.acc_pp:g} pp of accuracy "
        f"and ±{cfg.loss_rel:.0%} of the reference's val loss; it *is better* or *worse* when an "
        "interval excludes zero and its mean passes the threshold (and the other figure does "
        "not say the opposite: then it *differs*); anything else is *inconclusive*, as is every "
        f"comparison of one seed. Speed and memory within ±{cfg.speed_band:.0%} are *the same*. "
        "A run's health (unstable, stalled, diverged, ...) is what the run judged of itself "
        "(summary.json `health`, docs/diagnostics.md)."
    )


def _unfinished(run: RunData) -> list[str]:
    """The run's status when it neither completed nor diverged (the judge's words say that)."""
    return [] if run.status in ("completed", "diverged") else [run.status]


def health(run: RunData) -> list[str]:
    """What is wrong with the run: its status if it did not complete, then the judge's words."""
    return _unfinished(run) + words_of(run.summary) + audit_failures(run)


def audit_failures(run: RunData) -> list[str]:
    """The promises the run's precision audit found broken (a stopped run's status says so)."""
    if run.status.startswith("stopped: precision audit"):
        return []
    audit = run.summary.get("precision_audit") or {}
    return [f"precision audit: {line}" for line in audit.get("breaches", [])]


def merged_health(runs: list[RunData]) -> list[str]:
    """The cell's health: one run's words as they are; over seeds, each finding once with the
    number of seeds it held in ("loss stalled in 2 of 3 seeds")."""
    if len(runs) == 1:
        return health(runs[0])
    found: Counter[str] = Counter()
    for run in runs:
        found.update(status.split(":")[0] for status in _unfinished(run))
        found.update(RULES[n].label if n in RULES else n for n in sorted(rule_names(run.summary)))
        found.update(["precision audit broken"] if audit_failures(run) else [])
    return [f"{label} in {k} of {len(runs)} seeds" for label, k in found.items()]


def _interval(diff: Difference, scale: float, unit: str) -> str:
    """`+0.1 ± 0.4 pp` (the interval's half-width), or `+0.1 pp` for one seed."""
    assert diff.mean is not None
    text = f"{diff.mean * scale:+.1f}"
    if diff.half_width is not None:
        text += f" ± {diff.half_width * scale:.1f}"
    return text + unit


def accuracy_words(value: str, ref: str, comp: Comparison) -> str:
    """The accuracy-and-loss clause of a verdict, by the judge's paired intervals."""
    acc, loss = comp.acc_interval, comp.loss_rel_interval
    if acc.mean is None:
        return f"{value}: no val accuracy to compare with {ref}"
    figures = [f"Δacc {_interval(acc, 100, ' pp')}"]
    if loss.mean is not None:
        figures.append(f"Δloss {_interval(loss, 100, '%')}")
    seeds = f"{acc.n} seed{'s' * (acc.n != 1)}"
    if comp.verdict is None:
        noise = (
            "noise unknown" if acc.half_width is None else f"noise ±{acc.half_width * 100:.1f} pp"
        )
        if not comp.acc.paired:
            noise = "no seed in common, noise unknown"
        return f"{value} vs {ref}: inconclusive: {seeds}, {noise} ({', '.join(figures)})"
    verb = {
        MATCHES: "matches",
        BETTER: "is better than",
        WORSE: "is worse than",
        "differs": "differs from",
    }[comp.verdict]
    return f"{value} {verb} {ref} ({', '.join(figures)}, {seeds})"


def _speed_words(comp: Comparison) -> str:
    words = []
    if comp.speedup is not None and abs(comp.speedup - 1) <= THRESHOLDS.speed_band:
        words.append("the same speed")
    elif comp.speedup is not None:
        words.append(f"{comp.speedup:.2g}× " + ("faster" if comp.speedup > 1 else "the speed"))
    if comp.memory_ratio is not None and abs(comp.memory_ratio - 1) > THRESHOLDS.memory_band:
        change = 1 - comp.memory_ratio
        words.append(f"{abs(change):.0%} {'less' if change > 0 else 'more'} memory")
    return ", ".join(words)


def cell_verdict(cell: Cell, ref: Cell, comp: Comparison, speed_ok: bool) -> str:
    """One clause for a non-reference cell: its health over the seeds, then its comparison."""
    clause = accuracy_words(cell.value, ref.value, comp)
    if speed_ok and (speed := _speed_words(comp)):
        clause += f", {speed}"
    if problems := merged_health(cell.runs):  # `fp16: diverged in 1 of 3 seeds; matches fp32 ...`
        rest = clause.removeprefix(cell.value).lstrip(": ")
        clause = f"{cell.value}: {', '.join(problems)}; {rest}"  # the colon ends a long label
    return clause


def group_verdict(group: Group, comps: dict[str, Comparison], speed_ok: bool) -> str:
    """The group's sentence: every cell against the reference, or why there is none."""
    ref = group.reference
    if ref is None:
        named = [f"{c.value}: {', '.join(w)}" for c in group.cells if (w := merged_health(c.runs))]
        note = group.reference_note
        return "; ".join([note[:1].upper() + note[1:], *named]) + "."
    clauses = [cell_verdict(c, ref, comps[c.value], speed_ok) for c in group.cells if c is not ref]
    if ref_problems := merged_health(ref.runs):
        clauses.append(f"the reference {ref.value} itself: {', '.join(ref_problems)}")
    if not clauses:
        return f"Only the reference ({ref.value}) in this group: nothing to compare."
    return "; ".join(clauses) + "."
