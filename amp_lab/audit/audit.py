"""The precision audit of a run: watch its first step, record what ran, judge it, act on it.

The trainer wraps each step in `audit.around(step)`; the first one of this start of the run (the
first after a resume too) is watched (observe.py); under audit=stop what the step cannot change
(weight, master and optimizer-state dtypes) is judged just before it, so a model cast behind the
run's back stops in one line rather than in torch's traceback. The run's parts are read after it
(record.py) and judged against the mode's promise (promises.py). The result goes to
precision_audit.json, its headline to the log and summary.json. A broken promise stops the run
with `BrokenPromise` (audit.mode=stop: one line, exit code 2) or warns (audit.mode=warn, or a
pitfall run, which breaks its promise on purpose). Every later step gets a null context.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from timm.utils import ModelEmaV3
from torch.amp import GradScaler

from amp_lab.audit import coverage, promises, record
from amp_lab.audit.observe import StepSeen, StepWatch
from amp_lab.audit.promises import FULL_PRECISION, Expected
from amp_lab.checkpoint.run_dir import write_bytes_atomic
from amp_lab.choices import AuditMode, PitfallName
from amp_lab.components.fsdp import FsdpPlan
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.precision.fp32_modules import matching_modules
from amp_lab.precision.modes import PrecisionPolicy
from amp_lab.precision.scaling import uses_dynamic_scaling
from amp_lab.records import AUDIT_FILE
from amp_lab.step import TrainStep

log = logging.getLogger(__name__)


class BrokenPromise(ConfigError):
    """The run's first step broke its precision's promise: one line, exit code 2."""


def expected(
    settings: AmpLabConfig,
    policy: PrecisionPolicy,
    model: torch.nn.Module,
    fsdp: FsdpPlan | None,
) -> Expected:
    """What the run's settings promise of its step."""
    mode = policy.mode
    promise = policy.promise(
        settings.optim.state_dtype, uses_dynamic_scaling(settings.scaler, policy)
    )
    ema = settings.trainer.ema
    return Expected(
        mode=mode.name,
        promise=promise,
        matmul=mode.matmul_dtype,
        fp32_compute="tf32" if mode.tf32 else "fp32",
        fp32_modules=matching_modules(model, settings.precision.fp32_modules),
        ema=None if ema.decay == 0 else "fp32" if ema.fp32 else promise.params,
        fsdp=None
        if fsdp is None
        else {k: str(v) for k, v in fsdp.describe().items() if k.endswith("_dtype")},
    )


def _modules(seen: StepSeen) -> dict[str, dict[str, Any]]:
    """Per module: what its forward saw, and its GEMM FLOPs (forward and backward) per dtype."""
    modules = {name: {**asdict(m), "gemm_flops": {}} for name, m in seen.modules.items()}
    for (name, dtype), flops in seen.gemm_flops.items():
        modules.setdefault(name, {"gemm_flops": {}})["gemm_flops"][dtype] = flops
    return modules


def _more(lines: list[str]) -> str:
    """After the first broken promise: how many more, and how to train on regardless."""
    more = f" (and {len(lines) - 1} more: {AUDIT_FILE})" if len(lines) > 1 else ""
    return f"{more}; audit=warn trains on regardless"


