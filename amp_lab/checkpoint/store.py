"""Requeue-safe checkpoints: periodic and on a stop signal, written atomically, resumed by default.

A checkpoint (`<run dir>/checkpoints/step_NNNNNNNNN.pt`) holds everything the next optimizer step
depends on: model, optimizer, LR schedule, GradScaler (scale and growth tracker), the loop state
(step, epoch, batch in the epoch: the data order position), the log-window counters, the
diagnostics' history (scale events, signatures, the first non-finite step), the RNG states
(torch, CUDA, Python, NumPy, as plain data) and the W&B run id. Only tensors and plain Python
data go in, so it loads with `torch.load(weights_only=True)`. A run resumes only with the
settings its checkpoint was written with, but for those that leave training unchanged
(`_FREE_TO_CHANGE`): anything else is refused before a file is touched.

A stop signal (SIGUSR2: submitit's pre-timeout/preemption signal; SIGTERM; SIGINT, Ctrl-C) only
sets a flag; the loop saves at the next step boundary and then hands the signal on to the
handler that was there before (submitit's, which requeues the job), so a requeued job resumes
where it stopped. Where that handler is the default (or Python's KeyboardInterrupt), the run
stops with exit code 128 + the signal and one line; a second Ctrl-C stops at once. Under
DDP the ranks agree on a stop at log steps (one all-reduce there, not on every step), so a stop
waits up to trainer.log_every steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amp_lab.components.distributed import DistContext
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.errors import first_sentence

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when the layout of the saved dict changes (2: the diagnostics' state)
CHECKPOINT_DIR = "checkpoints"
WANDB_ID_FILE = "wandb_run_id"  # written by the W&B sink; a resumed run logs to the same W&B run
RECORD_FILES = ("metrics.jsonl", "diagnostics.jsonl")  # cut back to the step a run resumes at
SETTINGS_FILE = "settings.json"  # the run's settings, flat: a finished run's are compared too
_NAME = re.compile(r"^step_(\d+)\.pt$")
# Settings (a group, or one key) that may differ between the interrupted and the resumed run:
# none changes the weights, the optimizer, the scaler, the LR schedule or the data order.
_FREE_TO_CHANGE = {"checkpoint", "logger", "diagnostics", "trainer.progress", "trainer.resume",
                   "trainer.device", "trainer.compile", "trainer.eval_every",
                   "trainer.target_acc", "trainer.max_bad_steps", "trainer.timing_warmup",
                   "data.root", "data.prefetch_factor", "data.pin_memory"}
# (data.num_workers and persistent_workers are not free: the workers seed the augmentation)


class Interrupted(SystemExit):
    """The run stopped on a signal after its checkpoint; the exit code is the signal's."""

    def __init__(self, code: int | str | None, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def rng_state() -> dict[str, Any]:
    """Every global RNG the run draws from, as tensors and plain Python data."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], np.array(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))


def _flat(settings: AmpLabConfig) -> dict[str, str]:
    """`group.key` -> JSON value, to name the settings a resume changes."""
    return {f"{group}.{key}": json.dumps(value, sort_keys=True)
            for group, values in asdict(settings).items() if isinstance(values, dict)
            for key, value in values.items()}


def changed_settings(saved: Mapping[str, str], settings: AmpLabConfig) -> list[str]:
    """`key old -> new` for each setting that differs and may not (see _FREE_TO_CHANGE)."""
    return [f"{k} {saved[k]} -> {v}" for k, v in _flat(settings).items()
            if saved.get(k, v) != v
            and k.split(".")[0] not in _FREE_TO_CHANGE and k not in _FREE_TO_CHANGE]


def _write_atomic(path: Path, write) -> None:
    """Write to a temp file beside `path`, flush it to disk, then swap it in with os.replace."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the old file or the complete new one
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        fd = os.open(path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


class Checkpointer:
    """Saves and restores one run's checkpoints; `parts` maps names to state_dict() holders."""

    def __init__(self, settings: AmpLabConfig, run_dir: Path, state: Any,
                 parts: Mapping[str, Any], dist: DistContext | None = None) -> None:
        self.cfg, self.settings = settings.checkpoint, settings
        # under DDP every rank restores, rank 0 alone writes, and all ranks stop together
        self.dist = dist or DistContext()
        self.device = next((p.device for p in parts.values() if isinstance(p, torch.Tensor)),
                           torch.device("cpu"))
        self.run_dir, self.dir = Path(run_dir), Path(run_dir) / CHECKPOINT_DIR
        self.state, self.parts = state, parts  # state: the runner's LoopState dataclass
        self.stop_signal: int | None = None
        self.saving = False  # a checkpoint is being written
        self.previous: dict[int, Any] = {}  # signal -> the handler that was there before ours
        self.pending_rng: Mapping[str, Any] | None = None
        self.last_save = time.monotonic()

    # -- resume ------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """This run's checkpoint files, newest step first."""
        found = [(int(m.group(1)), p) for p in self.dir.glob("step_*.pt")
                 if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def restore(self) -> bool:
        """Resume from the newest usable checkpoint; cut metrics.jsonl back to where it stands."""
        if not self.settings.trainer.resume:
            if self.dist.is_main:
                self._set_aside()
            return False
        unreadable: dict[str, list[str]] = {}  # reason -> files: one reason told once
        for path in self.checkpoints():
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
                if not (isinstance(payload, dict) and "format" in payload):
                    raise ValueError("not an amp_lab checkpoint")
                if payload["format"] != FORMAT:
                    raise ValueError(f"written by another amp_lab version (format "
                                     f"{payload['format']}; this one reads {FORMAT})")
            except Exception as err:  # noqa: BLE001 - truncated zip, bad pickle, wrong file...
                reason = first_sentence(err)
                log.warning("checkpoint %s is unusable (%s); trying the previous one", path,
                            reason)
                unreadable.setdefault(reason, []).append(path.name)
                continue
            self._load(path, payload)
            if self.dist.is_main:
                log.warning("resumed from %s at step %d", path, self.state.step)
                for bad in self.checkpoints():  # newer than the one used: set aside, not deleted
                    if int(_NAME.match(bad.name).group(1)) > self.state.step:
                        bad.rename(bad.with_name(bad.name + ".corrupt"))
                self._truncate_records(self.state.step)
            return True
        if unreadable:
            reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in unreadable.items())
            raise ConfigError(f"no usable checkpoint in {self.dir} ({reasons}); "
                              "move that folder away or set trainer.resume=false to start fresh")
        if self.dist.is_main and self._truncate_records(0):  # died before its first checkpoint
            log.warning("%s holds an earlier attempt's records but no checkpoint: starting over "
                        "from step 0", self.run_dir)
            self._set_aside(WANDB_ID_FILE)  # a W&B run of its own, not appended to the old one
        return False

    def finished(self) -> dict[str, Any] | None:
        """The summary of a run that already ended here (completed or diverged), else None.
        A finished run with other settings is refused, as a checkpoint with them would be."""
        try:
            summary = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if summary.get("status") not in ("completed", "diverged"):
            return None
        with contextlib.suppress(OSError, json.JSONDecodeError):
            saved = json.loads((self.run_dir / SETTINGS_FILE).read_text())
            if changed := changed_settings(saved, self.settings):
                raise ConfigError(f"{self.run_dir} holds a finished run with other settings: "
                                  f"{', '.join(changed)}; use another run directory, or set "
                                  "trainer.resume=false to train there afresh (the old files "
                                  "are kept)")
        return summary

    def record_settings(self) -> None:
        """settings.json: what this run trains with (rank 0)."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.run_dir / SETTINGS_FILE,
                          lambda f: f.write(json.dumps(_flat(self.settings), indent=1).encode()))

    def _load(self, path: Path, payload: Mapping[str, Any]) -> None:
        changed = changed_settings(payload["settings"], self.settings)
        if changed:
            raise ConfigError(f"checkpoint {path} was written with other settings: "
                              f"{', '.join(changed)}; resume with the settings it was written "
                              "with, or set trainer.resume=false to start fresh (the old files "
                              "are kept)")
        try:
            for name, part in self.parts.items():
                if isinstance(part, torch.Tensor):
                    part.copy_(payload["parts"][name])
                else:
                    part.load_state_dict(payload["parts"][name])
        except (KeyError, RuntimeError, ValueError) as err:
            raise ConfigError(f"checkpoint {path} does not fit this run "
                              f"({str(err).splitlines()[0]}); resume it with the settings it was "
                              "written with, or set trainer.resume=false to start fresh") from err
        names = {f.name for f in fields(self.state)}
        for key, value in payload["loop"].items():
            if key in names:
                setattr(self.state, key, value)
        self.pending_rng = payload["rng"]  # applied when the loop starts (see active())
        if payload["wandb_run_id"]:
            wandb_file = self.run_dir / WANDB_ID_FILE
            if not wandb_file.exists() or wandb_file.read_text().strip() != payload[
                    "wandb_run_id"]:
                wandb_file.write_text(payload["wandb_run_id"] + "\n")

    def _truncate_records(self, step: int) -> bool:
        """Drop records past `step` (and a half-written last line), so nothing is logged twice.
        Returns whether any line was dropped."""
        dropped = False
        for name in RECORD_FILES:
            path = self.run_dir / name
            if not path.exists():
                continue
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            kept = []
            for line in lines:
                with contextlib.suppress(json.JSONDecodeError):
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line + "\n")
            dropped |= len(kept) < len(lines)
            _write_atomic(path, lambda f, kept=kept: f.write("".join(kept).encode()))
        return dropped

    def _set_aside(self, *names: str) -> None:
        """Keep these files of the run dir under a dated name (by default every file of a run:
        trainer.resume=false in a used run dir); without its W&B id, a run gets a new W&B run."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        names = names or (CHECKPOINT_DIR, *RECORD_FILES, "summary.json", SETTINGS_FILE,
                          WANDB_ID_FILE)
        for path in (self.run_dir / name for name in names):
            if path.exists():
                aside = path.with_name(f"{path.stem}.old-{stamp}{path.suffix}")
                n = 1
                while aside.exists():  # set aside twice within a second
                    aside, n = path.with_name(f"{path.stem}.old-{stamp}-{n}{path.suffix}"), n + 1
                path.rename(aside)
                log.warning("kept the previous %s as %s", path.name, aside.name)

    # -- save --------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint for the current step, atomically; then prune beyond `keep`."""
        path = self.dir / f"step_{self.state.step:09d}.pt"
        if not self.dist.is_main:  # every rank holds the same weights: rank 0 writes them
            return path
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.pt.tmp"):  # left by a job killed mid-write
            stale.unlink()
        wandb_file = self.run_dir / WANDB_ID_FILE
        payload = {
            "format": FORMAT,
            "step": self.state.step,
            "loop": asdict(self.state),
            "parts": {name: part if isinstance(part, torch.Tensor) else part.state_dict()
                      for name, part in self.parts.items()},
            "rng": rng_state(),
            "wandb_run_id": wandb_file.read_text().strip() if wandb_file.exists() else None,
            "settings": _flat(self.settings),
        }
        _write_atomic(path, lambda f: torch.save(payload, f))
        for old in self.checkpoints()[self.cfg.keep:]:  # only now that the new one is complete
            old.unlink()
        self.last_save = time.monotonic()
        return path

    def step_done(self, elapsed_s: float, final: bool) -> float:
        """After a step's records: a periodic or a stop checkpoint. Returns the seconds spent."""
        if not self.cfg.enabled or final:  # the run's own end writes its results; no checkpoint
            if final and self.stop_signal is not None:
                log.warning("stop signal at the run's last step: finishing instead")
            return 0.0
        step, every = self.state.step, self.cfg.every_steps
        due = (every and step % every == 0) or (
            self.cfg.every_minutes and time.monotonic() - self.last_save
            >= 60 * self.cfg.every_minutes)
        stop = self.stop_signal is not None
        if self.dist.active:  # the ranks agree at log steps, all stopping at the same step
            stop = step % self.settings.trainer.log_every == 0 and self.dist.any(stop,
                                                                                 self.device)
            if stop:
                self.stop_signal = self.stop_signal or signal.SIGUSR2  # a peer was signalled
        if not stop and not due:
            return 0.0
        start = time.perf_counter()
        self.state.elapsed_s = elapsed_s
        self.saving = True
        try:
            path = self.save()
        finally:
            self.saving = False
        if stop:
            self._hand_on(self.stop_signal, path)
        return time.perf_counter() - start

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.stop_signal == signal.SIGINT:  # a second Ctrl-C: a hung step must not hold
                if self.saving:  # but a checkpoint half-written would be lost: finish it
                    return
                raise KeyboardInterrupt
            if self.dist.is_main:
                print("Ctrl-C: stopping after this step's checkpoint (Ctrl-C again: at once)",
                      file=sys.stderr)
        self.stop_signal = signum  # nothing else here: the loop acts at the next step boundary

    def _hand_on(self, signum: int, path: Path) -> None:
        """Give the signal to the handler that was there before ours (submitit requeues).

        When that handler returns: after SIGTERM the run stops (termination follows: submitit
        ignores SIGTERM, which SLURM sends before it kills a job it preempts, times out or
        requeues); after another signal training goes on (submitit's SIGUSR2 handler returns
        on ranks other than 0 and leaves the requeue to rank 0).
        """
        self.stop_signal = None
        name = signal.Signals(signum).name
        message = f"{name} at step {self.state.step}: checkpoint {path} saved"
        say = log.warning if self.dist.is_main else log.debug  # once per job, not per rank
        previous = self.previous.get(signum, signal.SIG_DFL)
        if previous is signal.default_int_handler:  # Ctrl-C: a clean stop, not a traceback
            previous = signal.SIG_DFL
        if callable(previous):
            say("%s; handing the signal on", message)
            try:
                previous(signum, None)
            except SystemExit as exit_:  # submitit requeued the job and exits
                raise Interrupted(exit_.code, f"{message}; handed on (requeue)") from exit_
            if signum == signal.SIGTERM:
                say("%s; the previous handler returned; stopping", message)
                raise Interrupted(128 + signum, f"{message}; handed on, stopping")
            say("the previous %s handler returned; training goes on", name)
        else:  # SIG_DFL (or a handler set outside Python): the default action ends the process
            say("%s; stopping", message)
            raise Interrupted(128 + signum, f"{message}; stopping")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around the loop: restore the RNG states, and catch stop signals while it runs."""
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)  # last, so nothing after it draws from the RNGs
            self.pending_rng = None
        main = threading.current_thread() is threading.main_thread()  # handlers: main only
        signums = [getattr(signal, n) for n in self.cfg.signals] if self.cfg.enabled and main \
            else []
        # a signal ignored before (nohup, a background job) stays ignored
        signums = [s for s in signums if signal.getsignal(s) is not signal.SIG_IGN]
        for signum in signums:
            self.previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        try:
            yield
        finally:
            for signum in signums:
                previous = self.previous.pop(signum)
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
