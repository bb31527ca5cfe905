"""The rule table: each fact a run states about itself is one entry of RULES, decided here once.

A rule reads a run's History (fed by monitor.py) and the `health.*` thresholds, and fires at most
once per run: window rules at each log window, end rules at the end, `diverged` at both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from amp_lab.config import HealthConfig


@dataclass
class Window:
    """One log window, as the monitor read it (host values)."""

    first_step: int
    last_step: int
    finite: int  # steps whose loss was finite
    skipped: int  # steps whose update was skipped (non-finite gradients)
    loss: float  # mean of the finite losses (nan if none)
    scale: float  # loss scale after the window
    clean_before: bool = True  # a step before this window updated the weights
    zero_grad_share: float | None = None  # a probe step's share of exactly-zero gradients
    signals: dict[str, Any] = field(default_factory=dict)  # the early-warning figures (SIGNALS)

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


@dataclass
class History:
    """What the rules judge: the run's log windows and its running counts."""

    dynamic_scale: bool  # a dynamic loss scaler is meant to adapt the scale
    init_scale: float
    # ln(classes): a fresh classifier's cross-entropy. The first log window's mean can
    # already hold a blown-up loss, so "rises" compares with the lower of the two
    chance_loss: float = math.inf
    allowed_holds: int = 0  # skipped steps in a row a scaler may hold its scale (hysteresis - 1)
    windows: list[Window] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    worst_streak: int = 0  # the most consecutive skipped steps
    first_bad: int | None = None  # the first step that skipped or had a non-finite loss
    floor: str | None = None  # the scaler's own reason it cannot go on (hysteresis floor)
    # the spikes' running means: the last health.window losses and norms of unskipped steps
    recent_losses: list[float] = field(default_factory=list)
    recent_norms: list[float] = field(default_factory=list)
    lowest_loss: float = math.inf  # the lowest mean loss of health.window steps so far

    def span(self, windows: list[Window], steps: int) -> list[Window]:
        """The fewest windows from the start of `windows` covering `steps` steps."""
        taken, covered = [], 0
        for w in windows:
            taken.append(w)
            covered += w.steps
            if covered >= steps:
                break
        return taken

    def tail_loss(self, steps: int) -> float:
        """The mean finite loss of the last `steps` steps (whole log windows); inf if none."""
        finite = [w for w in self.windows if w.finite and math.isfinite(w.loss)]
        return _mean(self.span(finite[::-1], steps)) if finite else math.inf

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [Window(**w) for w in value] if key == "windows" else value)


@dataclass(frozen=True)
class Finding:
    rule: str
    step: int  # the step it names: the last it saw, or for `diverged` the step it diverged at
    words: str  # what every surface shows
    evidence: str  # the sentence with its threshold