@dataclass(eq=False)
class PrecisionAudit:
    """Watches the first step `around()` is given, then steps aside."""

    settings: AmpLabConfig
    expect: Expected
    model: torch.nn.Module
    train_step: TrainStep
    scaler: GradScaler
    ema: ModelEmaV3 | None
    out_dir: Path | None  # None: this rank writes nothing
    result: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.pending = self.settings.audit.mode != AuditMode.off

    def around(self, step: int) -> contextlib.AbstractContextManager:
        """The context the loop runs optimizer step `step` (1-based) in: the audit for the first
        one, nothing after it."""
        if not self.pending:
            return contextlib.nullcontext()
        self.pending = False
        return self._audited(step)

    @contextlib.contextmanager
    def _audited(self, step: int) -> Iterator[None]:
        if self.settings.audit.mode == AuditMode.stop and not self._on_purpose():
            held = self.judge_held(step)  # what the step cannot change, before torch's traceback
            if not held["kept"]:
                self._record(held)
        watch = StepWatch(self.train_step, self.model, self.scaler)
        with watch.watching() as seen:
            yield
        self._record(self.judge(seen, step))

    def _record(self, result: dict[str, Any]) -> None:
        self.result = result
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            text = json.dumps(self.result, indent=2)
            write_bytes_atomic(self.out_dir / AUDIT_FILE, text.encode())
        self._act(self.result)

    def judge_held(self, step: int) -> dict[str, Any]:
        """The audit of what the run holds before step `step` runs: weights, master weights and
        optimizer state (once there is some) in their promised dtypes."""
        facts = {
            "params": record.parameters(self.model, {}),
            "optimizer": record.optimizer(self.train_step.optimizer, self.model),
        }
        broken = promises.held_breaches(facts, self.expect)
        return {
            **self._verdict(step, broken),
            "before_step": True,
            "headline": "judged before the first step",
            "coverage": {"share": {}},
            **facts,
        }

    def _verdict(self, step: int, broken: list[promises.Breach]) -> dict[str, Any]:
        exp = self.expect
        return {
            "step": step,
            "resumed": step > 1,
            "precision": exp.mode,
            "promise": exp.promise.describe(),
            "fp32_modules": exp.fp32_modules,
            "kept": not broken,
            "breaches": [b._asdict() for b in broken],
        }

    def judge(self, seen: StepSeen, step: int) -> dict[str, Any]:
        """The audit of a watched step: the facts, the coverage and the broken promises."""
        s, exp = self.settings, self.expect
        facts: dict[str, Any] = {
            "params": record.parameters(self.model, seen.grads),
            "optimizer": record.optimizer(self.train_step.optimizer, self.model),
            "loss": {"dtype": seen.loss_dtype},
            "scaler": record.scaler(self.scaler, seen.scale, seen.events),
            "tf32": record.tf32(),
            "fp8": record.fp8_layers(self.model, exp.fp32_modules) if exp.mode == "fp8" else None,
            "fsdp": record.fsdp_units(self.model, seen.modules) if exp.fsdp else None,
            "ema": record.ema(self.ema.module if self.ema else None),
            "compile": record.compiled(
                self.train_step.model, str(s.trainer.compile), s.trainer.compile_backend
            ),
        }
        cover = coverage.coverage(seen.gemm_flops, exp, facts["fp8"])
        broken = promises.breaches(seen.gemm_flops, facts, exp)
        return {
            **self._verdict(step, broken),
            "headline": cover.pop("headline"),
            "coverage": cover,
            "modules": _modules(seen),
            **facts,
        }

    def summary(self) -> dict[str, Any] | None:
        """What summary.json (and so W&B's run summary) keeps of the audit."""
        if self.result is None:
            return None
        r = self.result
        return {
            "headline": r["headline"],
            "kept": r["kept"],
            "breaches": [b["line"] for b in r["breaches"]],
            "step": r["step"],
            "low_precision_share": sum(
                share
                for dtype, share in r["coverage"]["share"].items()
                if dtype not in FULL_PRECISION
            ),
        }

    def _on_purpose(self) -> bool:
        """A pitfall run breaks its promise on purpose: it is audited, and warns."""
        return self.settings.pitfall.name != PitfallName.none

    def _act(self, result: dict[str, Any]) -> None:
        """Log the headline, or each broken promise; or stop the run at the first."""
        lines = [b["line"] for b in result["breaches"]]
        if not lines:
            log.info("precision audit: %s", result["headline"])
            return
        if self.settings.audit.mode == AuditMode.stop and not self._on_purpose():
            when = ", before the first step" if result.get("before_step") else ""
            raise BrokenPromise(f"precision audit{when}: {lines[0]}{_more(lines)}")
        for line in lines:
            log.warning("precision audit: %s", line)
