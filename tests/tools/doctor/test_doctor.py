"""`python -m amp_lab doctor` on pitfalls and faults: each signature found, named, and fixed."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from helpers import DOCTOR_TINY
from rich.console import Console

from amp_lab.compose import compose_settings
from amp_lab.config import HealthConfig
from amp_lab.tools.doctor.advice import BASELINE, Advice, recommend
from amp_lab.tools.doctor.cli import main
from amp_lab.tools.doctor.diagnose import verdict_table
from amp_lab.tools.doctor.fixes import applied_by, verify
from amp_lab.tools.doctor.probes import Doctor
from amp_lab.tools.doctor.verdict import Probe, verdict
from amp_lab.trainer import Trainer

TINY = DOCTOR_TINY


def _doctor(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    assert main([*TINY, *args, "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "doctor.json").read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_underflow_without_scaler_is_named_and_the_scaler_is_recommended(tmp_path, capsys):
    report, out = _doctor(
        tmp_path,
        capsys,
        "precision=fp16_noscale",
        "lr.base=1e-2",
        "fault.loss_multiplier=1e-6",
        "--steps",
        "12",
    )
    probes = report["probes"]
    assert probes["autocast"]["zero_grad_share"] > 0.9  # most gradients flushed to zero
    assert probes["autocast"]["verdict"] == "underflow"  # the health rule, never "ok"
    assert [e["rule"] for e in probes["autocast"]["summary"]["health"]] == ["underflow"]
    assert probes["autocast+scaler"]["verdict"] == "ok"  # fp16 with the scaler trains
    losses = probes["autocast+scaler"]["losses"]
    assert sum(losses[-4:]) < 0.95 * sum(losses[:4])
    top = report["recommendations"][0]
    assert top["problem"] == "gradients underflow without loss scaling"
    assert top["override"] == "precision=fp16 scaler.enabled=true"
    assert top["verified"] is True and top["verification"].startswith("verified: ")
    assert top["command"].endswith("fault.loss_multiplier=1e-6 precision=fp16 scaler.enabled=true")
    # the user's line, their precision replaced
    assert "lr.base=1e-2 fault.loss_multiplier=1e-6 precision=fp16 scaler.enabled=true\n" in out
    assert "amp_lab doctor: probes vs the fp32 baseline" in out


@pytest.mark.slow
def test_overflowing_module_is_named_and_the_fp32_search_proposes_it(tmp_path, capsys):
    culprit = "blocks.0.mlp.fc2"
    report, out = _doctor(
        tmp_path,
        capsys,
        "precision=fp16",
        f"fault.overflow_module={culprit}",
        "--steps",
        "4",
        "--search-fp32",
    )
    nonfinite = report["probes"]["autocast+scaler"]["summary"]["diagnostics"]["nonfinite"]
    assert nonfinite["module"] == culprit and nonfinite["phase"] == "forward"
    assert nonfinite["first_step"] == 1
    search = report["search_fp32"]
    assert search["verified"] is True and search["fp32_modules"] == [culprit]
    assert search["tried"][-1] == {
        "fp32_modules": [culprit],
        "clean": True,
        "forward_nonfinite": None,
        "crashed": None,
    }
    assert search["probe_runs"] == 1  # the start set ran as autocast+scaler, [culprit] once
    assert report["recommendations"][0]["override"] == f"precision.fp32_modules=[{culprit}]"
    assert f"precision.fp32_modules=[{culprit}]" in out
    assert report["probes"]["bf16"]["verdict"] == "ok"
    losses = report["probes"]["autocast"]["losses"]  # nan in the run: null in strict JSON
    assert losses and all(loss is None for loss in losses)
    assert "NaN" not in (tmp_path / "doctor.json").read_text()


@pytest.mark.slow
def test_clip_before_unscale_is_named_with_the_fix(tmp_path, capsys):
    report, out = _doctor(
        tmp_path,
        capsys,
        "precision=fp16",
        "pitfall=clip_before_unscale",
        "trainer.clip_grad=1.0",
        "--steps",
        "4",
    )
    top = report["recommendations"][0]
    assert top["problem"] == "gradients are clipped while still scaled"
    assert top["fix"].startswith("unscale before clipping")
    assert (
        "clip_before_unscale"
        in report["probes"]["autocast+scaler"]["summary"]["diagnostics"]["signatures"]
    )
    assert (
        "clip_before_unscale"
        not in report["probes"]["fp32"]["summary"]["diagnostics"]["signatures"]
    )  # the baseline runs the correct step
    assert "unscale before clipping" in out


@pytest.mark.slow
def test_a_probe_that_crashes_is_reported_and_the_others_still_count(tmp_path, capsys, monkeypatch):
    fit = Trainer.fit

    def bf16_crashes(self):
        if self.run.settings.precision.name == "bf16":
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", bf16_crashes)
    report, out = _doctor(tmp_path, capsys, "precision=fp16", "--steps", "4")
    probes = report["probes"]
    assert probes["bf16"]["verdict"] == "crashed"
    assert (
        probes["bf16"]["crashed"]
        == "RuntimeError: Unexpected floating ScalarType in at::autocast::prioritize"
    )
    assert all(p["losses"] for n, p in probes.items() if n != "bf16")
    assert "the bf16 probe crashed" in [r["problem"] for r in report["recommendations"]]
    assert "crashed" in out


@pytest.mark.slow
def test_half_model_leaves_the_bf16_probe_out_and_says_why(tmp_path, capsys):
    """model.half() beside bf16 is refused (tests/test_bad_input.py): the doctor's bf16 probe of
    such a config is unavailable, with that line, and the other probes still count."""
    report, out = _doctor(tmp_path, capsys, "precision=fp16", "pitfall=half_model", "--steps", "4")
    bf16 = report["probes"]["bf16"]
    assert bf16["verdict"] == "unavailable"
    assert "precision=bf16 on the CPU feeds the fp16 weights" in bf16["unavailable"]
    problems = [r["problem"] for r in report["recommendations"]]
    assert problems[0] == "master weights / optimizer state are not fp32"
    assert "fp16's range is the problem; bf16 has fp32's exponent range" not in problems
    assert "unavailable" in out
    # model.half() drops the scaler: no scaler check (it said "never grew" of a scaler not used)
    assert "scaler_check" not in report["probes"] and report["scaler_check"] is None


@pytest.mark.slow
def test_half_model_that_overflows_gets_its_own_fix_and_no_fp32_search(tmp_path, capsys):
    """A forward overflow beside model.half(): the fix is the pitfall's own; no module is kept
    in fp32 and --search-fp32 searches nothing (both would run fp32 inputs into fp16 weights)."""
    report, out = _doctor(
        tmp_path,
        capsys,
        *("precision=fp16", "pitfall=half_model", "fault.overflow_module=blocks.0.mlp.fc2"),
        *("--steps", "4", "--search-fp32"),
    )
    assert report["probes"]["autocast+scaler"]["summary"]["diagnostics"]["nonfinite"]["forward"]
    assert report["search_fp32"] is None
    causes = [r["cause"] for r in report["recommendations"]]
    assert causes[0] == "half_model" and "forward_overflow" not in causes
    assert "crashed" not in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "scaler", [[], ["scaler=hysteresis", "scaler.max_scale=1e12"]], ids=["dynamic", "hysteresis"]
)  # the latter holds its first overflow
def test_a_scale_too_high_to_start_is_named_as_such(tmp_path, capsys, scaler):
    report, out = _doctor(
        tmp_path, capsys, "precision=fp16", "scaler.init_scale=1e12", *scaler, "--steps", "4"
    )
    assert report["probes"]["autocast+scaler"]["summary"]["skipped_steps"] == 4
    top = report["recommendations"][0]
    assert top["problem"] == "the initial loss scale is too high"
    assert top["override"] == "scaler.init_scale=65536"
    try_line = next(line for line in out.splitlines() if line.endswith("init_scale=65536"))
    assert "scaler.init_scale=1e12" not in try_line  # replaces the user's value


@pytest.mark.slow
def test_an_out_folder_holding_a_run_keeps_that_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--out", str(run)]) == 0  # probes in run/probes/
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 7}\n')  # a run of the user's
    (run / "checkpoints").mkdir()
    before = {p: p.read_bytes() for p in run.glob("*.jsonl")}
    _doctor(run, capsys, "--steps", "4")  # again, into the same folder
    assert {p: p.read_bytes() for p in run.glob("*.jsonl")} == before
    assert len(list((run / "probes" / "autocast").glob("metrics.old-*.jsonl"))) == 1  # aside
    # the fp32 baseline of this config ran once in this process: its files were not rewritten
    assert not list((run / "probes" / "fp32").glob("metrics.old-*.jsonl"))


def test_the_fp32_search_never_calls_a_crashed_probe_clean(tmp_path, monkeypatch):
    doctor = Doctor([*TINY, "precision=fp16"], 4, tmp_path)
    crashed = Probe("search", [], crashed="RuntimeError: boom")
    monkeypatch.setattr(doctor, "run_probe", lambda name, extra: crashed)
    search = doctor.search_fp32([], Probe("autocast+scaler", [], crashed="RuntimeError: boom"))
    assert search["found"] is False and search["tried"][0]["crashed"] == "RuntimeError: boom"


@pytest.mark.parametrize(
    "args, message",
    [
        (["precision=fp99"], "amp_lab: error: "),
        (["trainer.no_such_key=1"], "amp_lab: error: "),
        (["--steps", "2"], "amp_lab: error: --steps=2 is too short"),
        (
            ["trainer.strategy=fsdp", "precision=bf16_pure"],
            "amp_lab: error: precision=bf16_pure under trainer.strategy=fsdp",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    assert main([*TINY, *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not (tmp_path / "out").exists()  # nothing written


def test_an_fsdp_config_is_probed_on_one_process(tmp_path):
    """The doctor needs no distributed launch: its probes run unsharded, as a DDP config's do."""
    doctor = Doctor([*TINY, "trainer.strategy=fsdp", "precision=fp16"], 4, tmp_path)
    assert "trainer.strategy=single" in doctor.common
    assert not any("strategy=fsdp" in o for o in doctor.common)


