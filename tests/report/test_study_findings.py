"""What each study's README says its CPU variant found, checked against the report.json that
`make studies` committed next to it: a regenerated study whose numbers no longer carry the
README's prose fails here, and the prose is then rewritten with the new figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.compose import settings
from helpers.reports import cells

from amp_lab.components.data import DataSpec
from amp_lab.components.models import build_model

ROOT = Path(__file__).resolve().parents[2]


def _groups(study: str) -> dict[str, dict]:
    data = json.loads((ROOT / "experiments" / study / "report" / "report.json").read_text())
    return {group["name"]: group for group in data["groups"]}


def _mean(cell: dict, figure: str) -> float:
    return cell["figures"][figure]["mean"]


def _within_noise(cell: dict) -> bool:
    """Δacc within 2 std of the paired Δ over seeds (the report's noise band)."""
    acc = cell["delta"]["acc"]
    return acc["n"] == 3 and abs(acc["mean"]) <= 2 * acc["std"]


def test_scaler_grid_high_scale_pays_in_skipped_steps_and_loss_not_beyond_noise():
    groups = _groups("scaler_grid")
    for interval in (10, 100):
        grid = cells(groups[f"scaler.growth_interval={interval}"])
        assert _mean(grid["65536"], "final_val_acc") > 0.7  # the runs learn: 75-76%
        high = grid["16777216"]
        assert len(high["health"]) >= 1 and all("unstable" in h for h in high["health"])
        assert 7 <= _mean(high, "skipped_steps") <= 11
        assert 2**16 <= _mean(high, "final_loss_scale") <= 2**17  # backed off
        assert high["delta"]["loss_rel"] > 0.1  # val loss 14-15% above 65536's
        assert _within_noise(high)  # accuracy: -1.1 ± 2.7 pp, noise
        assert _mean(grid["1024"], "skipped_steps") == 0
    slow = groups["scaler.growth_interval=100"]
    assert "1024 matches 65536" in slow["verdict"]
    assert _mean(cells(slow)["65536"], "skipped_steps") == 0
    assert cells(slow)["1024"]["figures"]["final_loss_scale"]["mean"] == 1024  # no underflow
    fast = groups["scaler.growth_interval=10"]
    probing = cells(fast)["1024"]
    assert "1024 is better than 65536" in fast["verdict"]  # on loss: 65536's probes skip
    assert _mean(cells(fast)["65536"], "skipped_steps") >= 2
    assert _mean(cells(fast)["65536"], "final_loss_scale") == 2**17
    assert _mean(probing, "final_loss_scale") == 2**16  # grew from 2^10, no skip
    assert -0.05 < probing["delta"]["loss_rel"] < -0.02  # 65536's val loss 3.4% above
    assert abs(probing["delta"]["acc"]["mean"]) < 0.01


def _run_accs(study: str, *words: str) -> list[float]:
    data = json.loads((ROOT / "experiments" / study / "report" / "report.json").read_text())
    return [r["final_val_acc"] for r in data["runs"] if all(w in r["label"] for w in words)]


def test_fp16_lr_warmup_warmup_rescues_the_too_high_lr_only():
    groups = _groups("fp16_lr_warmup")
    high, low = cells(groups["lr.scale=1"]), cells(groups["lr.scale=0.5"])
    assert "15 is better than 0" in groups["lr.scale=1"]["verdict"]
    assert high["15"]["delta"]["acc"]["mean"] > 0.1 and high["15"]["delta"]["loss_rel"] < -0.1
    assert not _within_noise(high["15"])
    assert _within_noise(low["15"])  # +0.6 ± 10.4 pp
    assert -0.05 < low["15"]["delta"]["loss_rel"] < -0.02  # "better" on loss alone
    spread = _run_accs("fp16_lr_warmup", "lr.scale=0.5", "warmup_steps=0,")
    assert len(spread) == 3 and min(spread) < 0.55 and max(spread) > 0.7
    # the lower LR without warmup beats the high LR with it
    assert _mean(low["0"], "final_val_acc") > _mean(high["15"], "final_val_acc") + 0.2
    assert 0 < _mean(high["0"], "skipped_steps") < 1 and 0 < _mean(high["15"], "skipped_steps") < 1
    assert _mean(low["0"], "skipped_steps") == _mean(low["15"], "skipped_steps") == 0


def test_optimizer_state_only_fp16_moments_break_adamw_and_the_states_hold_their_bytes():
    groups = _groups("optimizer_state")
    runs = json.loads(
        (ROOT / "experiments" / "optimizer_state" / "report" / "report.json").read_text()
    )["runs"]
    fp16_runs = [r for r in runs if "state_dtype=fp16," in r["label"]]
    assert len(fp16_runs) == 6 and all(r["health"][0].startswith("diverged") for r in fp16_runs)
    fp32_state = [r["final_val_acc"] for r in runs if "state_dtype=fp32," in r["label"]]
    assert 0.77 <= min(fp32_state) and max(fp32_state) <= 0.85  # the seeds span 77-85%
    for mode, step in (("fp32", 4), ("bf16_pure", 5)):
        group = groups[f"precision.name={mode}"]
        grid = cells(group)
        assert _mean(grid["fp32"], "final_val_acc") > 0.75  # the runs learn: 80%
        assert grid["fp16"]["health"] == [f"diverged at step {step}"]
        for state in ("bf16", "int8", "fp8"):
            assert f"{state} matches fp32" in group["verdict"], (mode, state)
        assert _within_noise(grid["int4"]) or abs(grid["int4"]["delta"]["acc"]["mean"]) <= 0.01
        state_bytes = {s: _mean(c, "optimizer_state_bytes") for s, c in grid.items()}
        assert state_bytes == {
            "fp32": 2_045_520,  # 8 bytes per parameter: 255,690 parameters
            "bf16": 1_022_760,
            "fp16": 1_022_760,
            "int8": 605_392,
            "fp8": 554_192,
            "int4": 315_344,
        }
    assert "int4 matches fp32" in groups["precision.name=fp32"]["verdict"]
    pure_int4 = cells(groups["precision.name=bf16_pure"])["int4"]
    assert "int4 is better than fp32" in groups["precision.name=bf16_pure"]["verdict"]
    assert -0.03 < pure_int4["delta"]["loss_rel"] < -0.02  # just past the 2% threshold


def test_beyond_autocast_every_mode_matches_bf16_within_a_noise_of_about_a_point():
    (group,) = _groups("beyond_autocast").values()
    grid = cells(group)
    assert group["reference"] == "bf16" and _mean(grid["bf16"], "final_val_acc") > 0.75
    for mode in ("bf16_pure", "fp16", "fp8"):
        assert f"{mode} matches bf16" in group["verdict"]
        acc = grid[mode]["delta"]["acc"]
        assert acc["n"] == 3 and abs(acc["mean"]) < 0.01 and acc["std"] < 0.015
        assert abs(grid[mode]["delta"]["loss_rel"]) < 0.004
        assert _mean(grid[mode], "skipped_steps") == 0 and not grid[mode]["health"]


def test_recipe_precision_every_mode_matches_fp32_under_both_recipes():
    groups = list(_groups("recipe_precision").values())
    plain, deit = sorted(groups, key=lambda g: float(g["settings"]["data.mixup_alpha"]))
    assert (plain["settings"]["data.mixup_alpha"], deit["settings"]["data.mixup_alpha"]) == (
        "0",
        "0.8",
    )
    for group in (plain, deit):
        grid = cells(group)
        for mode in ("fp16", "bf16", "bf16_pure"):
            assert f"{mode} matches fp32" in group["verdict"]
            assert abs(grid[mode]["delta"]["acc"]["mean"]) < 0.01  # no mode a point away
            assert abs(grid[mode]["delta"]["loss_rel"]) < 0.014  # within 1.3%
            assert _mean(grid[mode], "skipped_steps") == 0
    plain_acc, deit_acc = (_mean(cells(g)["fp32"], "final_val_acc") for g in (plain, deit))
    assert plain_acc > 0.75 and 0.05 < plain_acc - deit_acc < 0.1  # the recipe: -7.7 pp


def test_grad_accum_matches_the_large_batch_and_updates_the_scaler_once_per_step():
    groups = _groups("grad_accum")
    exact = cells(groups["precision.name=fp32"])
    assert _mean(exact["1 batch_size=64"], "final_val_acc") > 0.75
    for setting in ("2 batch_size=32", "4 batch_size=16"):
        assert f"{setting} matches 1 batch_size=64" in groups["precision.name=fp32"]["verdict"]
        assert exact[setting]["delta"]["acc"] == {"mean": 0.0, "std": 0.0, "n": 3, "paired": True}
        assert abs(exact[setting]["delta"]["loss_rel"]) < 1e-6
    scaled = cells(groups["precision.name=fp16"])
    for setting in ("2 batch_size=32", "4 batch_size=16"):
        assert f"{setting} matches 1 batch_size=64" in groups["precision.name=fp16"]["verdict"]
        assert abs(scaled[setting]["delta"]["loss_rel"]) < 0.011
    # 4 doublings in 40 steps at growth_interval=10: once per optimizer step, not per micro-batch
    assert _mean(scaled["4 batch_size=16"], "final_loss_scale") == 2**20
    assert _mean(scaled["4 batch_size=16"], "skipped_steps") == 0
    for setting in ("1 batch_size=64", "2 batch_size=32"):
        assert _mean(scaled[setting], "skipped_steps") >= 1
        assert 2**17 <= _mean(scaled[setting], "final_loss_scale") <= 2**18
    seeds = _run_accs("grad_accum")
    assert 0.72 < min(seeds) and max(seeds) < 0.82  # the seeds span 73-81%


def test_precision_modes_the_cnn_predicts_alike_the_vit_matches_within_a_small_noise():
    groups = _groups("precision_modes")
    cnn, vit = cells(groups["model.name=test_convnext"]), cells(groups["model.name=test_vit"])
    for mode in ("fp16", "bf16"):
        # the CNN: every seed ends on the same accuracy in every mode (the artefact)
        assert cnn[mode]["delta"]["acc"] == {"mean": 0.0, "std": 0.0, "n": 3, "paired": True}
        assert f"{mode} matches fp32" in groups["model.name=test_vit"]["verdict"]
        acc = vit[mode]["delta"]["acc"]
        assert acc["n"] == 3 and 0 < acc["std"] < 0.01 and abs(acc["mean"]) <= 0.003
        assert abs(vit[mode]["delta"]["loss_rel"]) < 0.0003  # within 0.03%
    assert _mean(vit["fp32"], "final_val_acc") > 0.75  # 79.1%: the ViT learns in 60 steps
    assert _mean(vit["fp16"], "skipped_steps") == 0
    assert _mean(vit["fp16"], "final_loss_scale") == 2**16


def _rank0_state_bytes() -> int:
    """AdamW's two fp32 moments over rank 0's FSDP2 shards of the study's model on 2 ranks: each
    parameter split along its first dimension, rank 0 holding the larger half."""
    cfg = settings("+experiment/cpu=fsdp_precision", "+parallel=fsdp", fast=False)
    model = build_model(cfg.model, DataSpec(1, 10, cfg.data.img_size))  # digits: grey, 10 classes
    return sum(8 * math.ceil(p.shape[0] / 2) * p[0].numel() for p in model.parameters())


def test_fsdp_precision_every_policy_matches_ddp_and_the_state_per_rank_halves():
    groups = _groups("fsdp_precision")
    fp32, bf16 = (cells(groups[f"precision.name={m}"]) for m in ("fp32", "bf16"))
    ddp = "ddp param_dtype=auto reduce_dtype=auto"
    gathered = "fsdp param_dtype=auto reduce_dtype=auto"  # under bf16: bf16-gathered weights
    reduced = "fsdp param_dtype=auto reduce_dtype=bf16"
    masters = "fsdp param_dtype=fp32 reduce_dtype=auto"
    shard_bytes = _rank0_state_bytes()
    assert shard_bytes == 8 * 255_690 // 2 + 1_536  # cls_token, pos_embed stay whole on rank 0
    for mode, grid, acc, std in (("fp32", fp32, 0.822, 0.030), ("bf16", bf16, 0.818, 0.036)):
        assert grid[ddp]["reference"] and grid[ddp]["figures"]["final_val_acc"] == {
            "mean": pytest.approx(acc, abs=5e-4),
            "std": pytest.approx(std, abs=5e-4),
            "n": 3,
            "paired": True,
        }  # the runs learn: 82%
        verdict = groups[f"precision.name={mode}"]["verdict"]
        for policy in (gathered, reduced, masters):
            assert f"{policy} matches {ddp} " in verdict, (mode, policy)
            assert _mean(grid[policy], "skipped_steps") == 0 and not grid[policy]["health"]
            assert _mean(grid[policy], "optimizer_state_bytes") == shard_bytes
            for key in ("param_bytes", "grad_bytes"):  # fp32 shards and their gradients
                assert _mean(grid[policy], key) == shard_bytes // 2, (mode, policy, key)
        assert _mean(grid[ddp], "optimizer_state_bytes") == 8 * 255_690  # 2 fp32 moments each
        assert _mean(grid[ddp], "param_bytes") == _mean(grid[ddp], "grad_bytes") == 4 * 255_690
    for policy in (gathered, masters):  # fp32: FSDP2 computes what DDP computes
        assert fp32[policy]["delta"]["acc"] == {"mean": 0.0, "std": 0.0, "n": 3, "paired": True}
        assert 0 <= fp32[policy]["delta"]["loss_rel"] < 2e-7
    assert bf16[masters]["delta"]["acc"] == {"mean": 0.0, "std": 0.0, "n": 3, "paired": True}
    assert bf16[masters]["delta"]["loss"] == {"mean": 0.0, "std": 0.0, "n": 3, "paired": True}
    for grid, policy, acc, std, loss_rel in (
        (bf16, gathered, 0.007, 0.007, -0.011),
        (fp32, reduced, -0.001, 0.002, -0.0002),
        (bf16, reduced, 0.006, 0.003, -0.012),
    ):
        delta = grid[policy]["delta"]
        assert delta["acc"]["mean"] == pytest.approx(acc, abs=5e-4), policy
        assert delta["acc"]["std"] == pytest.approx(std, abs=5e-4), policy
        assert delta["loss_rel"] == pytest.approx(loss_rel, rel=0.05)  # the val loss, relative
        assert delta["loss"]["std"] > 0  # the arithmetic moved: the seeds' losses differ
