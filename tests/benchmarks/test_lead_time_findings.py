"""benchmarks/results/lead_time.md and docs/diagnostics.md's lead-time figures are what `make
warnings-bench` wrote: the committed lead_time.json files under benchmarks/results/lead_time/,
recomputed here claim by claim."""

from __future__ import annotations

import json

from helpers import ROOT

from amp_lab.config import HealthConfig
from benchmarks.lead_time import LEAD_TARGET, LEARN_THEN_DIVERGE, first_reaching

RUNS = ROOT / "benchmarks" / "results" / "lead_time"
NOTES = " ".join((ROOT / "benchmarks" / "results" / "lead_time.md").read_text().split())
DOC = " ".join((ROOT / "docs" / "diagnostics.md").read_text().split())  # lines joined
CANDIDATES = (20, 30, 40, 50, 100, 200)  # the attn_logit thresholds tried on seed 0


def _load(name: str) -> dict[str, list[dict]]:
    return json.loads((RUNS / name).read_text())


def _first_warning(case: dict) -> str:
    if not case["warned"]:
        return "-"
    rule = min(case["warned"], key=case["warned"].get)
    return f"{case['warned'][rule]} `{rule}`"


def _rows(cases: list[dict], fixed: dict[str, dict]) -> list[str]:
    """The notes' table: a row per seed-0 case, its qk_norm twin where the grid has one."""
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


def _seed(cases: list[dict], seed: int) -> list[dict]:
    return [c for c in cases if c["name"].endswith(f"_seed{seed}")]


def _grid(cases: list[dict]) -> list[dict]:
    return [c for c in cases if c["name"].split("_seed")[0] in LEARN_THEN_DIVERGE]


def test_the_tables_are_the_committed_bench():
    seed_0 = _load("seed_0.json")
    twins = {case["name"]: case for case in seed_0["qk_norm"]}
    for row in _rows(seed_0["diverging"], twins):
        assert row in NOTES, row
    studies = sorted({h["name"].rsplit("_", 1)[0] for h in seed_0["healthy"]})
    for study in studies:
        runs = [h for h in seed_0["healthy"] if h["name"].rsplit("_", 1)[0] == study]
        alarms = ", ".join(f"`{h['name']}` at {_first_warning(h)}" for h in runs if h["warned"])
        assert f"| {study} | {len(runs)} | {alarms or '-'} |" in NOTES, study


def test_the_headline_figures_in_the_notes_and_the_docs():
    seed_0, held_out = _load("seed_0.json"), _load("seeds_1_2.json")
    early, diverged = _early(_grid(seed_0["diverging"]))
    claim = f"{early} of {diverged} divergences of the grid were warned {LEAD_TARGET}"
    assert claim in NOTES and claim in DOC
    early, diverged = _early(seed_0["diverging"])
    claim = f"over every seed-0 diverging case, {early} of {diverged}"
    assert claim in NOTES and claim in DOC and early >= 0.8 * diverged
    for seed in (1, 2):
        cases = _seed(held_out["diverging"], seed)
        grid, every = _early(_grid(cases)), _early(cases)
        claim = f"seed {seed}: {grid[0]} of {grid[1]} (every case: {every[0]} of {every[1]})"
        assert claim in NOTES and claim in DOC, claim


def test_qk_norm_stops_every_divergence_at_seed_0_but_not_every_one_held_out():
    fixed = _load("seed_0.json")["qk_norm"]
    assert len(fixed) == len(LEARN_THEN_DIVERGE)
    assert all(c["diverged_at"] is None and not c["warned"] for c in fixed)
    plain = [c for c in _grid(_load("seed_0.json")["diverging"]) if c["diverged_at"]]
    assert f"{len(plain)} of {len(LEARN_THEN_DIVERGE)} plain grid runs diverge" in NOTES
    held_out = _load("seeds_1_2.json")["qk_norm"]
    broke = sorted(c["name"] for c in held_out if c["diverged_at"] is not None)
    assert not any(c["warned"] for c in held_out)
    assert f"{len(broke)} of {len(held_out)} qk_norm runs diverge" in NOTES
    for name in broke:
        assert f"`{name}`" in NOTES, name