@pytest.mark.slow
def test_a_baseline_that_does_not_train_holds_the_precision_advice_back(tmp_path, capsys):
    """Issue 17: fp32 at lr.base=1 went 2.3 -> 20 and was judged ok, and the doctor sent the
    user after fp32 modules. Now: not a precision problem, with an LR fix checked in fp32."""
    report, out = _doctor(tmp_path, capsys, "precision=fp16", "lr.base=1", "--steps", "12")
    assert report["probes"]["fp32"]["verdict"] == "rises"
    (rec,) = report["recommendations"]  # the precision advice is held back
    assert rec["problem"] == BASELINE and rec["cause"] == "baseline"
    assert rec["verified"] is True and rec["override"].startswith("lr.scale=")
    fixed = rec["tried"][-1]
    assert fixed["override"] == rec["override"] and fixed["verdict"] == "ok"
    assert "fp32_modules" not in out and BASELINE in out


@pytest.mark.slow
def test_a_forward_overflow_outranks_what_the_users_scaler_already_does(tmp_path, capsys):
    """Issue 17: with fp16 + scaler, recommendation 1 was `precision=fp16
    scaler.enabled=true` (the user's own config); the attention overflow came second."""
    report, out = _doctor(
        tmp_path,
        capsys,
        "precision=fp16",
        "fault.overflow_factor=1e8",
        "fault.overflow_module=blocks.0.attn",
        "--steps",
        "6",
    )
    recs = report["recommendations"]
    assert recs[0]["cause"] == "forward_overflow" and recs[0]["module"] == "blocks.0.attn"
    assert all(r["override"] != "precision=fp16 scaler.enabled=true" for r in recs)
    assert recs[0]["verified"] is True
    # the table and the advice name the same first non-finite event
    event = report["probes"]["autocast+scaler"]["summary"]["diagnostics"]["nonfinite"]
    assert f"step {event['first_step']}: {event['module']} (forward)" in out
    assert (
        f"first non-finite value at step {event['first_step']}, the output of "
        f"{event['module']}" in recs[0]["evidence"]
    )


