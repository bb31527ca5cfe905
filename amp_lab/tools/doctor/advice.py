"""The doctor's recommendations from the probes' verdicts and diagnostics, ranked by evidence,
each one override (docs/diagnostics.md, "Baseline first" and "Recommendations")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amp_lab.choices import PitfallName
from amp_lab.config import AmpLabConfig
from amp_lab.tools.doctor import mechanism
from amp_lab.tools.doctor.verdict import HEALTHY, TRAINS, Probe, verdict


@dataclass
class Advice:
    """The user's settings (their `health` thresholds judge) and how the probes ran them."""

    settings: AmpLabConfig
    steps: int  # optimizer steps per probe
    low_dtype: str  # fp16 or bf16: the autocast dtype the probes used
    user_scaled: bool = True  # the user's own config runs a dynamic loss scaler
    fp32_candidates: tuple[str, ...] = ()  # amp_lab numerics' ranking, best first (or none)


SIGNATURE_FIXES = {  # pitfall signature -> (score, problem, fix)
    "clip_before_unscale": (
        95,
        "gradients are clipped while still scaled",
        "unscale before clipping: scaler.unscale_(optimizer), then "
        "clip_grad_norm_, then scaler.step",
    ),
    "half_model": (
        92,
        "master weights / optimizer state are not fp32",
        "keep weights and optimizer state in fp32 (no model.half()); autocast casts the matmuls",
    ),
    "no_scaler_update": (
        90,
        "steps skip but the loss scale never backs off",
        "call scaler.update() once per optimizer step, after scaler.step()",
    ),
    "update_every_microbatch": (
        90,
        "the loss scale moves more than once per optimizer step",
        "call scaler.update() once per optimizer step, not per micro-batch",
    ),
    "loss_in_low_precision": (
        85,
        "the loss is computed in low precision",
        "compute the loss in fp32: loss_fn(logits.float(), labels)",
    ),
}
# early warning (health/rules.py EARLY) -> (score, problem, the override removing its cause), most
# urgent first: qk-layernorm bounds attention logits (Wortsman et al. 2023), stochastic rounding
# carries small updates, fp32 masters the decay, fp32 state eps; None: a lower LR calms the rest
WARNINGS: dict[str, tuple[int, str, str | None]] = {
    "eps_lost": (82, "Adam's eps is 0 in its state dtype", "optim.state_dtype=fp32"),
    "attn_logits": (
        80,
        "attention logits grow until the run diverges",
        "++model.kwargs.qk_norm=true",
    ),
    "updates_erased": (
        78,
        "rounding erases the 16-bit weights' small updates",
        "precision.update_rounding=stochastic",
    ),
    "decay_lost": (
        68,
        "weight decay is rounded away in the 16-bit weights",
        "precision.master_weights=true",
    ),
    "adam_rms": (65, "Adam's second moment lags the gradient (a loss spike follows)", None),
    "grad_spike": (63, "the gradient norm spikes far above its running mean", None),
    "loss_spike": (62, "the loss spikes far above its running mean", None),
    "kurtosis": (55, "outlier features grow in the activations", None),
}
NO_PROBLEM = "no precision problem found"
BASELINE = "the baseline does not train: not a precision problem"
# cause -> (score, problem; None: the problem names what the probes found), most urgent first
# (the pitfall signatures' and the early warnings' are in their tables)
CAUSES: dict[str, tuple[int, str | None]] = {
    "baseline": (100, BASELINE),
    "forward_overflow": (88, None),
    "underflow_no_scaler": (85, "gradients underflow without loss scaling"),
    "crashed": (75, None),
    "eager_growth": (74, "the loss scale grows too eagerly"),
    "init_scale_high": (72, "the initial loss scale is too high"),  # 40 unless judged `skips`
    "bf16": (70, "fp16's range is the problem; bf16 has fp32's exponent range"),
    "unstable_scale": (60, "the loss scale keeps backing off (unstable gradients)"),
    "drift": (50, "the mixed-precision loss drifts from fp32"),
    "unexplained": (1, None),
    "transient": (0, NO_PROBLEM),
    "none": (0, NO_PROBLEM),
}


def _rec(cause: str, evidence: str, override: str | None = None, **given: Any) -> dict[str, Any]:
    """A recommendation: its score and problem from CAUSES unless `given`, as its code `fix`."""
    score, problem = CAUSES.get(cause, (0, None))
    rec = {"cause": cause, "score": score, "problem": problem, "evidence": evidence}
    return {**rec, "override": override, "fix": None} | given


