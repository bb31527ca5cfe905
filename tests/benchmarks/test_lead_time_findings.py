"""docs/diagnostics.md's lead-time figures are what `make warnings-bench` wrote: the committed
lead_time.json files under benchmarks/results/lead_time/, recomputed here claim by claim."""

from __future__ import annotations

import json

from helpers import ROOT

from amp_lab.config import HealthConfig
from benchmarks.lead_time import LEAD_TARGET, LEARN_THEN_DIVERGE

RUNS = ROOT / "benchmarks" / "results" / "lead_time"
DOC = " ".join((ROOT / "docs" / "diagnostics.md").read_text().split())  # lines joined


def _load(name: str) -> dict[str, list[dict]]:
    return json.loads((RUNS / name).read_text())


def _first_warning(case: dict) -> str:
    if not case["warned"]:
        return "-"
    rule = min(case["warned"], key=case["warned"].get)
    return f"{case['warned'][rule]} `{rule}`"


def _rows(cases: list[dict], fixed: dict[str, dict]) -> list[str]:
    """The docs' table: a row per seed-0 case, its qk_norm twin where the grid has one."""
    rows = []
    for case in cases:
        twin = fixed.get(f"{case['name']}+qk_norm")
        qk = "" if twin is None else f" | {twin['diverged_at'] or 'never'} / {_first_warning(twin)}"
        lead = "-" if case["lead"] is None else str(case["lead"])
        diverged = case["diverged_at"] or "never"
        rows.append(f"| {case['name']} | {diverged} | {_first_warning(case)} | {lead}{qk} |")
    return rows


def _early(cases: list[dict]) -> tuple[int, int]:
    """(cases warned >= LEAD_TARGET steps ahead, cases that diverged)."""
    diverged = [c for c in cases if c["diverged_at"] is not None]
    return sum(c["lead"] is not None and c["lead"] >= LEAD_TARGET for c in diverged), len(diverged)


def _logit_lead(case: dict, threshold: float) -> int | None:
    """The lead `attn_logits` would have had at another threshold: its first probe at or above."""
    steps = [step for step, logit in case["attn_logits"] if logit >= threshold]
    return None if not steps else case["diverged_at"] - steps[0]


def test_the_documented_table_is_the_committed_bench():
    seed_0, fixed = _load("seed_0.json"), _load("qk_norm_and_healthy.json")
    twins = {case["name"]: case for case in fixed["qk_norm"]}
    for row in _rows(seed_0["diverging"], twins):
        assert row in DOC, row
    grid = [c for c in seed_0["diverging"] if c["name"] in LEARN_THEN_DIVERGE]
    early, diverged = _early(grid)
    assert f"{early} of {diverged} divergences of the grid were warned {LEAD_TARGET}" in DOC
    early, diverged = _early(seed_0["diverging"])
    assert f"over every seed-0 case, {early} of {diverged}" in DOC
    for seed in (1, 2):
        runs = [c for c in _load("seeds_1_2.json")["diverging"] if c["name"].endswith(f"d{seed}")]
        early, diverged = _early(runs)
        assert f"seed {seed}: {early} of {diverged}" in DOC, seed


def test_qk_norm_stops_every_divergence_of_the_grid_and_no_warning_fires():
    fixed = _load("qk_norm_and_healthy.json")["qk_norm"]
    assert len(fixed) == len(LEARN_THEN_DIVERGE)
    assert all(c["diverged_at"] is None and not c["warned"] for c in fixed)
    seed_0 = _load("seed_0.json")["diverging"]
    plain = [c for c in seed_0 if c["name"] in LEARN_THEN_DIVERGE and c["diverged_at"]]
    assert f"{len(plain)} of {len(LEARN_THEN_DIVERGE)} plain grid runs diverge" in DOC


def test_the_false_alarms_are_named_with_their_count():
    healthy = _load("qk_norm_and_healthy.json")["healthy"]
    alarms = sorted(h["name"] for h in healthy if h["warned"])
    assert f"{len(alarms)} of {len(healthy)} healthy runs warned" in DOC
    for name in alarms:
        assert f"`{name}`" in DOC, name


def test_the_attn_logit_default_is_the_highest_tried_that_met_the_target_on_seed_0():
    """Of 20, 30, 40, 50 and 100 (the former default), 30 is the highest that warned >= 10 steps
    ahead of 80% of the grid's seed-0 divergences."""
    seed_0 = _load("seed_0.json")["diverging"]
    diverged = [c for c in seed_0 if c["name"] in LEARN_THEN_DIVERGE and c["diverged_at"]]
    met = []
    for threshold in (20, 30, 40, 50, 100):
        leads = [_logit_lead(c, threshold) for c in diverged]
        early = sum(lead is not None and lead >= LEAD_TARGET for lead in leads)
        assert f"at {threshold}: {early} of {len(diverged)}" in DOC, threshold
        if early >= 0.8 * len(diverged):
            met.append(threshold)
    assert max(met) == HealthConfig().attn_logit == 30


def test_the_eps_cases_break_before_a_lead_of_ten_is_possible():
    cases = {c["name"]: c for c in _load("seed_0.json")["diverging"]}
    for name, step in (("fp16_state_eps", 3), ("half_model_eps", 4)):
        assert cases[name]["diverged_at"] == step and cases[name]["warned"]["eps_lost"] == 1
    for name in ("attention_logits_bf16", "fp16_overflow_growth", "fp16_underflow"):
        assert cases[name]["diverged_at"] is None, name
    at_2e2 = [cases[f"{p}_lr2e-2"]["diverged_at"] is not None for p in ("fp32", "bf16", "fp16")]
    assert f"at 2e-2 in {sum(at_2e2)} of 3 precisions" in DOC


def test_every_false_alarm_is_attn_logits_on_the_lr_warmup_studys_high_lrs():
    healthy = _load("qk_norm_and_healthy.json")["healthy"]
    alarms = {h["name"]: h for h in healthy if h["warned"]}
    assert alarms and all(set(h["warned"]) == {"attn_logits"} for h in alarms.values())
    for name, alarm in alarms.items():
        scale = next(o for o in alarm["overrides"] if o.startswith("lr.scale="))
        lr = {"lr.scale=1.0": "2e-2", "lr.scale=0.5": "1e-2"}[scale]  # the study's base: 2e-2
        assert f"`{name}` (lr {lr}, at step {alarm['warned']['attn_logits']})" in DOC, name


def test_the_attention_logits_study_cites_the_grid_with_and_without_qk_norm():
    readme = " ".join((ROOT / "experiments" / "attention_logits" / "README.md").read_text().split())
    seed_0 = _load("seed_0.json")["diverging"]
    plain = sum(c["name"] in LEARN_THEN_DIVERGE and c["diverged_at"] is not None for c in seed_0)
    assert f"at seed 0, {plain} plain runs of the 12 diverge" in readme
    assert not any(c["diverged_at"] for c in _load("qk_norm_and_healthy.json")["qk_norm"])