def test_the_attn_logit_default_is_the_highest_tried_that_met_the_target_on_seed_0():
    """Of the candidates, the default is the highest whose bound warned >= 10 steps ahead of 80%
    of the grid's seed-0 divergences, read from each log step's figures in seed_0.json."""
    seed_0 = _load("seed_0.json")
    diverged = [c for c in _grid(seed_0["diverging"]) if c["diverged_at"]]
    met = []
    for threshold in CANDIDATES:
        steps = [first_reaching(c["figures"], "attn_logit_bound", threshold) for c in diverged]
        leads = [None if s is None else c["diverged_at"] - s for s, c in zip(steps, diverged)]
        early = sum(lead is not None and lead >= LEAD_TARGET for lead in leads)
        reached = sum(
            first_reaching(h["figures"], "attn_logit_bound", threshold) is not None
            for h in seed_0["healthy"]
        )
        claim = f"at {threshold}: {early} of {len(diverged)}, {reached} healthy"
        assert claim in NOTES, claim
        if early >= 0.8 * len(diverged):
            met.append(threshold)
    assert max(met) == HealthConfig().attn_logit == 50


def test_the_false_alarms_are_named_with_their_count_at_each_seed():
    for name, seed in (("seed_0.json", 0), ("healthy_seed_1.json", 1), ("healthy_seed_2.json", 2)):
        healthy = _load(name)["healthy"]
        alarms = sorted(h["name"] for h in healthy if h["warned"])
        claim = f"seed {seed}: {len(alarms)} of {len(healthy)} healthy runs warned"
        assert claim in NOTES, claim
        if seed == 0:
            assert claim in DOC
        assert all(f"`{a}`" in NOTES for a in alarms), alarms
        assert all(set(h["warned"]) == {"attn_logits"} for h in healthy if h["warned"])


def test_no_healthy_study_run_is_judged_diverged_but_the_fp16_state_ones():
    """The judge's divergence by loss judges no run of a study meant to train; the study runs it
    calls diverged are optimizer_state's fp16 moments, which its committed report calls so."""
    report = json.loads((ROOT / "experiments/optimizer_state/report/report.json").read_text())
    committed = {r["label"] for r in report["runs"] if any("diverged" in h for h in r["health"])}
    for name in ("seed_0.json", "healthy_seed_1.json", "healthy_seed_2.json"):
        judged = _load(name)["judged"]
        assert all(j["diverged_at"] is not None for j in judged)
        assert all("optim.state_dtype=fp16" in j["overrides"] for j in judged), name
        assert len(judged) == 2 and len(committed) == 6
    assert "the two fp16-state runs of optimizer_state" in NOTES


def test_the_eps_cases_break_before_their_first_log_step():
    cases = {c["name"]: c for c in _load("seed_0.json")["diverging"]}
    for name, step in (("fp16_state_eps", 3), ("half_model_eps", 4)):
        case = cases[name]
        assert case["diverged_at"] == step and case["warned"]["eps_lost"] == 10
        assert f"| {name} | {step} | 10 `" in NOTES
    for name in ("attention_logits_bf16", "fp16_overflow_growth", "fp16_underflow"):
        assert cases[name]["diverged_at"] is None, name


def test_the_attention_logits_study_cites_the_grid_with_and_without_qk_norm():
    readme = " ".join((ROOT / "experiments" / "attention_logits" / "README.md").read_text().split())
    seed_0 = _load("seed_0.json")
    plain = sum(c["diverged_at"] is not None for c in _grid(seed_0["diverging"]))
    assert f"at seed 0, {plain} plain runs of the 12 diverge" in readme
    assert not any(c["diverged_at"] for c in seed_0["qk_norm"])
