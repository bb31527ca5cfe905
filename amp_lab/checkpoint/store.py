"""Checkpoint files: written atomically, loaded with weights_only=True, the newest N kept.

A checkpoint (`<run dir>/checkpoints/step_NNNNNNNNN.pt`, README "Checkpoints") holds the parts'
state dicts, the loop state, the RNG states and the W&B run id. A run resumes only with the
settings it was written with (but for those free on resume) and on the same world size; an
unreadable newest checkpoint is set aside (`.corrupt`) and the previous one used. FSDP2
checkpoints are folders (sharded.py).
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from amp_lab.checkpoint import sharded
from amp_lab.checkpoint.run_dir import RunDir, write_atomic
from amp_lab.checkpoint.signals import StopSignals
from amp_lab.components.distributed import DistContext
from amp_lab.config import AmpLabConfig, ConfigError, changed_settings, flat_settings
from amp_lab.errors import first_sentence
from amp_lab.records import CHECKPOINT_DIR, WANDB_ID_FILE

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when the layout of the saved dict changes (2: the diagnostics' state)
_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")  # a file, or a sharded folder


def rng_state() -> dict[str, Any]:
    """Every global RNG the run draws from, as tensors and plain Python data."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)  # the tuple form: (name, keys, pos, ...)
    name, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], numpy_state)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    keys = np.array(npy["keys"], dtype=np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))


