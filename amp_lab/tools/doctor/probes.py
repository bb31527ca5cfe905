"""The doctor's probes, short in-process runs of the user's config with the same seed and data
order, and the greedy search for modules to keep in fp32."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from amp_lab.choices import Strategy
from amp_lab.compose import compose_settings
from amp_lab.config import ConfigError
from amp_lab.records import METRICS_FILE
from amp_lab.tools import probe as launch
from amp_lab.tools.doctor import mechanism
from amp_lab.tools.doctor.verdict import Probe


def key(override: str) -> str:
    """The config key an override sets (`+a.b=1` -> `a.b`)."""
    return override.lstrip("+~").split("=", 1)[0]


FP32 = ["precision=fp32", "pitfall=none", "scaler.enabled=false"]  # the baseline probe's
# what every probe sets besides its length (quiet and afresh as every tool's run: probe.py)
PROBE_SETTINGS = [
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "diagnostics=full",
    "diagnostics.every=1",
    "trainer.strategy=single",  # the probes are short runs on one process
]
# keys the doctor sets itself; the user's values for them are replaced per probe
PROBE_KEYS = {
    *map(key, [*PROBE_SETTINGS, *launch.QUIET]),
    *("precision", "scaler.enabled", "trainer.max_steps", "diagnostics.mode", "logger"),
    "hydra.run.dir",
}
log = logging.getLogger("amp_lab.tools.doctor")
SEARCH_ROUNDS = 6  # the fp32 search adds at most this many modules
# the fp32 baseline per composed config (its JSON): deterministic, so run once per process
BASELINES: dict[str, Probe] = {}


class Doctor:
    """Runs the probes of one user config and collects what they saw."""

    def __init__(self, overrides: list[str], steps: int, out: Path) -> None:
        self.user, self.out = overrides, out
        self.settings = compose_settings(overrides)  # bad overrides fail here, before any run
        self.health = self.settings.health  # the judge's thresholds, the user's own
        import torch  # torch and timm load only after the config parsed

        from amp_lab.precision.scaling import uses_dynamic_scaling

        kept = [o for o in overrides if key(o) not in PROBE_KEYS]
        self.common = [*kept, f"trainer.max_steps={steps}", *PROBE_SETTINGS]
        if self.settings.trainer.strategy == "fsdp":  # its policy is checked, its probes not
            from amp_lab.components.fsdp import resolve_plan

            resolve_plan(self.settings)
            log.info("trainer.strategy=fsdp: the doctor's probes run on one process, unsharded")
        # the user's config builds on this machine (in a folder no run of theirs writes to)
        single = replace(self.settings.trainer, strategy=Strategy.single)
        config_check = replace(self.settings, trainer=single)
        with launch.built(config_check, out / "probes" / "config_check") as checked:
            policy = checked.policy
            uses_scaler = checked.train_step.uses_scaler
        # the probes' autocast dtype: the user's (bf16_pure and fp8 compute in bf16)
        mode = policy.mode
        self.low = "bf16" if mode.autocast_dtype == torch.bfloat16 else "fp16"
        self.scaled = [f"precision={self.low}", "scaler.enabled=true"]  # autocast+scaler's
        # what the user runs, a fix is verified on (for an fp32 config: autocast+scaler's)
        own = [o for o in overrides if key(o) in ("precision", "scaler.enabled")]
        self.own = own if mode.autocast_dtype is not None else self.scaled
        scaled = uses_dynamic_scaling(self.settings.scaler, policy)
        self.user_scaled = mode.autocast_dtype is None or scaled
        # every probe of the fp32 search, per (base overrides, module set): deterministic
        self.fp32_runs: dict[tuple[tuple[str, ...], tuple[str, ...]], Probe] = {}
        # the user's step runs a dynamic scaler (pitfall=half_model's drops it): probed actively
        self.checks_scaler = mode.autocast_dtype is not None and self.user_scaled and uses_scaler

    def plan(self) -> list[tuple[str, list[str]]]:
        plan = [
            ("fp32", FP32),
            ("autocast", [f"precision={self.low}", "scaler.enabled=false"]),
            ("autocast+scaler", self.scaled),
        ]
        if self.low != "bf16":
            plan.append(("bf16", ["precision=bf16", "scaler.enabled=false"]))
        if self.checks_scaler:
            plan.append((mechanism.NAME, mechanism.overrides(self.own)))
        return plan

    def run_probe(self, name: str, extra: list[str]) -> Probe:
        """A short in-process run; its files go to <out>/probes/<name>."""
        replaced = {key(e) for e in extra}
        probe = Probe(name, [*(o for o in self.common if key(o) not in replaced), *extra])
        settings = launch.settings(probe.overrides)
        config = json.dumps(asdict(settings), sort_keys=True, default=str) if name == "fp32" else ""
        if config in BASELINES:
            log.info("probe fp32: the baseline of this config, already run in this process")
            return replace(BASELINES[config], overrides=probe.overrides)
        try:
            run = launch.build_run(settings, self.out / "probes" / name)
        except ConfigError as err:
            if name != "bf16":
                raise
            # bf16 only where the device has it, and with what the user's config does
            probe.unavailable = str(err)
            return probe
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # the probe's own progress, table
                probe.summary = launch.train(run)
        except Exception as err:  # noqa: BLE001 - a probe that crashes is a finding, not the end
            probe.crashed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if name == "fp32":
                raise ConfigError(
                    f"the fp32 baseline crashed ({probe.crashed}); fix that first: "
                    f"python -m amp_lab {' '.join(self.user)} precision=fp32 "
                    "shows the traceback"
                ) from err
            log.warning("probe %s crashed: %s", name, probe.crashed)
            return probe
        rows = (run.out_dir / METRICS_FILE).read_text().splitlines()
        probe.records = [r for r in map(json.loads, rows) if r["kind"] == "train"]
        probe.losses = [r["train/loss"] for r in probe.records]
        if config:
            BASELINES[config] = probe
        log.info("probe %s: %s", name, " ".join(extra))
        return probe

    def search_fp32(
        self,
        start: list[str],
        scaled: Probe,
        base: list[str] | None = None,
        name: str = "search",
        deadline: float = math.inf,
    ) -> dict[str, Any]:
        """Greedy: add the module the forward attribution names until a probe runs clean (`scaled`:
        `base`'s run with `start`); no set runs twice, none past `deadline` (then `stopped`)."""
        extra = tuple(base or self.scaled)
        self.fp32_runs.setdefault((extra, tuple(start)), scaled)
        chosen = list(start)
        tried: list[dict[str, Any]] = []
        ran = 0

        def clean(modules: list[str]) -> bool | None:
            nonlocal ran
            at = (extra, tuple(modules))
            if at not in self.fp32_runs:
                if time.monotonic() > deadline:
                    return None
                ran += 1
                self.fp32_runs[at] = self.run_probe(
                    f"{name}_{ran}", [*extra, f"precision.fp32_modules=[{','.join(modules)}]"]
                )
            probe = self.fp32_runs[at]
            ok = not (probe.forward or probe.crashed or probe.summary.get("diverged"))
            if not tried or tried[-1]["fp32_modules"] != list(modules):
                tried.append(
                    {
                        "fp32_modules": list(modules),
                        "clean": ok,
                        "forward_nonfinite": probe.forward,
                        "crashed": probe.crashed,
                    }
                )
            return ok

        for _ in range(SEARCH_ROUNDS):  # until clean, stopped, or no module left to add
            ok = clean(chosen)
            culprit = tried[-1]["forward_nonfinite"] if ok is False else None
            if culprit is None or culprit["module"] in chosen:
                break
            chosen.append(culprit["module"])
        if ok:
            for module in [m for m in chosen if m not in start] if len(chosen) > 1 else []:
                smaller = [m for m in chosen if m != module]
                if clean(smaller):  # drop modules the others already cover (None: not run)
                    chosen = smaller
            ok = clean(chosen)  # the final set, run with every module of it
        return {
            "found": bool(ok),
            "verified": bool(ok),
            "fp32_modules": chosen,
            "tried": tried,
            "probe_runs": ran,
            "stopped": "over the budget" if ok is None else None,
        }


def command(user: list[str], override: str) -> str:
    """One runnable line: the user's overrides with the recommended ones in their place."""
    new = override.split()
    kept = [o for o in user if key(o) not in {key(n) for n in new}]
    return " ".join(["python -m amp_lab", *kept, *new])
