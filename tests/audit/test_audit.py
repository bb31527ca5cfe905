"""The precision audit on real configs and real timm models: each mode's first step against values
worked out by hand for test_vit and test_convnext, and the silent downgrades of the field
injected into amp_lab's own build, each caught with the line a user reads."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAST, settings

from amp_lab.audit.audit import BrokenPromise
from amp_lab.build import build
from amp_lab.precision.scaling import StaticGradScaler
from amp_lab.records import AUDIT_FILE, SUMMARY_FILE
from amp_lab.run import Run
from amp_lab.tools.audit import audit_one_step
from amp_lab.trainer import Trainer

FP8 = ["precision=fp8", "precision.fp8_emulate=true"]
CONVNEXT = ["model=test_convnext", "data.img_size=32"]
B = 16  # trainer.batch_size in FAST

# test_vit on 16 px digits: 4x4 patches of 1 channel -> 16 patches + the class token, width 64,
# MLP 192, 6 blocks, a 64 -> 10 head on the class token. A Linear's step is 3 GEMMs of
# 2*rows*in*out FLOPs (forward, grad_input, grad_weight); the patch conv's input needs no gradient.
VIT_TOKENS = B * 17
VIT_BLOCK = 3 * 2 * VIT_TOKENS * (64 * 192 + 64 * 64 + 64 * 192 + 192 * 64)
VIT_LINEARS = 6 * VIT_BLOCK
VIT_HEAD = 3 * 2 * B * 64 * 10
VIT_PATCH = 2 * 2 * B * 16 * 64 * 16
# test_convnext on 32 px: stages of width 24, 32, 48, 64 at 8x8, 4x4, 2x2, 1x1 positions with
# 1, 2, 4, 2 blocks; each block's MLP is a C -> 4C -> C pair of Linears. Stage 0's (24 wide) are
# not multiples of 16, so fp8 converts the 16 Linears of stages 1-3.
CONVNEXT_FP8 = sum(
    blocks * 2 * (3 * 2 * B * positions * width * 4 * width)
    for width, positions, blocks in [(32, 16, 2), (48, 4, 4), (64, 1, 2)]
)

PROMISES = {  # (compute, params, masters, state, loss, scaler), by hand from each mode's row
    "fp32": ("fp32", "fp32", "fp32", "fp32", "fp32", False),
    "fp16": ("fp16", "fp32", "fp32", "fp32", "fp32", True),
    "fp16_noscale": ("fp16", "fp32", "fp32", "fp32", "fp32", False),
    "bf16": ("bf16", "fp32", "fp32", "fp32", "fp32", False),
    "bf16_pure": ("bf16", "bf16", "fp32", "fp32", "fp32", False),
    "fp16_pure": ("fp16", "fp16", "fp32", "fp32", "fp32", True),
    "fp8": ("fp8", "fp32", "fp32", "fp32", "fp32", False),
}


def audited_step(run: Run) -> dict:
    """The run's first step under its audit; the audit's record."""
    images, labels = run.data.train.tensors
    with run.audit.around(1):
        run.train_step([(images[:B], labels[:B])], step=1)
    assert run.audit.result is not None
    return run.audit.result


def audit_of(tmp_path, *overrides: str) -> dict:
    return audited_step(build(settings(*overrides), tmp_path))


def fit_and_stop(tmp_path, *overrides: str) -> str:
    """Train under audit=stop; the line the broken promise stopped it with (after 1 step)."""
    trainer = Trainer(build(settings(*overrides, "trainer.max_steps=3"), tmp_path))
    with pytest.raises(BrokenPromise) as stopped:
        trainer.fit()
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["steps"] == 0 and summary["status"].startswith("stopped: precision audit")
    assert summary["precision_audit"]["kept"] is False
    assert (tmp_path / AUDIT_FILE).exists()
    return str(stopped.value)


MODES = [
    ["precision=fp32"],
    ["precision=fp16"],
    ["precision=fp16_noscale"],
    ["precision=bf16"],
    ["precision=bf16_pure"],
    ["precision=fp16_pure"],
    FP8,
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m[0].split("=")[1])
def test_each_mode_on_test_vit_keeps_its_promise_as_worked_out_by_hand(tmp_path, mode):
    audit = audit_of(tmp_path, *mode)
    name = mode[0].split("=")[1]
    p = audit["promise"]
    assert (p["compute"], p["params"], p["masters"], p["state"], p["loss"], p["scaler"]) == (
        PROMISES[name]
    )
    assert audit["kept"] and audit["breaches"] == []
    flops = audit["coverage"]["flops"]
    low = PROMISES[name][0]
    if name == "fp8":  # the 24 block Linears in float8; the patch conv and the head in bf16
        assert flops == {"fp8": VIT_LINEARS, "bf16": VIT_PATCH + VIT_HEAD}
        assert len(audit["fp8"]["converted"]) == 24 and audit["fp8"]["emulated"] is True
        assert audit["fp8"]["left"] == {"head": "the classifier"}
        assert audit["headline"] == (
            "fp8: 99.7% of GEMM FLOPs in fp8 (emulated); bf16: patch_embed.proj (0.3%, not a "
            "Linear), head (<0.1%, not converted: the classifier)"
        )
    else:
        assert flops == {low: VIT_LINEARS + VIT_HEAD + VIT_PATCH}
        assert audit["headline"] == f"{name}: 100.0% of GEMM FLOPs in {low}"
    assert audit["modules"]["blocks.0.mlp.fc1"]["gemm_flops"] == {
        low: 3 * 2 * VIT_TOKENS * 64 * 192
    }
    assert audit["loss"] == {"dtype": "fp32"}
    weights = {w["dtype"] for w in audit["params"].values()}
    assert weights == {PROMISES[name][1]}
    grads = {w["grad"] for w in audit["params"].values()}
    assert grads == weights  # backward leaves each gradient in its weight's dtype
    masters = audit["optimizer"]["master_weights"]
    assert masters["exist"] == name.endswith("_pure")
    assert audit["scaler"]["enabled"] and audit["scaler"]["scaled_loss"]
    assert (audit["scaler"]["class"] == "GradScaler") == PROMISES[name][5]
    assert audit["scaler"]["scale"] == (65536.0 if PROMISES[name][5] else 1.0)  # init_scale


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m[0].split("=")[1])
def test_each_mode_on_test_convnext_runs_every_gemm_where_promised(tmp_path, mode):
    audit = audit_of(tmp_path, *CONVNEXT, *mode)
    assert audit["kept"], audit["breaches"]
    name = mode[0].split("=")[1]
    p = audit["promise"]
    assert (p["compute"], p["params"], p["masters"], p["state"], p["loss"], p["scaler"]) == (
        PROMISES[name]
    )
    weights = {w["dtype"] for w in audit["params"].values()}
    assert weights == {PROMISES[name][1]}
    assert {w["grad"] for w in audit["params"].values()} == weights
    flops = audit["coverage"]["flops"]
    if mode == FP8:
        assert flops["fp8"] == CONVNEXT_FP8
        assert set(flops) == {"fp8", "bf16"}  # convolutions and the unconverted Linears
        left = audit["fp8"]["left"]
        assert left["head.fc"] == "the classifier"
        assert left["stages.0.blocks.0.mlp.fc1"] == "dims 24x96 not multiples of 16"
        assert len(audit["fp8"]["converted"]) == 16
        # torch's formula for a grouped convolution's backward: more than twice its forward's
        depthwise = 2 * B * 8 * 8 * 24 * 7 * 7
        assert audit["modules"]["stages.0.blocks.0.conv_dw"]["gemm_flops"]["bf16"] > 3 * depthwise
    else:  # every convolution and Linear in the mode's dtype
        assert set(flops) == {PROMISES[name][0]}


def test_fp32_modules_stay_in_fp32_and_the_headline_names_them(tmp_path):
    audit = audit_of(tmp_path, "precision=bf16", "precision.fp32_modules=[head]")
    assert audit["kept"]
    assert audit["coverage"]["flops"] == {"bf16": VIT_LINEARS + VIT_PATCH, "fp32": VIT_HEAD}
    assert audit["headline"] == (
        "bf16: >99.9% of GEMM FLOPs in bf16; fp32: head (<0.1%, fp32_modules)"
    )
    assert audit["modules"]["head"]["output"] == "fp32"


def test_low_precision_state_and_an_ema_are_audited(tmp_path):
    audit = audit_of(tmp_path, "precision=bf16", "optim.state_dtype=bf16", "trainer.ema.decay=0.99")
    assert audit["kept"], audit["breaches"]
    assert audit["ema"] == ["fp32"]
    group = audit["optimizer"]["groups"][0]
    assert group["state"] == {"exp_avg": {"bf16": group["params"]}, "exp_avg_sq": {"bf16": 54}}


# -- the silent downgrades, injected into amp_lab's own build -------------------------------------
def test_weights_cast_to_half_precision_are_caught(tmp_path, monkeypatch):
    """FSDP bf16-mixed initialising its fp32 masters in half precision (Lightning #21586)."""
    import amp_lab.build

    keep_in_fp32 = amp_lab.build.keep_in_fp32

    def cast_then_keep(net, patterns, device):
        net.bfloat16()  # the injected downgrade, before the optimizer is built on the weights
        return keep_in_fp32(net, patterns, device)

    monkeypatch.setattr(amp_lab.build, "keep_in_fp32", cast_then_keep)
    line = fit_and_stop(tmp_path, "precision=bf16")
    assert line.startswith(
        "precision audit, before the first step: precision=bf16 promises fp32 weights, but "
        "those of (model), blocks.0.attn.proj, blocks.0.attn.qkv, blocks.0.mlp.fc1 and 36 more "
        "are bf16 (and 2 more: precision_audit.json)"
    )  # 40 modules hold weights; the other 2 breaches: both param groups (no state before a step)


def test_an_ignored_fp32_modules_entry_is_caught(tmp_path, monkeypatch):
    import amp_lab.build

    monkeypatch.setattr(amp_lab.build, "keep_in_fp32", lambda net, patterns, device: [])
    line = fit_and_stop(tmp_path, "precision=bf16", "precision.fp32_modules=[head]")
    assert line == (
        "precision audit: precision.fp32_modules promises fp32 GEMMs in head, but they ran in "
        "bf16; audit=warn trains on regardless"
    )


def test_a_state_dtype_left_fp32_is_caught(tmp_path, monkeypatch):
    import amp_lab.precision.optimizer_state as optimizer_state

    monkeypatch.setitem(optimizer_state.MOMENT_DTYPES, "bf16", torch.float32)
    line = fit_and_stop(tmp_path, "optim.state_dtype=bf16")
    assert "optim.state_dtype=bf16 promises bf16 optimizer state, but it holds exp_avg in " in line


def test_a_disabled_scaler_under_fp16_is_caught(tmp_path, monkeypatch):
    """A GradScaler configured but never enabled (Protenix #258, lerobot #4652): in amp_lab, the
    scale-1 scaler of the modes that need none built for fp16."""
    import amp_lab.build

    unscaled = lambda cfg, policy: StaticGradScaler(policy.device.type, scale=1.0)  # noqa: E731
    monkeypatch.setattr(amp_lab.build, "build_scaler", unscaled)
    line = fit_and_stop(tmp_path, "precision=fp16")
    assert (
        "precision=fp16 promises a dynamic loss scaler, but its scaler holds a fixed scale" in line
    )


def test_fp8_converting_nothing_is_caught(tmp_path, monkeypatch):
    """fp8 asked for, bf16 ran (Hyperloom #421)."""
    import amp_lab.precision.fp8 as fp8

    monkeypatch.setattr(fp8, "convert_to_fp8", lambda *args: [])
    line = fit_and_stop(tmp_path, *FP8)
    assert (
        "precision=fp8 promises float8 GEMMs, but no Linear was converted: the step ran in "
        "bf16" in line
    )


def test_clipping_scaled_gradients_is_caught_and_a_pitfall_only_warns(tmp_path, caplog):
    """The pitfall lab breaks its promise on purpose: audited, warned about, trained on."""
    trainer = Trainer(
        build(
            settings(
                "precision=fp16",
                "pitfall=clip_before_unscale",
                "trainer.clip_grad=1.0",
                "trainer.max_steps=2",
            ),
            tmp_path,
        )
    )
    assert trainer.fit()["steps"] == 2
    assert "the loss scaler promises unscaled gradients at clipping" in caplog.text


@pytest.mark.parametrize(
    "overrides, breaks",
    [(["precision=bf16"], False), (["precision=fp16", "scaler.init_scale=1"], True)],
    ids=["bf16", "fp16 starting at scale 1"],
)
def test_clipping_before_unscale_breaks_a_promise_only_where_the_scale_can_move(
    tmp_path, overrides, breaks
):
    """A scale fixed at 1 (bf16) makes the order of clip and unscale_ change nothing: no broken
    promise. A dynamic scaler at 1 grows later, so the wrong order is still caught."""
    pitfall = ["pitfall=clip_before_unscale", "trainer.clip_grad=1.0"]
    result = audit_one_step([*FAST, *overrides, *pitfall], tmp_path)
    assert result["scaler"]["unscaled_before_clip"] is False and result["scaler"]["scale"] == 1
    lines = [b["line"] for b in result["breaches"]]
    assert lines == (
        [
            "the loss scaler promises unscaled gradients at clipping, but they were "
            "clipped before unscale_"
        ]
        if breaks
        else []
    )


def test_audit_warn_trains_on_and_audit_off_records_nothing(tmp_path, monkeypatch, caplog):
    import amp_lab.build

    monkeypatch.setattr(amp_lab.build, "keep_in_fp32", lambda net, patterns, device: [])
    warned = Trainer(
        build(
            settings(
                "precision=bf16",
                "precision.fp32_modules=[head]",
                "audit=warn",
                "trainer.max_steps=2",
            ),
            tmp_path / "warn",
        )
    ).fit()
    assert warned["steps"] == 2 and warned["precision_audit"]["kept"] is False
    assert "precision audit: precision.fp32_modules promises fp32 GEMMs in head" in caplog.text
    off = Trainer(
        build(settings("precision=bf16", "audit=off", "trainer.max_steps=2"), tmp_path / "off")
    ).fit()
    assert off["precision_audit"] is None and not (tmp_path / "off" / AUDIT_FILE).exists()


def test_steps_after_the_audited_one_run_unwatched(tmp_path):
    """The hooks, the dispatch mode and the stage wrappers are gone after the first step."""
    run = build(settings("precision=fp16"), tmp_path)
    before_step, before_scaler = dict(vars(run.train_step)), dict(vars(run.scaler))
    audited_step(run)
    assert vars(run.train_step).keys() == before_step.keys()
    assert run.train_step.before_unscale is before_step["before_unscale"]
    assert vars(run.scaler).keys() == before_scaler.keys()
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    assert run.audit.around(2).__class__.__name__ == "nullcontext"


@pytest.mark.parametrize(
    "overrides",
    [
        ["optim.state_dtype=int8"],  # torchao keeps tensors under 4096 values in fp32
        ["precision=fp16", "scaler=hysteresis"],
        ["precision=fp16", "scaler.kind=static"],  # a fixed scale, asked for
        ["precision=fp16", "scaler.enabled=false"],  # the doctor's autocast probe
        ["precision=fp16", "trainer.grad_accum=2", "diagnostics=full"],
        ["precision=bf16", "trainer.clip_grad=1.0", "trainer.clip_mode=value"],
        [
            "precision=bf16_pure",
            "precision.master_weights=false",
            "precision.update_rounding=kahan",
        ],
        ["precision=bf16_pure", "trainer.ema.decay=0.99", "trainer.ema.fp32=false"],
    ],
    ids=["int8_state", "hysteresis", "static", "no_scaler", "accum", "clip", "kahan", "ema"],
)
def test_no_healthy_configuration_is_flagged(tmp_path, overrides):
    audit = audit_of(tmp_path, *overrides)
    assert audit["kept"], audit["breaches"]


def test_a_loss_computed_in_fp16_is_caught(tmp_path):
    audit = audit_of(tmp_path, "precision=fp16", "pitfall=loss_in_low_precision")
    assert audit["loss"] == {"dtype": "fp16"}
    assert [b["line"] for b in audit["breaches"]] == [
        "precision=fp16 promises the loss in fp32 at backward, but it was fp16"
    ]
