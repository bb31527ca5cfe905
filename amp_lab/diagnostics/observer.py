"""Numerics telemetry (`diagnostics=off|light|full`), read back only at log steps.

Probe steps (every `diagnostics.every`) measure fp16 headroom, gradient underflow, the applied
gradient norm and the update-to-weight ratio; module hooks run on probe steps, on every step in
`full`, and in `light` from a non-finite window until it is attributed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from amp_lab.choices import PitfallName
from amp_lab.components.fsdp import full_value, local, shard_group, square_norms, sum_over_shards
from amp_lab.config import DiagnosticsConfig, ScalerConfig
from amp_lab.diagnostics.early_signals import (
    BlockSignals,
    adam_rms,
    erased_counts,
    low_precision_weights,
    optimizer_floors,
    since_start,
)
from amp_lab.diagnostics.grad_numerics import FP16_MAX, HIST_HIGH, HIST_LOW, grad_stats, summarize
from amp_lab.diagnostics.module_probe import ModuleProbe
from amp_lab.diagnostics.optimizer_state import nan_as_inf, probe_state, read_state_probe
from amp_lab.diagnostics.scale_events import ScaleTracker
from amp_lab.precision.master_weights import KAHAN_COMP
from amp_lab.precision.optimizer_state import CHOSEN_STATE
from amp_lab.records import DIAGNOSTICS_FILE
from amp_lab.step import Rows, StepObserver, StepResult, StepView

log = logging.getLogger(__name__)


def low_precision_state(
    named: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> list[str]:
    """Names of weights and optimizer state not in fp32 (but Kahan and optim.state_dtype's)."""
    names = {id(p): n for n, p in named}
    bad = [f"{n} ({p.dtype})" for n, p in named if _not_fp32(p)]
    for param, state in ({} if hasattr(optimizer, CHOSEN_STATE) else optimizer.state).items():
        bad += [
            f"optimizer {key} of {names.get(id(param), '?')} ({t.dtype})"
            for key, t in state.items()
            if key != KAHAN_COMP and _not_fp32(t)
        ]
    return bad


def _not_fp32(t: object) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and t.dtype != torch.float32


class Diagnostics(StepObserver):
    """Watches a TrainStep through its view; `read()` at log steps, `summary()` at the end."""

    def __init__(
        self,
        cfg: DiagnosticsConfig,
        view: StepView,
        scaler_cfg: ScalerConfig,
        dynamic: bool,
        log_every: int,
        out_dir: Path | None,
    ) -> None:
        self.cfg, self.view, self.out_dir = cfg, view, out_dir
        self.device = view.device
        self.every = cfg.every or log_every
        model = getattr(view.model, "_orig_mod", view.model)  # torch.compile wraps the model
        if model is not view.model and cfg.mode == "full":
            log.warning(
                "diagnostics=full hooks every module on every step, which a compiled "
                "model cannot run: every step runs eager. Use diagnostics=light with "
                "trainer.compile=model, or trainer.compile=off"
            )
        self.probe = ModuleProbe(model, self.device)
        self.probe_model = model
        # the logits' bound on every step of an eager model (a compiled one's probe steps run eager)
        self.blocks = BlockSignals(model)
        if model is view.model:
            self.blocks.watch()
        names = {id(p): n for n, p in model.named_parameters()}
        self.optimized_names = [  # the pure modes' masters are not the model's: named by index
            names.get(id(p), f"optimizer param {i} {tuple(p.shape)}")
            for i, p in enumerate(p for g in view.optimizer.param_groups for p in g["params"])
        ]
        self.floors: dict[str, Any] = {}  # eps and lr x wd against their dtypes, read once
        # the pure modes' 16-bit weights at this start (2 bytes a weight): which never moved
        self.start_weights: list[torch.Tensor] | None = None
        self.attn_logit_peak: float | None = None  # the largest attention logit of any probe
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.group = shard_group([p for _, p in self.named])  # FSDP: probes sum over shards
        # a step without a scaler runs at scale 1, and none of its skips backs off
        self.tracker = ScaleTracker(scaler_cfg, dynamic and view.uses_scaler, view.host_scale())
        self.armed, self.probing = False, False
        self.step = 0
        self.warnings: list[str] = []
        self.signatures: dict[str, str] = {}
        self.window: dict[str, Any] = {}
        self.state_checked = False
        self.reported: set[str] = set()  # phases whose attribution was logged

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        if self.start_weights is None:
            self.start_weights = [w.clone() for w in low_precision_weights(self.probe_model)]
        self.probing = self.step % self.every == 0
        if self.probing or self.cfg.mode == "full" or self.armed:
            self.probe.attach()
        if self.probing:
            self.blocks.attach()

    def forward_module(self, model: torch.nn.Module) -> torch.nn.Module:
        # dynamo does not guard on module hooks: steps with the probe attached run eager
        return getattr(model, "_orig_mod", model) if self.probe.attached else model

    def before_optimizer_step(self) -> None:
        if not self.probing:
            return
        found = [(n, p, p.grad) for n, p in self.named if p.grad is not None]
        if not found:
            return
        grads = [g for _, _, g in found]
        # FSDP: each rank counts its own shards; the sums over the ranks are the model's
        counts, hist = grad_stats([local(g) for g in grads], self.view.scale())
        sum_over_shards(counts, self.group)
        sum_over_shards(hist, self.group)
        self.window.update(
            counts=counts,
            sizes=[g.numel() for g in grads],  # a DTensor's numel is the whole tensor's
            grad_names=[n for n, _, _ in found],
            applied_norm=full_value(torch.nn.utils.get_total_norm(grads, foreach=True)),
        )
        self.window["hist"] = hist + self.window["hist"] if "hist" in self.window else hist
        self.window["before"] = [local(p).detach().clone() for _, p, _ in found]
        self.window["params"] = [p for _, p, _ in found]

    def end_step(self, result: StepResult) -> None:
        if result.loss.dtype != torch.float32:
            self.signatures.setdefault(
                PitfallName.loss_in_low_precision.value, f"the loss is {result.loss.dtype}"
            )
        if self.probing and "before" in self.window:
            params, before = self.window.pop("params"), self.window.pop("before")
            delta = torch._foreach_sub([local(p).detach() for p in params], before)
            squares = torch.stack([square_norms(delta).sum(), square_norms(before).sum()])
            delta_sq, before_sq = sum_over_shards(squares, self.group)  # totals over the shards
            self.window["update_ratio"] = delta_sq.sqrt() / before_sq.sqrt().clamp_min(1e-30)
            self.window["state"] = probe_state(
                self.view.optimizer, params, before, delta, self.group
            )
            if self.view.rounding == "nearest":  # stochastic and Kahan carry small updates on
                grads = [local(p.grad) for p in params]
                self.window["erased"] = erased_counts(before, delta, grads)
        elif self.probing:  # pure modes: the gradients sit on the masters; the moments still do
            self.window["state"] = probe_state(self.view.optimizer, [], [], [], self.group)
        self.blocks.end_step()
        if self.probing:
            self.window["adam_rms"] = adam_rms(self.view.optimizer)
            self.blocks.detach()
        if self.probe.attached:
            self.probe.end_step(self.step)
            if not (self.cfg.mode == "full" or self.armed):
                self.probe.detach()
        if not self.state_checked:  # optimizer state exists after the first step
            self.state_checked = True
            self._check_state()
            self.floors = optimizer_floors(self.view.optimizer, self.view.rounding)

    def _check_state(self) -> None:
        """The weights the optimizer updates (StepView's) and its state must be fp32."""
        bad = low_precision_state(self.view.optimized_weights(), self.view.optimizer)
        if bad:
            evidence = f"{len(bad)} not fp32, e.g. {', '.join(bad[:3])}"
            self.signatures[PitfallName.half_model.value] = evidence
            self._warn(
                f"fp32-state check: master weights and optimizer state must be fp32, but "
                f"{evidence}; use autocast instead of model.half()"
            )

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)

    # -- log steps (the only reads) -----------------------------------------------------------
    def read(self, step: int, rows: Rows, first_bad: int | None) -> dict[str, Any]:
        """Flat `diag/` and `amp/` keys for the train record; details go to diagnostics.jsonl."""
        events = self.tracker.feed(rows.first_step, rows.scales, rows.skips)
        for name, evidence in self.tracker.signatures.items():
            self._signature(name, evidence)
        attributed = [self.probe.first[p].read() for p in ("forward", "backward")]
        for phase, found in zip(("forward", "backward"), attributed):
            if found and phase not in self.reported:
                self.reported.add(phase)
                log.warning(
                    "step %d: first non-finite %s in %s (%s, max |x| %s)",
                    found["step"],
                    "output" if phase == "forward" else "input-gradient",
                    found["module"],
                    found["dtype"],
                    found["max_abs"],
                )
        # light mode: watch every step after a window with a non-finite step, until attributed
        self.armed = any(rows.skips) and not all(attributed)
        record: dict[str, Any] = {
            "amp/backoffs": sum(e["kind"] == "backoff" for e in events),
            "amp/growths": sum(e["kind"] == "growth" for e in events),
            "diag/first_nonfinite_step": first_bad,
        }
        detail = {"step": step, "scale_events": events, **self._read_probes(record)}
        if self.out_dir is not None:  # None on DDP ranks other than 0
            with (self.out_dir / DIAGNOSTICS_FILE).open("a", encoding="utf-8") as f:
                f.write(json.dumps(detail) + "\n")
        return record

    def _read_probes(self, record: dict[str, Any]) -> dict[str, Any]:
        w, self.window = self.window, {}
        # largest first (nan the largest); a stable sort keeps the first of equal maxima first
        acts = sorted(self.probe.read_activations().items(), key=lambda kv: -nan_as_inf(kv[1][0]))
        detail: dict[str, Any] = {}
        if acts:
            name, (amax, _) = acts[0]
            record["diag/act_max"], record["diag/act_max_module"] = amax, name
            headroom = math.log2(FP16_MAX / amax) if 0 < amax < math.inf else None
            record["diag/act_headroom_log2"] = headroom
            top = acts[: self.cfg.top_layers]
            detail["activations"] = {n: {"max_abs": v, "dtype": d} for n, (v, d) in top}
        record.update(read_state_probe(w.get("state"), w.get("grad_names", [])))
        blocks = self.blocks.read()
        record.update(blocks)
        seen = [
            v for v in (self.attn_logit_peak, blocks.get("diag/attn_logit_max")) if v is not None
        ]
        self.attn_logit_peak = max(seen, key=nan_as_inf, default=None)
        record.update(self._read_signals(w))
        if "counts" not in w:
            return detail
        stats = summarize(w["counts"].tolist(), w["sizes"], w["grad_names"], self.cfg.top_layers)
        record.update({f"diag/{key}": value for key, value in stats["overall"].items()})
        applied = float(w["applied_norm"])
        record["diag/applied_grad_norm"] = applied
        if "update_ratio" in w:
            record["diag/update_ratio"] = float(w["update_ratio"])
        self._check_clip(applied)
        detail.update(
            grad_layers=stats["layers"],
            grad_log2_hist={"low": HIST_LOW, "high": HIST_HIGH, "counts": w["hist"].tolist()},
        )
        return detail

    def _read_signals(self, w: dict[str, Any]) -> dict[str, Any]:
        """The early-warning figures of the window's probe (the rule table judges them)."""
        record, self.floors = dict(self.floors), {}  # the config-time facts, once
        if w.get("adam_rms") is not None:
            values, index = w["adam_rms"]
            values = values.tolist()
            top = max(range(len(values)), key=lambda i: nan_as_inf(values[i]))
            record["diag/adam_rms_max"] = values[top]
            record["diag/adam_rms_param"] = self.optimized_names[index[top]]
        if w.get("erased") is not None:
            erased, updated = w["erased"].tolist()
            record["diag/erased_share"] = erased / updated if updated else None
        return record

    def _check_clip(self, applied: float) -> None:
        """Clipping scaled gradients leaves the optimizer a norm of clip / scale."""
        clip, scale = self.view.clip_grad, self.tracker.scale
        if self.view.clip_mode != "norm" or clip <= 0 or scale < 16 or not applied > 0:
            return
        if 0.5 < applied * scale / clip < 1.01:
            self._signature(
                PitfallName.clip_before_unscale,
                (
                    f"the optimizer got gradient norm {applied:.3g} = trainer.clip_grad / loss "
                    f"scale ({clip:g} / {scale:g}): the clip acted on scaled gradients"
                ),
            )

    def _signature(self, name: str, evidence: str) -> None:
        name = PitfallName(name).value  # a plain str key: checkpoints load with weights_only=True
        if name not in self.signatures:
            self.signatures[name] = evidence
            self._warn(f"pitfall signature {name}: {evidence}")

    # -- resume: a checkpoint holds what the history so far says ------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The open window's probes, the scale history, the first non-finite module, reports."""
        return {
            "armed": self.armed,
            "state_checked": self.state_checked,
            "window": self.window,
            # its history; its settings come from the run's config
            "tracker": {
                k: v for k, v in asdict(self.tracker).items() if k not in ("cfg", "dynamic")
            },
            "signatures": self.signatures,
            "warnings": self.warnings,
            "floors": self.floors,
            "reported": sorted(self.reported),
            "first": {phase: f.state_dict() for phase, f in self.probe.first.items()},
            "act_max": self.probe.act_max,
            "act_names": self.probe.act_names,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # written with diagnostics=off: the history starts at the resumed step
            self.tracker.scale = self.view.host_scale()
            return
        self.armed = state["armed"]
        self.state_checked = state["state_checked"]
        self.window = {
            k: v.to(self.device) if torch.is_tensor(v) else v for k, v in state["window"].items()
        }
        for key, value in state["tracker"].items():
            setattr(self.tracker, key, value)
        self.signatures, self.warnings = state["signatures"], state["warnings"]
        self.floors = state.get("floors", {})  # a checkpoint from before the early warnings
        self.reported = set(state["reported"])
        for phase, first in state["first"].items():
            self.probe.first[phase].load_state_dict(first)
        act_max = state["act_max"]
        self.probe.act_max = None if act_max is None else act_max.to(self.device)
        self.probe.act_names = [tuple(n) for n in state["act_names"]]

    def summary(self, first_bad: int | None) -> dict[str, Any]:
        """The first non-finite step and module, scale events, signatures, warnings (a sync)."""
        phases = {p: self.probe.first[p].read() for p in ("forward", "backward")}
        at_first = [v for v in phases.values() if v and v["step"] == first_bad]
        culprit = at_first[0] if at_first else next((v for v in phases.values() if v), None)
        return {
            "mode": self.cfg.mode,
            "nonfinite": {
                "first_step": first_bad,
                "module": culprit and culprit["module"],
                "phase": culprit and ("forward" if culprit is phases["forward"] else "backward"),
                "dtype": culprit and culprit["dtype"],
                "max_abs": culprit and culprit["max_abs"],
                "attributed_step": culprit and culprit["step"],
                **phases,
            },
            "scale_events": self.tracker.events[-200:],  # the last 200 backoffs and growths
            "signatures": dict(self.signatures),
            "warnings": list(self.warnings),
            "fp32_state_ok": PitfallName.half_model not in self.signatures,
            # the pure modes' 16-bit weights since this start; null in other modes
            **since_start(self.probe_model, self.start_weights or []),
            "attn_logit_max": self.attn_logit_peak,  # over the probes of this start
        }


class DiagnosticsOff(StepObserver):
    """diagnostics=off: the monitor's counters and health only."""

    def summary(self, first_bad: int | None) -> dict[str, Any]:
        return {"mode": "off"}


def build_diagnostics(
    cfg: DiagnosticsConfig,
    scaler_cfg: ScalerConfig,
    dynamic: bool,
    log_every: int,
    out_dir: Path | None,
    view: StepView,
) -> StepObserver:
    """The observer for `diagnostics.mode`, watching the step whose view it gets."""
    if cfg.mode == "off":
        return DiagnosticsOff()
    return Diagnostics(cfg, view, scaler_cfg, dynamic, log_every, out_dir)