def _overflow_at(module: str | None) -> Probe:
    """A probe whose first non-finite value is `module`'s forward output (None: clean)."""
    event = {"step": 3, "module": module, "phase": "forward", "dtype": "float16"}
    nonfinite = {"first_step": 3, "forward": event, **event} if module else {}
    return Probe(
        "fix",
        [],
        losses=[math.nan] * 4 if module else [2.3] * 4,
        summary={"health": [], "diagnostics": {"nonfinite": nonfinite}},
    )


def test_beside_half_model_no_module_is_offered_in_fp32():
    """model.half()'s fp16 weights cannot run a module in fp32 (tests/test_bad_input.py): its
    forward overflow gets the pitfall's own fix, not precision.fp32_modules (whose probe
    crashed: mat1 and mat2 must have the same dtype)."""
    user = [*TINY, "precision=fp16", "pitfall=half_model"]
    overflow = _overflow_at("blocks.0.mlp.fc2").summary["diagnostics"]
    signed = {"health": [], "diagnostics": {**overflow, "signatures": {"half_model": "fp16"}}}
    low = Probe("", [], losses=[math.nan] * 4, summary=signed)
    probes = {
        "fp32": Probe("fp32", [], losses=[2.3, 2.2, 2.1, 2.0]),
        **{name: replace(low, name=name) for name in ("autocast", "autocast+scaler")},
    }
    recs = recommend(probes, Advice(compose_settings(user), 4, "fp16"))
    assert recs[0]["cause"] == "half_model" and recs[0]["override"] == "pitfall=none"
    assert "forward_overflow" not in [r["cause"] for r in recs]


