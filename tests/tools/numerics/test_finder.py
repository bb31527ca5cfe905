"""The divergence finder (`amp_lab numerics`) on real timm models: what docs/diagnostics.md
promises of it, on test_vit and test_convnext at 16 px on one CPU thread."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from helpers import FAST

import amp_lab.build
from amp_lab.tools.numerics.cli import NUMERICS_FILE, PLOT_FILE, main, table
from amp_lab.tools.numerics.find import find

MODELS = ["test_vit", "test_convnext"]
# per model: a norm whose fp32 output (max |x| ~3), times the fault's factor, is finite but passes
# fp16's 65504 where the next GEMM casts it to fp16
OVERFLOW = {
    "test_vit": ("blocks.0.norm1", 20000),
    "test_convnext": ("stages.1.downsample.0", 25000),
}
LOWERED = {"test_vit": "blocks.1.mlp.fc1", "test_convnext": "stages.1.blocks.0.mlp.fc1"}


def _overrides(model: str, *more: str) -> list[str]:
    size = ["data.img_size=32"] if model == "test_convnext" else []  # its stem needs 32 px
    return [*FAST, f"model={model}", *size, *more]


@pytest.mark.parametrize("model", MODELS)
def test_bf16_errors_sit_8x_above_fp16s_per_layer_and_both_inside_their_bands(model):
    found = find(_overrides(model, "precision=bf16"), "fp32", ["fp16"])["modes"]
    bf16, fp16 = found["bf16"], found["fp16"]
    ratios = [
        b["norm"] / f["norm"] for b, f in zip(bf16["forward"], fp16["forward"]) if f["norm"] > 0
    ]
    # 7 against 10 mantissa bits: 2^3 = 8 per layer
    assert 6 < statistics.median(ratios) < 10, statistics.median(ratios)
    assert sum(4 < r < 16 for r in ratios) >= 0.9 * len(ratios)
    for mode in (bf16, fp16):
        assert mode["first_out_of_band"]["forward"] is None
        assert all(r["ratio"] < 1 for r in mode["forward"])  # inside the band, not just the flag
    assert bf16["first_out_of_band"]["backward"] is None
    assert bf16["output"]["logit_kl"] > fp16["output"]["logit_kl"] > 0


def _lower_in_bf16(monkeypatch, module: str) -> None:
    """The bf16 build's `module` rounds its output to float8 e4m3: below its bf16 label."""
    built = amp_lab.build.model

    def model(settings, where, feed):
        net = built(settings, where, feed)
        if settings.precision.name == "bf16":
            dict(net.named_modules())[module].register_forward_hook(
                lambda m, args, out: out.to(torch.float8_e4m3fn).to(out.dtype)
            )
        return net

    monkeypatch.setattr(amp_lab.build, "model", model)


