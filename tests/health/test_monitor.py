"""The monitor and the rule table: one device op per step, the sums, streaks and first non-finite
step read at log steps, and each rule firing on its evidence and on nothing else."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import settings
from torch.amp import GradScaler
from torch.utils._python_dispatch import TorchDispatchMode

from amp_lab.build import build
from amp_lab.components.distributed import DistContext
from amp_lab.config import ConfigError, HealthConfig
from amp_lab.health.monitor import Monitor
from amp_lab.health.rules import RULES, History
from amp_lab.step import StepResult

CPU = torch.device("cpu")


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _result(
    loss: float, skip: float | None = 0.0, scale: float = 65536.0, norm: float = 1.0
) -> StepResult:
    found = 0 if skip is None else torch.tensor(skip)  # 0: a step without a scaler
    return StepResult(
        torch.tensor(loss), torch.tensor(3), 8, torch.tensor(norm), found, torch.tensor(scale)
    )


def _monitor(dynamic: bool = True, log_every: int = 10, **cfg) -> Monitor:
    history = History(dynamic, 65536.0, math.log(10))
    return Monitor(HealthConfig(**cfg), CPU, log_every, GradScaler("cpu", enabled=False), history)


def _feed(monitor: Monitor, steps: list[tuple], zero: float | None = None) -> list[str]:
    """Each step (loss, skip, scale[, gradient norm]) through the monitor, a log window every
    log_every steps; returns every warning line, the end rules' included."""
    lines, every = [], len(monitor.row_views)
    for i, step in enumerate(steps, 1):
        monitor.add(_result(*step))
        if i % every == 0 or i == len(steps):
            rows = monitor.read(i)
            lines += monitor.judge(
                rows, monitor.window_totals(DistContext()), 1, {"diag/grad_zero_share": zero}
            )
    return lines + monitor.finish()


def _fired(steps: list[tuple], zero: float | None = None, **kwargs) -> set[str]:
    monitor = _monitor(**kwargs)
    _feed(monitor, steps, zero)
    return {f.rule for f in monitor.findings}


def _falling(n: int, scale: float = 65536.0) -> list[tuple]:
    return [(2.3 - 0.01 * i, 0.0, scale) for i in range(n)]


def test_a_step_costs_one_op():
    monitor = _monitor(log_every=4)
    results = [_result(1.0), _result(2.0, skip=None)]
    with OpCount() as count:
        for result in results:
            monitor.add(result)
    assert count.ops == ["aten._foreach_copy_.default"] * 2


def test_sums_streaks_and_the_first_bad_step_over_windows_and_a_checkpoint():
    """As adding step by step: nan losses counted apart, the skip streak carried across
    windows and through a checkpoint taken mid-window, the first non-finite step kept."""
    monitor = _monitor(log_every=4)
    for step in [(1.0, 0.0), (math.nan, 1.0), (math.nan, 1.0), (3.0, 0.0)]:
        monitor.add(_result(*step))
    rows = monitor.read(4)
    window = monitor.window_totals(DistContext())
    assert rows.first_step == 1 and rows.skips == [0.0, 1.0, 1.0, 0.0]
    assert window["loss_sum"] == 4.0 and window["loss_count"] == 2 and window["samples"] == 32
    assert window["skipped"] == 2 and monitor.history.worst_streak == 2
    assert monitor.history.first_bad == 2
    monitor.add(_result(2.0))
    monitor.add(_result(math.nan, 1.0))
    saved = monitor.state_dict()
    resumed = _monitor(log_every=4)
    resumed.load_state_dict(saved)
    for _ in range(2):
        resumed.add(_result(math.nan, 1.0))
    rows = resumed.read(8)
    assert rows.first_step == 5 and rows.losses[0] == 2.0  # the window's rows came along
    assert resumed.window_totals(DistContext())["skipped"] == 3
    assert resumed.history.skipped == 5 and resumed.history.worst_streak == 3
    for _ in range(5):  # more steps than a window (a resume mid-window): a longer buffer
        resumed.add(_result(1.0))
    assert len(resumed.read(13).losses) == 5 and resumed.streak == 0


def test_a_healthy_history_has_no_finding():
    monitor = _monitor()
    _feed(monitor, _falling(120))
    assert monitor.findings == [] and "ok" in monitor.summary_line()