def _moved_overflow(tmp_path, monkeypatch, budget_s: float) -> tuple[dict, str | None, list]:
    """Issue 17: keeping blocks.0.mlp.fc2 in fp32 moves the overflow to blocks.0.mlp.fc1; with
    both kept, the run is clean."""
    doctor = Doctor([*TINY, "precision=fp16"], 4, tmp_path)
    ran: list[list[str]] = []

    def run_probe(name: str, extra: list[str]) -> Probe:
        ran.append(extra)
        kept = extra[-1]
        return _overflow_at(None if "fc1" in kept and "fc2" in kept else "blocks.0.mlp.fc1")

    monkeypatch.setattr(doctor, "run_probe", run_probe)
    rec = {
        "cause": "forward_overflow",
        "module": "blocks.0.mlp.fc2",
        "override": "precision.fp32_modules=[blocks.0.mlp.fc2]",
    }
    probes = {"fp32": Probe("fp32", [], losses=[2.3] * 4)}
    advice = Advice(doctor.settings, 4, "fp16")
    return rec, verify(doctor, [rec], probes, advice, budget_s), ran


def test_a_fix_that_moves_the_overflow_grows_until_verified(tmp_path, monkeypatch):
    rec, next_line, ran = _moved_overflow(tmp_path, monkeypatch, budget_s=60)
    assert rec["verified"] is True
    assert rec["override"] == "precision.fp32_modules=[blocks.0.mlp.fc2,blocks.0.mlp.fc1]"
    assert rec["verification"].endswith(
        "the kept set grew [blocks.0.mlp.fc2] -> [blocks.0.mlp.fc2,blocks.0.mlp.fc1]"
    )
    assert next_line is None and len(ran) == 2  # the fix, then the grown set once


def test_a_fix_that_moves_the_overflow_past_the_budget_says_what_to_run_next(tmp_path, monkeypatch):
    rec, next_line, ran = _moved_overflow(tmp_path, monkeypatch, budget_s=0)
    assert rec["verified"] is False and len(ran) == 1
    assert rec["verification"].startswith(
        "not verified: the overflow moved to blocks.0.mlp.fc1 (step 3, forward)"
    )
    assert next_line is not None and next_line.startswith("next: python -m amp_lab ")
    assert next_line.endswith(
        "precision.fp32_modules=[blocks.0.mlp.fc2,blocks.0.mlp.fc1] (not run: over --budget=0 s)"
    )


@pytest.mark.slow
def test_a_moved_mlp_overflow_in_a_timm_vit_ends_verified(tmp_path, capsys):
    """fc1's fp16 output overflows; kept in fp32, its huge output overflows fc2's fp16 input
    cast instead. The doctor grows the set to both, within the budget, and verifies it."""
    report, out = _doctor(
        tmp_path,
        capsys,
        "model.kwargs.depth=2",
        "precision=fp16",
        "fault.overflow_module=blocks.0.mlp.fc1",
        "--steps",
        "6",
        "--budget",
        "60",
    )
    top = report["recommendations"][0]
    assert top["cause"] == "forward_overflow" and top["module"] == "blocks.0.mlp.fc1"
    assert top["grown"]["tried"][0]["forward_nonfinite"]["module"] == "blocks.0.mlp.fc2"
    assert top["override"] == "precision.fp32_modules=[blocks.0.mlp.fc1,blocks.0.mlp.fc2]"
    assert top["verified"] is True and report["next"] is None
    assert "probe scaler_check: skipped: the forward pass overflows" in out


def test_advice_never_repeats_what_the_config_already_does():
    user = [*TINY, "precision=fp16"]
    applied = applied_by(user, compose_settings(user))
    assert applied("precision=fp16 scaler.enabled=true")  # None follows the mode: dynamic
    assert applied("pitfall=none")
    assert not applied("scaler.init_scale=1024")
    noscale = [*TINY, "precision=fp16_noscale"]
    assert not applied_by(noscale, compose_settings(noscale))("precision=fp16 scaler.enabled=true")