@pytest.mark.parametrize("model", MODELS)
def test_a_module_computing_below_its_label_is_named_first(model, tmp_path, monkeypatch, capsys):
    _lower_in_bf16(monkeypatch, LOWERED[model])
    code = main([*_overrides(model, "precision=bf16"), "--out", str(tmp_path)])
    assert code == 1  # a finding
    first = json.loads((tmp_path / NUMERICS_FILE).read_text())["modes"]["bf16"]
    assert first["first_out_of_band"]["forward"]["module"] == LOWERED[model]
    assert first["first_out_of_band"]["forward"]["flag"] == "out of band"
    assert f"first out of band, forward:  {LOWERED[model]} (out of band" in capsys.readouterr().out
    # the cast's backward rounds the gradient to e4m3 too: the module's weight gradient is a fault
    weights = {r["module"]: r for r in first["params"]}
    assert weights[LOWERED[model]]["flag"] == "out of band", weights[LOWERED[model]]
    assert (tmp_path / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"


def test_convnexts_bf16_weight_gradients_sit_in_bands_that_count_their_own_sums():
    """At the default batch (64 digits at 32 px) ConvNeXt's first LayerNorms sum each weight's
    gradient over 64 x 8 x 8 positions; their healthy bf16 error (3x a band counting the batch
    alone) sits inside a band counting that sum's length. The ViT's class token and position
    embedding are added once per sample: their sums count the batch."""
    found = find(["model=test_convnext", "precision=bf16", "trainer.device=cpu"], "fp32", [])
    bf16 = found["modes"]["bf16"]
    assert [r["module"] for r in bf16["params"] if r["flag"]] == []
    assert bf16["first_out_of_band"]["backward"] is None
    weights = {r["module"]: r for r in bf16["params"]}
    assert [weights[m]["terms"] for m in ("stem.1", "stages.0.blocks.0.mlp.fc1")] == [4096, 4096]
    assert weights["stages.3.blocks.0.norm"]["terms"] == 64  # 1 x 1 positions left
    assert weights["head.fc"]["terms"] == 64
    vit = find(_overrides("test_vit", "precision=bf16"), "fp32", [])["modes"]["bf16"]
    weights = {r["module"]: r for r in vit["params"]}
    assert (weights[""]["terms"], weights["blocks.0.attn.qkv"]["terms"]) == (16, 16 * (16 + 1))


@pytest.mark.parametrize("model", MODELS)
def test_an_injected_overflow_is_named_before_it_turns_non_finite(model):
    module, factor = OVERFLOW[model]
    found = find(
        _overrides(
            model,
            "precision=fp16",
            f"fault.overflow_module={module}",
            f"fault.overflow_factor={factor}",
        ),
        "fp32",
        [],
    )
    fp16 = found["modes"]["fp16"]
    first = fp16["first_out_of_band"]["forward"]
    assert (first["module"], first["flag"], first["nonfinite"]) == (module, "near overflow", 0.0)
    broken = next(r for r in fp16["forward"] if r["nonfinite"] > 0)
    assert broken["index"] > first["index"] and broken["flag"] == "non-finite"
    # what the terminal shows: each flagged row whole on an 80-column line, and the non-finite
    # one says how much of it is
    rows = [line for line in table(found) if line.startswith("    ")]
    assert rows and all(len(line) <= 80 for line in rows), max(rows, key=len)
    share = f"{broken['nonfinite']:.1%} of its elements"
    assert f"    {broken['module']} (float16): non-finite, {share}" in rows


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["precision=fp32", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "amp_lab: error: precision=fp32 is the reference itself; name the mode to test, e.g. "
        "amp_lab numerics precision=bf16 --vs fp32"
    ]
    assert main(["--also", "fp64", "model=test_vit", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "amp_lab: error: --also fp64: not a precision mode (use fp32, tf32, fp16, "
        "fp16_noscale, bf16, bf16_pure, fp16_pure, fp8)"
    )
    with pytest.raises(SystemExit) as stop:
        main(["--vs", "fp64"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("amp_lab: error: argument --vs: invalid choice: 'fp64'")


def test_convnexts_fp16_gradients_sit_in_subnormals_at_the_default_initial_scale():
    """Its layer scale (1e-6) makes the residual branches' gradients ~1e-10: subnormal in fp16
    even at 65536x, so the finder flags them `subnormal` rather than plain out of band."""
    found = find(_overrides("test_convnext", "precision=fp16"), "fp32", [])["modes"]["fp16"]
    assert found["loss_scale"] == 65536.0
    assert found["first_out_of_band"]["forward"] is None
    first = found["first_out_of_band"]["backward"]
    assert first["flag"] == "subnormal" and first["dtype"] == "float16"
    assert first["max_abs"] * found["loss_scale"] < 2.0**-14  # below fp16's smallest normal


def test_float8_layers_sit_about_10x_above_bf16_inside_their_own_band():
    pytest.importorskip("torchao")
    found = find(
        _overrides("test_vit", "precision=fp8", "precision.fp8_emulate=true"), "fp32", ["bf16"]
    )["modes"]
    fp8, bf16 = found["fp8"], found["bf16"]
    ratios = [a["norm"] / b["norm"] for a, b in zip(fp8["forward"], bf16["forward"]) if b["norm"]]
    # float8 e4m3 rounds GEMM inputs 16x coarser than bf16; outputs stay bf16
    assert 5 < statistics.median(ratios) < 16, statistics.median(ratios)
    assert fp8["first_out_of_band"]["forward"] is None


def _fp16_scale(start: float, *scaler: str) -> tuple[float, bool]:
    """The finder's loss scale on fp16 test_vit from `start`, and whether its weight gradients
    came out finite."""
    found = find(
        _overrides("test_vit", "precision=fp16", f"scaler.init_scale={start}", *scaler),
        "fp32",
        [],
    )["modes"]["fp16"]
    return found["loss_scale"], all(r["nonfinite"] == 0 for r in found["params"])


def test_an_overflowing_scale_moves_by_the_runs_own_scaler():
    """fp16 gradients of test_vit pass 65504 at a scale of 2^26: the finder's scale is where the
    run's own scaler would take it (its backoff factor, its floor, a static scale's none), not a
    halving of the finder's own."""
    start = 2.0**26
    halved, finite = _fp16_scale(start)
    assert halved < start and finite
    eighth, finite = _fp16_scale(start, "scaler.backoff_factor=0.125")
    assert finite and eighth in {start / 8**k for k in range(1, 9)}
    assert halved / 8 < eighth <= halved
    # the hysteresis scaler stops at its min_scale: it keeps the scale there, overflowing
    floor = halved * 16
    hysteresis = ["scaler=hysteresis", f"scaler.min_scale={floor}", f"scaler.max_scale={start}"]
    assert _fp16_scale(start, *hysteresis) == (floor, False)
    assert _fp16_scale(start, "scaler=static") == (start, False)


def test_the_logits_kl_is_the_sum_of_p_log_p_over_q_on_its_edge_cases():
    """compare.kl (torch's F.kl_div) equals the mean of sum p (log p - log q) over the batch:
    on plain and fp16-rounded logits, and nan or inf where an infinite logit makes the sum so."""
    from amp_lab.tools.numerics.compare import kl

    def by_hand(p: torch.Tensor, q: torch.Tensor) -> float:
        log_p, log_q = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
        return float(torch.sum(log_p.exp() * (log_p - log_q), -1).mean())

    torch.manual_seed(0)
    p, inf = torch.randn(4, 10), float("inf")
    assert kl(p, p) == 0.0
    for test in (torch.randn(4, 10), p.half().float()):
        assert kl(p, test) == pytest.approx(by_hand(p, test), rel=1e-12)
    one = torch.tensor([[0.0, 1.0]])
    for a, b in ((torch.tensor([[0.0, inf]]), one), (torch.tensor([[0.0, -inf]]), one)):
        assert torch.isnan(torch.tensor(kl(a, b))) and torch.isnan(torch.tensor(by_hand(a, b)))
    assert kl(one, torch.tensor([[0.0, -inf]])) == by_hand(one, torch.tensor([[0.0, -inf]])) == inf