# (history, thresholds, at_end) -> (words, evidence[, the step named, if not the last judged])
Check = Callable[[History, HealthConfig, bool], "tuple[str, str] | tuple[str, str, int] | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    label: str  # the finding in a few words, without figures: merged across seeds by the report
    when: str  # window | end | any
    check: Check


def _final(h: History, cfg: HealthConfig) -> tuple[list[Window], int, int, int]:
    """The last health.window steps' windows (latest first), their steps, finite and skipped."""
    tail = h.span(h.windows[::-1], cfg.window)
    steps = sum(w.steps for w in tail)
    return tail, steps, sum(w.finite for w in tail), sum(w.skipped for w in tail)


def _blown_up(h: History, cfg: HealthConfig) -> str | None:
    """Why the loss learned (fell health.rise below the start), then gave back health.give_back
    of that fall, or None; a run that blew up before it learned is `loss_rises`."""
    finite = [w for w in h.windows if w.finite and math.isfinite(w.loss)]
    if not finite:
        return None
    start, low, now = min(finite[0].loss, h.chance_loss), h.lowest_loss, h.tail_loss(cfg.window)
    fall = start - low
    if low > start * (1 - cfg.rise) or now - low < cfg.give_back * fall:
        return None
    return (
        f"the mean loss of the last {cfg.window} steps, {now:.3g}, gave back "
        f"{(now - low) / fall:.0%} of its fall from {start:.3g} to {low:.3g} (>= "
        f"health.give_back={cfg.give_back:g}): it learned, then blew up"
    )


def _diverged(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str, int] | None:
    step = h.first_bad if h.first_bad is not None else h.windows[-1].last_step
    if h.worst_streak >= cfg.max_bad_steps:
        why = (
            f"{h.worst_streak} consecutive skipped steps (>= health.max_bad_steps="
            f"{cfg.max_bad_steps}): the gradients are non-finite at every step, the weights no "
            "longer move"
        )
    elif h.floor is not None:
        why = h.floor
    elif at_end and (final := _final(h, cfg))[2] == 0:
        why = f"every loss of the last {final[1]} steps is inf/nan"
    elif (blown := _blown_up(h, cfg)) is not None:
        why, step = blown, h.windows[-1].last_step
    else:
        return None
    scale, fell = h.windows[-1].scale, ""
    if h.dynamic_scale and 0 < scale < h.init_scale:
        fell = f" (loss scale fell to 2^{math.log2(scale):.0f})"
    return f"diverged at step {step}{fell}", f"the run diverged: {why}", step


def _skips(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    rate = h.skipped / max(1, h.steps)
    if h.skipped < 2 or rate <= cfg.skip_rate:  # one skip is the scaler doing its job
        return None
    words = f"unstable: {h.skipped} of {h.steps} steps skipped ({rate:.0%})"
    return words, f"{words}, more than health.skip_rate={cfg.skip_rate:g}"


def _skip_burst(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    tail, steps, _, skipped = _final(h, cfg)
    if not tail[-1].clean_before or steps < cfg.window or skipped / steps <= cfg.window_skip_rate:
        return None
    at = f"steps {tail[-1].first_step}-{tail[0].last_step}"
    words = f"skip burst: {skipped} of {steps} steps skipped at {at}"
    return words, (
        f"{words}, more than health.window_skip_rate={cfg.window_skip_rate:g} after the run had "
        "trained"
    )


def _underflow(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    w = h.windows[-1]
    share = w.zero_grad_share
    # a window that skipped says nothing about underflow: its gradients held inf/nan
    if share is None or w.skipped or share < cfg.zero_grad_share:
        return None
    words = f"underflow: {share:.0%} of gradient elements are zero"
    return words, (
        f"{words} (>= health.zero_grad_share={cfg.zero_grad_share:g}): they underflowed, so the "
        "weights they belong to stop learning"
    )


def _scale_collapse(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    scale = h.windows[-1].scale
    if not h.dynamic_scale or scale >= cfg.min_scale:
        return None
    words = f"loss scale collapsed to {scale:g}"
    return words, (
        f"{words} (< health.min_scale={cfg.min_scale:g}, from {h.init_scale:g}): the gradients "
        "overflow even unscaled"
    )


def _scale_pinned(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    if not h.dynamic_scale or h.worst_streak <= h.allowed_holds:
        return None
    if {w.scale for w in h.windows} != {h.init_scale}:
        return None
    words = f"loss scale pinned at {h.init_scale:g} through {h.skipped} skipped steps"
    return words, f"{words}: the scaler never adapts (is scaler.update() called?)"


def _not_training(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    _, steps, _, skipped = _final(h, cfg)
    if not steps or skipped < steps:
        return None
    words = f"no longer training: the last {steps} steps all skipped"
    return words, f"{words} (health.window={cfg.window}): the weights no longer move"


def _trend(h: History, cfg: HealthConfig) -> tuple[float, float, float, bool] | None:
    """(start, first, end, apart): start no higher than ln(classes), the mean losses of the first
    and last health.window steps, whether they are apart; None when the run is too short."""
    finite = [w for w in h.windows if w.finite and math.isfinite(w.loss)]
    head, tail = h.span(finite, cfg.window), h.span(finite[::-1], cfg.window)
    if not head or head[0].last_step >= tail[-1].last_step:
        return None
    start = min(head[0].loss, h.chance_loss)
    return start, _mean(head), _mean(tail), head[-1].last_step < tail[-1].last_step


def _rises(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    trend = _trend(h, cfg)
    if trend is None or trend[2] <= trend[0] * (1 + cfg.rise):
        return None
    start, _, end, _ = trend
    words = f"loss rising ({start:.3g} → {end:.3g})"
    return words, (
        f"{words}, more than {1 + cfg.rise:g}x (health.rise): the run does not train; lower the "
        "LR, add warmup or clipping"
    )


def _stalls(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    trend = _trend(h, cfg)
    if trend is None or h.steps < cfg.min_steps or not trend[3] or _rises(h, cfg, at_end):
        return None  # a rising loss is the stronger finding
    _, first, end, _ = trend
    # from no lower than chance, ln(classes): a loss that blew up first and fell back to chance
    # fell a lot, and learned nothing
    first = min(first, h.chance_loss)
    if end <= first * (1 - cfg.min_drop):
        return None
    words = f"loss stalled ({first:.3g} → {end:.3g} over {h.steps} steps)"
    return words, (
        f"{words}: it fell by less than health.min_drop={cfg.min_drop:g}; the run does not learn"
    )


def _signal(w: Window, key: str) -> float | None:
    value = w.signals.get(key)
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _reaches(key: str, threshold: str, words: str, why: str, probed: bool = True) -> Check:
    """The rule that `key` reached health.<threshold>; a `probed` one only in a skip-free window."""

    def check(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
        w, limit = h.windows[-1], getattr(cfg, threshold)
        value = _signal(w, key)
        if value is None or (probed and w.skipped) or value < limit:
            return None
        figures = {k.split("/", 1)[1]: v for k, v in w.signals.items()}
        said = words.format(value=value, **figures)
        return said, f"{said} (>= health.{threshold}={limit:g}): {why}"

    return check


_loss_spike = _reaches(
    "train/loss_spike",
    "loss_spike",
    "loss spike: {value:.3g}x the mean of the steps before it at step {loss_spike_step}",
    "a loss this far above its running mean comes before a divergence (as Lightning's "
    "SpikeDetection flags it); lower the LR, add warmup or clipping",
    probed=False,
)
_grad_spike = _reaches(
    "train/grad_spike",
    "grad_spike",
    "gradient norm spike: {value:.3g}x the mean of the steps before it at step {grad_spike_step}",
    "the update grows faster than the optimizer adapts; lower the LR, add warmup or clipping",
    probed=False,
)
_attn_logits = _reaches(
    "diag/attn_logit_bound",
    "attn_logit",
    "attention logits growing: up to {value:.3g} in {attn_logit_bound_block}",
    "the softmax is nearly one-hot and the logits grow until the run diverges (Wortsman et al. "
    "2023); qk_norm or a z-loss keeps them bounded, a lower LR slows them",
    probed=False,
)
_kurtosis = _reaches(
    "diag/kurtosis_max",
    "kurtosis",
    "outlier features: kurtosis {value:.3g} in {kurtosis_max_block}",
    "a few features carry the block's activations, which low precision divergence follows (FOG); "
    "lower the LR",
)
_adam_rms = _reaches(
    "diag/adam_rms_max",
    "adam_rms",
    "second moment lags: RMS(g²/v̂) {value:.3g} in {adam_rms_param}",
    "Adam's second moment underestimates the squared gradient, as 1-8 steps before a loss spike "
    "(StableAdamW); lower the LR or lengthen the warmup",
)
_updates_erased = _reaches(
    "diag/erased_share",
    "erased_share",
    "updates rounded away: {value:.0%} of 16-bit weight updates erased",
    "a step below half an ulp of its weight leaves it unchanged; use fp32 masters, stochastic "
    "rounding or Kahan",
)


def _eps_lost(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    w = h.windows[-1]
    eps, floor = _signal(w, "diag/eps"), _signal(w, "diag/eps_floor")
    # at or below half the dtype's smallest positive value eps rounds to 0 (a tie to even);
    # above it, up to that value, which still bounds the step
    if eps is None or floor is None or eps > floor / 2:
        return None
    dtype = w.signals["diag/eps_dtype"]
    words = f"eps {eps:g} is 0 in {dtype}"
    return words, (
        f"{words} (its smallest positive value is {floor:.3g}): where the second moment is 0, "
        "the step divides by nothing; use eps >= that value, or fp32 optimizer state"
    )


def _decay_lost(h: History, cfg: HealthConfig, at_end: bool) -> tuple[str, str] | None:
    w = h.windows[-1]
    lr_wd, floor = _signal(w, "diag/lr_wd"), _signal(w, "diag/lr_wd_floor")
    if lr_wd is None or floor is None or lr_wd >= floor:
        return None
    dtype = w.signals["diag/lr_wd_dtype"]
    words = f"weight decay does nothing in {dtype}: lr x wd = {lr_wd:.3g}"
    return words, (
        f"{words} is below half the relative spacing of {dtype} ({floor:.3g}), so w (1 - lr wd) "
        "rounds back to w; use fp32 masters, stochastic rounding or Kahan"
    )


def _mean(windows: list[Window]) -> float:
    """Mean finite loss over windows, weighted by their finite steps."""
    return sum(w.loss * w.finite for w in windows) / sum(w.finite for w in windows)


DIVERGED = "diverged"
# the figures a Window keeps for the early-warning rules: every step's, then the probe steps'
SIGNALS = (
    "train/loss_spike",
    "train/loss_spike_step",
    "train/grad_spike",
    "train/grad_spike_step",
    "diag/attn_logit_bound",
    "diag/attn_logit_bound_block",
    "diag/kurtosis_max",
    "diag/kurtosis_max_block",
    "diag/adam_rms_max",
    "diag/adam_rms_param",
    "diag/erased_share",
    "diag/eps",
    "diag/eps_floor",
    "diag/eps_dtype",
    "diag/lr_wd",
    "diag/lr_wd_floor",
    "diag/lr_wd_dtype",
)
# the early warnings: they fire before the loss diverges (their lead time: docs/diagnostics.md)
EARLY_RULES = (
    Rule("loss_spike", "loss spike", "window", _loss_spike),
    Rule("grad_spike", "gradient norm spike", "window", _grad_spike),
    Rule("attn_logits", "attention logits growing", "window", _attn_logits),
    Rule("kurtosis", "outlier features", "window", _kurtosis),
    Rule("adam_rms", "second moment lags", "window", _adam_rms),
    Rule("updates_erased", "updates rounded away", "window", _updates_erased),
    Rule("eps_lost", "eps is 0 in the state dtype", "window", _eps_lost),
    Rule("decay_lost", "weight decay does nothing", "window", _decay_lost),
)
EARLY = tuple(rule.name for rule in EARLY_RULES)
RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule(DIVERGED, "diverged", "any", _diverged),
        Rule("underflow", "underflow", "window", _underflow),
        Rule("scale_collapse", "loss scale collapsed", "window", _scale_collapse),
        Rule("skip_burst", "skip burst", "window", _skip_burst),
        Rule("skips", "unstable", "end", _skips),
        Rule("scale_pinned", "loss scale pinned", "end", _scale_pinned),
        Rule("not_training", "no longer training", "end", _not_training),
        Rule("loss_rises", "loss rising", "end", _rises),
        Rule("loss_stalls", "loss stalled", "end", _stalls),
        *EARLY_RULES,
    )
}


def judge(h: History, cfg: HealthConfig, at_end: bool, already: set[str]) -> list[Finding]:
    """The rules due now that fire and had not fired; none once the run has diverged."""
    if not h.windows or DIVERGED in already:
        return []
    found: list[Finding] = []
    for rule in RULES.values():  # `diverged` first
        due = rule.when == "any" or rule.when == ("end" if at_end else "window")
        if not due or rule.name in already:
            continue
        result = rule.check(h, cfg, at_end)
        if result is not None:
            step = result[2] if len(result) == 3 else h.windows[-1].last_step
            found.append(Finding(rule.name, step, result[0], result[1]))
            if rule.name == DIVERGED:
                break
    return found


def rule_names(summary: dict[str, Any]) -> set[str]:
    """The rules that fired in a run, read from its summary.json."""
    return {e["rule"] for e in summary.get("health") or []}


def words_of(summary: dict[str, Any]) -> list[str]:
    """What a run's summary.json says is wrong with it (a rule's name where it has no words)."""
    return [e.get("words") or e["rule"] for e in summary.get("health") or []]