class Checkpointer:
    """Saves and restores one run's checkpoints; `parts` maps names to state_dict() holders."""

    def __init__(
        self,
        settings: AmpLabConfig,
        run_dir: Path,
        state: Any,
        parts: Mapping[str, Any],
        dist: DistContext | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.cfg, self.settings = settings.checkpoint, settings
        # under DDP every rank restores, rank 0 alone writes, and all ranks stop together
        self.dist = dist or DistContext()
        # the run's device: the ranks' stop flag is reduced there (NCCL reduces no CPU tensor)
        self.device = device or torch.device("cpu")
        self.records, self.dir = RunDir(run_dir), Path(run_dir) / CHECKPOINT_DIR
        self.state, self.parts = state, parts  # state: the runner's LoopState dataclass
        self.signals = StopSignals(self.cfg.signals if self.cfg.enabled else [], self.dist.is_main)
        # FSDP2: every rank writes its shards through DCP (sharded.py)
        self.sharded = "model" in parts and sharded.is_sharded(parts["model"])
        self.pending_rng: Mapping[str, Any] | None = None
        self.last_save = time.monotonic()

    # -- resume ------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """This run's checkpoint files, newest step first."""
        found = [
            (int(m.group(1)), p) for p in self.dir.glob("step_*") if (m := _NAME.match(p.name))
        ]
        return [p for _, p in sorted(found, reverse=True)]

    def record_settings(self) -> None:
        """settings.json: what this run trains with (rank 0)."""
        if self.dist.is_main:
            self.records.write_settings(self.settings)

    def restore(self) -> bool:
        """Resume from the newest usable checkpoint; cut metrics.jsonl back to where it stands."""
        if not self.settings.trainer.resume:
            if self.dist.is_main:
                self.records.set_aside()
            return False
        unreadable: dict[str, list[str]] = {}  # reason -> files: one reason told once
        found = self.checkpoints()
        for tried, path in enumerate(found):
            try:
                payload = sharded.read_state(path) if path.is_dir() else read_checkpoint(path)
            except Exception as err:  # noqa: BLE001 - truncated zip, bad pickle, wrong file...
                reason = first_sentence(err)
                log.warning("checkpoint %s is unusable (%s); trying the previous one", path, reason)
                unreadable.setdefault(reason, []).append(path.name)
                continue
            self._load(path, payload)
            if self.dist.is_main:
                log.warning("resumed from %s at step %d", path, self.state.step)
                for bad in found[:tried]:  # newer than the one used: set aside, not deleted
                    bad.rename(bad.with_name(bad.name + ".corrupt"))
                self.records.truncate_records(self.state.step)
            return True
        if unreadable:
            reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in unreadable.items())
            raise ConfigError(
                f"no usable checkpoint in {self.dir} ({reasons}); "
                "move that folder away or set trainer.resume=false to start fresh"
            )
        if self.dist.is_main and self.records.truncate_records(0):  # died before a checkpoint
            log.warning(
                "%s holds an earlier attempt's records but no checkpoint: starting over "
                "from step 0",
                self.records.path,
            )
            self.records.set_aside(WANDB_ID_FILE)  # a W&B run of its own, not appended
        return False

    def _load(self, path: Path, payload: Mapping[str, Any]) -> None:
        written_on = payload.get("world_size", self.dist.world_size)  # absent before sharding
        if written_on != self.dist.world_size:  # global batch, LR and data slices depend on it
            raise _refused(
                path,
                f"was written by {written_on} rank(s), this run has {self.dist.world_size}",
                f"resume it on {written_on}",
            )
        changed = changed_settings(payload["settings"], self.settings)
        if changed:
            raise ConfigError(
                f"checkpoint {path} was written with other settings: "
                f"{', '.join(changed)}; resume with the settings it was written "
                "with, or set trainer.resume=false to start fresh (the old files "
                "are kept)"
            )
        in_shards = set(payload.get("sharded", []))
        if in_shards and not self.sharded:
            raise _refused(
                path,
                "holds FSDP shards and this run is not sharded",
                "resume it with trainer.strategy=fsdp",
            )
        try:
            if in_shards:  # a collective: every rank reads its slices
                sharded.load(path, self.parts)
            for name, part in self.parts.items():
                if name in in_shards:
                    continue
                if name not in payload["parts"] and getattr(part, "optional_in_checkpoint", False):
                    continue  # a part an older checkpoint did not hold starts afresh
                part.load_state_dict(payload["parts"][name])
        except (KeyError, RuntimeError, ValueError, CheckpointException) as err:
            raise _refused(
                path,
                f"does not fit this run ({str(err).splitlines()[0]})",
                "resume it with the settings it was written with",
            ) from err
        names = {f.name for f in fields(self.state)}
        for key, value in payload["loop"].items():
            if key in names:
                setattr(self.state, key, value)
        # applied when the loop starts (see active()); a sharded checkpoint holds each rank's
        own = sharded.read_rng(path, self.dist.rank) if in_shards else None
        self.pending_rng = own or payload["rng"]
        if payload["wandb_run_id"]:
            self.records.keep_wandb_id(payload["wandb_run_id"])

    # -- save --------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint for the current step, atomically; then prune beyond `keep`."""
        path = self.dir / f"step_{self.state.step:09d}.{'dcp' if self.sharded else 'pt'}"
        main = self.dist.is_main
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
        if self.sharded:  # FSDP2: every rank writes its shards, rank 0 the rest (sharded.py)
            shards = sharded.sharded_parts(self.parts)
            sharded.save(path, shards, rng_state(), self._payload(set(shards)) if main else None)
        elif main:  # every rank holds the same weights: rank 0 writes them
            for stale in self.dir.glob("*.pt.tmp"):  # left by a job killed mid-write
                stale.unlink()
            payload = self._payload(set())
            write_atomic(path, lambda f: torch.save(payload, f))
        if main:  # only now that the new one is complete
            for old in self.checkpoints()[self.cfg.keep :]:
                sharded.remove(old)
        self.last_save = time.monotonic()
        return path

    def _payload(self, in_shards: set[str]) -> dict[str, Any]:
        """Rank 0's checkpoint dict; the parts named in `in_shards` are left to DCP."""
        return {
            "format": FORMAT,
            "step": self.state.step,
            "loop": asdict(self.state),
            "parts": {
                name: part.state_dict()
                for name, part in self.parts.items()
                if name not in in_shards
            },
            "sharded": sorted(in_shards),
            "world_size": self.dist.world_size,
            "rng": rng_state(),
            "wandb_run_id": self.records.wandb_id(),
            "settings": flat_settings(self.settings),
        }

    def step_done(self, elapsed_s: float, final: bool) -> float:
        """After a step's records: a periodic or a stop checkpoint. Returns the seconds spent."""
        signals = self.signals
        if not self.cfg.enabled or final:  # the run's own end writes its results; no checkpoint
            if final and signals.stop_signal is not None:
                log.warning("stop signal at the run's last step: finishing the run first")
            return 0.0
        step, every = self.state.step, self.cfg.every_steps
        due = (every and step % every == 0) or (
            self.cfg.every_minutes
            and time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes
        )
        stop = signals.stop_signal is not None
        if self.dist.active:  # the ranks agree at log steps, all stopping at the same step
            log_step = step % self.settings.trainer.log_every == 0
            if self.sharded:  # every rank writes shards: a timed one is due when on rank 0
                rank0_due = bool(due) and self.dist.is_main
                timed = bool(self.cfg.every_minutes and log_step) and self.dist.any(
                    rank0_due, self.device
                )
                due = bool(every and step % every == 0) or timed
            stop = log_step and self.dist.any(stop, self.device)
            if stop:  # a peer was signalled
                signals.stop_signal = signals.stop_signal or signal.SIGUSR2
        if not stop and not due:
            return 0.0
        start = time.perf_counter()
        self.state.elapsed_s = elapsed_s
        signals.saving = True
        try:
            path = self.save()
        finally:
            signals.saving = False
        if stop and signals.stop_signal is not None:
            signals.hand_on(signals.stop_signal, step, path)
        return time.perf_counter() - start

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around the loop: restore the RNG states, and catch stop signals while it runs."""
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)  # last, so nothing after it draws from the RNGs
            self.pending_rng = None
        with self.signals.caught():
            yield


def _refused(path: Path, why: str, fix: str) -> ConfigError:
    """A checkpoint this run cannot resume from, in one line: what is wrong, what to do."""
    return ConfigError(
        f"checkpoint {path} {why}; {fix}, or set trainer.resume=false to start fresh"
    )


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's payload, loaded with weights_only=True; ValueError if it is not one this
    amp_lab version reads."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(payload, dict) and "format" in payload):
        raise ValueError("not an amp_lab checkpoint")
    if payload["format"] != FORMAT:
        raise ValueError(
            f"written by another amp_lab version (format {payload['format']}; "
            f"this one reads {FORMAT})"
        )
    return payload