def baseline_fixes(advice: Advice, lr_scale: float | None = None) -> list[str]:
    """What to try when fp32 does not train, gentlest first (from `lr_scale`, or the user's)."""
    s = advice.settings
    lr = s.lr.scale if lr_scale is None else lr_scale
    warm = max(s.lr.warmup_steps * 2, advice.steps // 3, 1)  # a third of the probe
    clip = "" if s.trainer.clip_grad > 0 else " trainer.clip_grad=1.0"
    lower = f"lr.scale={lr / 10:g} lr.warmup_steps={warm}"
    return [
        f"lr.warmup_steps={warm}",
        lower,
        f"{lower}{clip}",
        f"lr.scale={lr / 100:g} lr.warmup_steps={warm}{clip}",
    ]


def _warning_recs(probes: dict[str, Probe], advice: Advice) -> list[dict[str, Any]]:
    """One recommendation per early warning a probe raised (its first probe's evidence)."""
    lr = advice.settings.lr
    warm = max(lr.warmup_steps * 2, advice.steps // 5, 1)
    calmer = f"lr.scale={lr.scale * 0.5:g} lr.warmup_steps={warm}"
    recs: list[dict[str, Any]] = []
    for rule, (score, problem, fix) in WARNINGS.items():  # a shared fix goes to the first
        probe = next((p for p in probes.values() if rule in p.findings), None)
        if probe is None or (fix or calmer) in [r["override"] for r in recs]:
            continue
        evidence = next(e["evidence"] for e in probe.summary["health"] if e["rule"] == rule)
        evidence = f"{probe.name}: {evidence}"
        recs.append(_rec(rule, evidence, fix or calmer, score=score, problem=problem))
    return recs


def user_probe(probes: dict[str, Probe], advice: Advice) -> Probe:
    """The probe that runs what the user runs: autocast with or without their scaler."""
    return probes["autocast+scaler" if advice.user_scaled else "autocast"]


def recommend(
    probes: dict[str, Probe],
    advice: Advice,
    fp32_set: list[str] | None = None,
    applied: Callable[[str], bool] = lambda override: False,
) -> list[dict[str, Any]]:
    """Ranked recommendations, most urgent first, none the config already does (`applied`)."""
    base = probes["fp32"]
    said = {name: verdict(p, base, advice.settings.health) for name, p in probes.items()}
    rerun = "see the traceback: python -m amp_lab <your overrides>"
    recs = [
        _rec(
            "crashed",
            p.crashed,
            problem=f"the {p.name} probe crashed",
            fix=f"{rerun} {' '.join(p.overrides[-2:])}",
        )
        for p in probes.values()
        if p.crashed
    ]
    if said["fp32"] not in TRAINS:  # baseline first: the precision advice and warnings wait
        why = f"fp32 probe: {said['fp32']}, loss {base.curve()}"
        fix = baseline_fixes(advice)[0]
        recs.append(_rec("baseline", f"{why}; fix the LR, warmup or clipping first", fix))
    else:
        recs += _precision_recs(probes, said, advice, fp32_set) + _warning_recs(probes, advice)
        recs = [r for r in recs if not (r["override"] and applied(r["override"]))]
        if not any(r["score"] > 0 for r in recs):
            mine = user_probe(probes, advice)
            recs.append(_no_problem(mine, base, said[mine.name], advice))
    return sorted(recs, key=lambda r: -r["score"])


def _signatures(probes: dict[str, Probe], low: list[Probe]) -> dict[str, str]:
    """Each pitfall signature a probe saw, with the first one's evidence (the user's probe's
    first, the fp32 baseline's last, then the scaler check's)."""
    seen: dict[str, str] = {}
    for probe in [*low, probes["fp32"]]:
        seen.update({k: v for k, v in probe.diag.get("signatures", {}).items() if k not in seen})
    if (active := probes.get(mechanism.NAME)) and not active.crashed:  # the injected overflow
        found = mechanism.signatures(active)
        seen.update({k: f"{active.name}: {v}" for k, v in found.items() if k not in seen})
    return seen


def _forward_rec(
    low: list[Probe], advice: Advice, fp32_set: list[str] | None
) -> dict[str, Any] | None:
    """Keep the module of the first forward overflow in fp32, or the one amp_lab numerics ranks
    first. None beside pitfall=half_model: its fp16 weights cannot run a module in fp32."""
    if advice.settings.pitfall.name == PitfallName.half_model:
        return None
    for probe in low:
        if (event := probe.overflow) is not None:
            break
    else:
        return None
    module = (advice.fp32_candidates or (event["module"],))[0]
    ranked = f"; amp_lab numerics ranks {module} first" if advice.fp32_candidates else ""
    modules = fp32_set or [*advice.settings.precision.fp32_modules, module]
    evidence = (
        f"{probe.name}: first non-finite value at step {event['step']}, the output of "
        f"{event['module']} (max |x| {event['max_abs']}, fp16 max 65504); no loss scale can "
        f"fix a forward overflow{ranked}"
    )
    problem = f"{event['module']} overflows {event['dtype']} in the forward pass"
    override = f"precision.fp32_modules=[{','.join(modules)}]"
    return {"module": module, **_rec("forward_overflow", evidence, override, problem=problem)}


def _precision_recs(
    probes: dict[str, Probe], said: dict[str, str], advice: Advice, fp32_set: list[str] | None
) -> list[dict[str, Any]]:
    base, noscale, scaled = probes["fp32"], probes["autocast"], probes["autocast+scaler"]
    mine = user_probe(probes, advice)
    low = [p for p in (mine, scaled, noscale) if not p.unavailable and not p.crashed]
    seen = _signatures(probes, low)
    recs: list[dict[str, Any] | None] = []
    for name, evidence in seen.items():
        score, problem, fix = SIGNATURE_FIXES[name]
        recs.append(_rec(name, evidence, "pitfall=none", score=score, problem=problem, fix=fix))
    recs.append(forward := _forward_rec(low, advice, fp32_set))
    if said["autocast"] in ("underflow", "stalls", "deviates") and said[scaled.name] in HEALTHY:
        evidence = (
            f"{noscale.name}: {_pct(noscale.flushed)} of gradient elements are zero (fp32: "
            f"{_pct(base.flushed)}), loss {noscale.curve()}; with the scaler: "
            f"loss {scaled.curve()}"
        )
        override = f"precision={advice.low_dtype} scaler.enabled=true"
        recs.append(_rec("underflow_no_scaler", evidence, override))
    if not forward and not seen:
        recs.append(_scaler_rec(scaled, base, said[scaled.name], advice))
    bf16 = probes.get("bf16")
    fp16_fails = said[mine.name] not in HEALTHY or forward
    if bf16 and not seen and said["bf16"] in HEALTHY and fp16_fails:
        evidence = f"bf16 loss {bf16.curve()} tracks fp32 ({base.curve()})"
        recs.append(_rec("bf16", evidence, "precision=bf16"))
    return [r for r in recs if r]  # None: no forward overflow, nothing the scale says


def _scaler_rec(scaled: Probe, base: Probe, said: str, advice: Advice) -> dict[str, Any] | None:
    """What the loss scale's course says of the scaler's settings (or None)."""
    lr, scaler = advice.settings.lr, advice.settings.scaler
    final = scaled.summary.get("final_loss_scale") or scaler.init_scale
    # skips from step 1 on and none after, or a scale still above 2**16 after every step skipped:
    # it started too high. Counted in skips, not backoffs: hysteresis holds the first overflows.
    cumulative = [r.get("amp/skipped_steps", 0) for r in scaled.records]
    leading = next((i for i, n in enumerate(cumulative) if n != i + 1), len(cumulative))
    skipped = scaled.summary.get("skipped_steps", 0)
    growths = sum(e["kind"] == "growth" for e in scaled.diag.get("scale_events") or [])
    unstable = final < 1.0 or said == "skips"
    warm = max(lr.warmup_steps * 2, advice.steps // 5)
    scale = f"scale {scaler.init_scale:g} -> {final:g}"
    if leading >= 3 and (leading == skipped or final > 2.0**16):
        evidence = f"{leading} steps skipped from step 1: {scale}"
        override = f"scaler.init_scale={min(final, 2.0**16):g}"
        score = 72 if "skips" in scaled.findings else 40
        return _rec("init_scale_high", evidence, override, score=score)
    if unstable and growths >= 2 and scaler.growth_interval < 2000:
        # the scale grows back into overflow again and again: growth, not the model, is wrong
        evidence = (
            f"{scaled.name}: {growths} growths and {skipped} skipped steps in "
            f"{advice.steps} (scaler.growth_interval={scaler.growth_interval}), {scale}"
        )
        return _rec("eager_growth", evidence, "scaler.growth_interval=2000")
    if unstable:
        evidence = f"{scaled.name}: {_pct(scaled.skip_rate)} of steps skipped, {scale}"
        calmer = (
            f"lr.scale={lr.scale * 0.5:g} lr.warmup_steps={warm} "
            f"scaler.growth_interval={max(5000, scaler.growth_interval * 2)}"
        )
        return _rec("unstable_scale", evidence, calmer)
    if said == "deviates":
        evidence = f"{scaled.name}: mean |loss - fp32| / fp32 = {_pct(scaled.deviation(base))}"
        calmer = f"lr.scale={min(0.7, lr.scale * 0.7):g} lr.warmup_steps={warm}"
        return _rec("drift", evidence, calmer)
    return None


def _no_problem(mine: Probe, base: Probe, said: str, advice: Advice) -> dict[str, Any]:
    skipped = mine.summary.get("skipped_steps", 0)
    tracks = (
        f"{mine.name} tracks fp32 within {_pct(mine.deviation(base))} over {advice.steps} steps"
    )
    if said not in HEALTHY:
        problem = f"the {mine.name} probe {said}, cause not found"
        evidence = f"loss {mine.curve()}; compare the probes' records in doctor.json"
        return _rec("unexplained", evidence, problem=problem)
    if skipped and mine.summary.get("health") == []:
        steps = [e["step"] for e in mine.diag.get("scale_events") or [] if e["kind"] == "backoff"]
        return _rec(
            "transient",
            f"the scaler handled {skipped} transient overflow{'s' * (skipped > 1)} (skipped "
            f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps)) or '?'}, the scale "
            f"backed off and training went on); {tracks}",
        )
    return _rec("none", tracks)


def _pct(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.0%}"