@pytest.mark.parametrize(
    "rule, steps, kwargs",
    [
        ("loss_rises", [(2.3, 0.0, 65536.0)] * 10 + [(9.0, 0.0, 65536.0)] * 10, {}),
        ("loss_stalls", [(2.3, 0.0, 65536.0)] * 120, {}),
        # blown up, then back to chance (ln 10 = 2.303): it fell a lot and learned nothing
        ("loss_stalls", [(11.0, 0.0, 65536.0)] * 10 + [(2.31, 0.0, 65536.0)] * 110, {}),
        ("skips", [(2.3, float(i % 4 == 0), 65536.0 / 2 ** (i // 4)) for i in range(20)], {}),
        ("scale_pinned", [(2.3, 1.0, 65536.0)] + _falling(19), {}),
        ("scale_collapse", [(2.3, 1.0, 0.5)] + _falling(19, 0.5), {}),
        ("skip_burst", _falling(10) + [(2.3, float(i < 6), 2.0**14) for i in range(10)], {}),
        ("not_training", _falling(10) + [(2.3, 1.0, 2.0**-i) for i in range(10)], {}),
        ("diverged", _falling(10) + [(math.nan, 1.0, 2.0**-i) for i in range(10)], {}),
        ("diverged", _falling(4) + [(2.3, 1.0, 2.0**16) for i in range(6)], {"max_bad_steps": 5}),
        # learned (2.3 -> 0.8), then gave back more than half of it (2.0)
        ("diverged", [(2.3, 0.0, 1.0)] * 10 + [(0.8, 0.0, 1.0)] * 10 + [(2.0, 0.0, 1.0)] * 10, {}),
        ("loss_spike", _falling(15) + [(6.9, 0.0, 65536.0)] + _falling(4), {}),
        ("grad_spike", _falling(15) + [(2.2, 0.0, 65536.0, 50.0)] + _falling(4), {}),
    ],
)
def test_each_rule_fires_on_its_evidence(rule, steps, kwargs):
    fired = _fired(steps, **kwargs)
    assert rule in fired, fired


def test_rules_that_must_not_fire():
    assert _fired([(2.3, 0.0, 65536.0)] * 50) == set()  # too short to call a stall
    # blown up, then learning: below chance by far more than health.min_drop
    assert _fired([(11.0, 0.0, 65536.0)] * 10 + _falling(110)) == set()
    assert _fired([(2.3, 1.0, 65536.0)] + _falling(19), dynamic=False) == set()  # bf16: no scale
    # the scale settling from a high init_scale is not a burst: no clean step before it
    settling = [(2.3, 1.0, 2.0 ** (24 - i)) for i in range(6)] + _falling(14, 2.0**18)
    assert "skip_burst" not in _fired(settling)
    assert _fired(_falling(20), zero=0.49) == set()
    # one skip in a run that logs every step (the doctor's probes) is not a burst: the rule
    # reads the last health.window steps, not one log window
    one_skip = _falling(15) + [(2.3, 1.0, 2.0**15)] + _falling(5, 2.0**15)
    assert _fired(one_skip, log_every=1) == set()
    # a skipped step's inf gradient norm is no spike: its update did not happen
    assert _fired(_falling(15) + [(2.2, 1.0, 2.0**15, math.inf)] + _falling(4, 2.0**15)) == set()
    # a trained run's batches vary by factors at a low loss: measured against ln(10) / 2 at least
    noisy_end = _falling(20) + [(0.05, 0.0, 1.0)] * 9 + [(0.3, 0.0, 1.0)]
    assert _fired(noisy_end) == set()
    # learned, and its end is noisy: 0.05 -> 0.12 gives back 3% of the fall
    assert _fired(_falling(20) + [(0.05, 0.0, 1.0)] * 10 + [(0.12, 0.0, 1.0)] * 10) == set()
    # blew up before it learned anything: it rises, it did not diverge
    assert _fired([(9.0, 0.0, 1.0)] * 10 + [(20.0, 0.0, 1.0)] * 10) == {"loss_rises"}


def test_the_spikes_are_each_steps_value_against_the_mean_of_the_window_before_it():
    """The largest ratio of the window and its step, over the steps before it (skipped ones left
    out), as the record carries them; the divergence by loss names the log step it was seen."""
    monitor = _monitor(log_every=5, window=4)
    steps = [(2.0, 0.0, 1.0, 1.0)] * 4 + [(2.0, 1.0, 1.0, math.inf), (2.0, 0.0, 1.0, 7.0)]
    _feed(monitor, steps)
    figures = monitor.figures  # the second window: step 6 against steps 1-4 (5 skipped)
    assert figures["train/grad_spike"] == 7.0 and figures["train/grad_spike_step"] == 6
    assert figures["train/loss_spike"] == 1.0
    assert monitor.history.recent_norms == [1.0, 1.0, 1.0, 7.0]  # the last health.window
    learned = [(2.3, 0.0, 1.0)] * 10 + [(0.5, 0.0, 1.0)] * 10 + [(1.5, 0.0, 1.0)] * 10
    monitor = _monitor(dynamic=False)  # bf16: no scale to fall
    _feed(monitor, learned)
    [finding] = monitor.findings
    assert finding.rule == "diverged" and finding.step == 30 and monitor.diverged
    assert finding.words == "diverged at step 30"
    assert "gave back 56% of its fall from 2.3 to 0.5" in finding.evidence


def test_underflow_fires_on_the_zero_gradient_share_of_a_window_without_skips():
    monitor = _monitor(dynamic=False)
    (line,) = _feed(monitor, _falling(20, 1.0), zero=0.97)
    assert line.startswith("run health: underflow: 97% of gradient elements are zero")
    assert monitor.findings[0].words == "underflow: 97% of gradient elements are zero"


def test_divergence_is_decided_once_and_stops_the_run():
    monitor = _monitor(max_bad_steps=5)
    _feed(monitor, _falling(4) + [(math.nan, 1.0, 2.0**-i) for i in range(8)])
    # judged at the log step (step 10): 6 skipped in a row by then
    assert monitor.diverged and "6 consecutive skipped steps" in monitor.stop_reason
    [finding] = [f for f in monitor.findings if f.rule == "diverged"]
    assert finding.words == "diverged at step 5 (loss scale fell to 2^-5)"  # at step 10
    assert {f.rule for f in monitor.findings} == {"diverged"}  # no end rule after a divergence


def test_every_rule_has_a_label_and_a_place_in_the_table():
    assert set(RULES) == {
        "diverged",
        "underflow",
        "scale_collapse",
        "skip_burst",
        "skips",
        "scale_pinned",
        "not_training",
        "loss_rises",
        "loss_stalls",
        *(
            "loss_spike",
            "grad_spike",
            "attn_logits",
            "kurtosis",
            "adam_rms",
            "updates_erased",
            "eps_lost",
            "decay_lost",
        ),
    }
    assert all(r.label and r.when in ("window", "end", "any") for r in RULES.values())


@pytest.mark.parametrize(
    "override, message",
    [
        ("health.skip_rate=0", "health.skip_rate=0.0 must be in (0, 1]"),
        ("health.rise=-1", "health.rise=-1.0 must be finite and > 0"),
        ("health.attn_logit=0", "health.attn_logit=0.0 must be finite and > 0"),
        ("health.loss_spike=1", "health.loss_spike=1.0 must be finite and > 1"),
        ("health.give_back=0", "health.give_back=0.0 must be in (0, 1]"),
        ("health.erased_share=2", "health.erased_share=2.0 must be in (0, 1]"),
        ("health.window=0", "health.window=0 must be >= 1"),
        ("health.confidence=1", "health.confidence=1.0 must be in [0.5, 1)"),
        ("scaler.max_scale=inf", "scaler.max_scale=inf must be finite and > 0"),
        ("scaler.init_scale=inf", "scaler.init_scale=inf must be finite and > 0"),
        ("scaler.growth_factor=inf", "scaler.growth_factor=inf must be finite and > 1"),
    ],
)
def test_bad_thresholds_and_infinite_scales_fail_at_start_up(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings(override)


def _step_ops(tmp_path, *overrides: str) -> list[str]:
    """The ops of a run's third step (no probe) and its monitor row."""
    run = build(settings("data.img_size=32", "diagnostics.every=100", *overrides), tmp_path)
    images, labels = run.data.train.tensors
    batch = [(images[:16], labels[:16])]
    for step in (1, 2):  # the first step creates the optimizer state
        run.train_step(batch, step=step)
    with OpCount() as count:
        run.monitor.add(run.train_step(batch, step=3))
    return count.ops


@pytest.mark.parametrize("model, blocks", [("test_vit", 6), ("test_convnext", 0)])
def test_between_probes_a_step_costs_the_bound_over_diagnostics_off(tmp_path, model, blocks):
    """Between probe steps a light step adds to diagnostics=off's ops only the attention bound's:
    per attention block two norms, two maxima and two products, then a stack and a running max;
    nothing on a model without attention. The monitor's row is one op in both."""
    off = _step_ops(tmp_path / "off", f"model={model}", "diagnostics=off")
    light = _step_ops(tmp_path / "light", f"model={model}")
    added = list(light)
    for op in off:
        added.remove(op)
    assert len(added) == 6 * blocks + 2 * (blocks > 0), sorted(added)
    assert (
        off.count("aten._foreach_copy_.default") == 1 == light.count("aten._foreach_copy_.default")
    )
    assert sorted(set(added)) == (
        ["aten.amax.default", "aten.linalg_vector_norm.default", "aten.maximum.default"]
        + ["aten.mul.Tensor", "aten.stack.default"]
        if blocks
        else []
    )