@pytest.mark.slow
def test_the_default_config_is_healthy_and_an_unhurt_underflow_is_no_alarm(tmp_path, capsys):
    """The first command a user tries, on the default config (fp32, test_convnext): fp16
    without a scaler flushes most gradients at the first step, yet every probe's loss falls as
    fp32's does; the autocast probe says so, and nothing is recommended."""
    assert main(["--steps", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "doctor.json").read_text())
    probes = report["probes"]
    assert [e["rule"] for e in probes["autocast"]["summary"]["health"]] == ["underflow"]
    assert probes["autocast"]["deviation_from_fp32"] < 0.01  # its loss tracks fp32's
    assert probes["autocast"]["verdict"] == "underflow, loss unhurt"
    assert {n: p["verdict"] for n, p in probes.items() if n != "autocast"} == dict.fromkeys(
        ("fp32", "autocast+scaler", "bf16"), "ok"
    )
    assert [r["cause"] for r in report["recommendations"]] == ["none"]
    assert "1. no precision problem found" in capsys.readouterr().out


@pytest.mark.slow
def test_underflow_whose_scaled_probe_tracks_fp32_offers_the_scaler_first(tmp_path, capsys):
    """fp16 without a scaler on a small loss (test_convnext, the default model): 89% of its
    gradients flush and its loss ends 11% off fp32's. The scaled probe flushes most of them at the
    first step too, yet its loss tracks fp32's: that probe is labelled so, and the loss scaler is
    offered first and verified, bf16 after it."""
    assert main(["precision=fp16_noscale", "fault.loss_multiplier=1e-4", "--steps", "20",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "doctor.json").read_text())
    probes = report["probes"]
    assert probes["autocast"]["verdict"] == "underflow"
    assert probes["autocast"]["deviation_from_fp32"] > 0.05
    assert probes["autocast+scaler"]["verdict"] == "underflow, loss unhurt"
    scaler, bf16 = report["recommendations"][:2]
    assert scaler["problem"] == "gradients underflow without loss scaling"
    assert scaler["override"] == "precision=fp16 scaler.enabled=true" and scaler["verified"]
    assert bf16["override"] == "precision=bf16" and bf16["verified"]


def test_underflow_with_every_gradient_zero_is_never_unhurt():
    """Drawn case (seed 47): fp16 without a scaler, the loss x1e-6: every gradient flushed, and
    in 12 steps fp32's loss had moved less than health.loss_rel, so the autocast probe 'tracked'
    it. Nothing trains there: the verdict stays `underflow`."""
    health = [{"rule": "underflow", "kind": "window", "words": "underflow: 100% zero"}]
    base = Probe("fp32", [], losses=[2.30, 2.29, 2.28, 2.27, 2.26, 2.25])
    flat = [2.30] * 6  # within 2% of fp32's curve
    records = [{"diag/grad_zero_share": share} for share in (1.0, 1.0, 1.0)]
    dead = Probe("autocast", [], losses=flat, summary={"health": health}, records=records)
    assert dead.deviation(base) <= HealthConfig().loss_rel
    assert verdict(dead, base, HealthConfig()) == "underflow"
    some = [{"diag/grad_zero_share": share} for share in (1.0, 0.5, 0.4)]
    alive = Probe("autocast", [], losses=flat, summary={"health": health}, records=some)
    assert verdict(alive, base, HealthConfig()) == "underflow, loss unhurt"


def test_the_table_of_five_probes_reads_whole_on_an_80_column_terminal():
    """The probes of an fp16 run with its scaler (the scaler check too) side by side, with the
    figures of a real 12-step doctor run: every column drawn to its right border (rich's own
    fitting cut the last ones off), every probe's name and verdict whole."""
    losses = [2.302, 2.2, 2.1, 2.0, 1.9, 1.73]
    summary = {"health": [], "steps": 12, "skipped_steps": 0, "final_loss_scale": 65536.0}
    records = [{"diag/grad_zero_share": 0.0, "diag/update_ratio": 3.93e-3}]
    names = ["fp32", "autocast", "autocast+scaler", "bf16", "scaler_check"]
    probes = {n: Probe(n, [], losses=losses, summary=summary, records=records) for n in names}
    console = Console(width=80, record=True)
    console.print(verdict_table(probes, HealthConfig(), console.width))
    lines = console.export_text().splitlines()[1:]  # under the title
    assert all(len(line) <= 80 and line[-1] in "┓┃┩│┘" for line in lines), "\n".join(lines)
    header = next(line for line in lines if line.startswith("┃ probe"))
    assert [cell.strip() for cell in header.strip("┃ ").split("┃")] == ["probe", *names]
    verdicts = next(line for line in lines if line.startswith("│ verdict"))
    assert [cell.strip() for cell in verdicts.strip("│ ").split("│")] == ["verdict", *["ok"] * 5]
