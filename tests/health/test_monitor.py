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


def _result(loss: float, skip: float | None = 0.0, scale: float = 65536.0) -> StepResult:
    found = 0 if skip is None else torch.tensor(skip)  # 0: a step without a scaler
    return StepResult(torch.tensor(loss), torch.tensor(3), 8, None, found, torch.tensor(scale))


def _monitor(dynamic: bool = True, log_every: int = 10, **cfg) -> Monitor:
    history = History(dynamic, 65536.0, math.log(10))
    return Monitor(HealthConfig(**cfg), CPU, log_every, GradScaler("cpu", enabled=False), history)


def _feed(monitor: Monitor, steps: list[tuple], zero: float | None = None) -> list[str]:
    """Each step (loss, skip, scale) through the monitor, a log window every log_every steps;
    returns every warning line, the end rules' included."""
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
        *("attn_logits", "kurtosis", "adam_rms", "updates_erased", "eps_lost", "decay_lost"),
    }
    assert all(r.label and r.when in ("window", "end", "any") for r in RULES.values())


@pytest.mark.parametrize(
    "override, message",
    [
        ("health.skip_rate=0", "health.skip_rate=0.0 must be in (0, 1]"),
        ("health.rise=-1", "health.rise=-1.0 must be finite and > 0"),
        ("health.attn_logit=0", "health.attn_logit=0.0 must be finite and > 0"),
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


def test_the_step_and_the_light_diagnostics_write_one_row_between_probes(tmp_path):
    """Between probe steps the loop adds what a hand-written loop does, plus the accuracy count,
    the schedule and the monitor's one row (the light diagnostics write none)."""
    run = build(settings("precision=fp16", "diagnostics.every=100"), tmp_path)
    images, labels = run.data.train.tensors
    batch = [(images[:16], labels[:16])]
    run.train_step(batch, measure_norm=False, step=1)  # the first step creates the state
    diagnostics = run.train_step.diagnostics
    result = run.train_step(batch, measure_norm=False, step=2)
    with OpCount() as count:
        diagnostics.begin_step(3)
        diagnostics.before_optimizer_step()
        diagnostics.end_step(result)
        run.monitor.add(result)
    assert count.ops == ["aten._foreach_copy_.default"]
    assert result.scale is not None and result.scale.item() == 65536.0
