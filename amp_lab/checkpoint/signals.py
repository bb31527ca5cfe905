"""Stop signals: caught while the loop runs, acted on at a step boundary, then handed on.

A stop signal (SIGUSR2: submitit's pre-timeout/preemption signal; SIGUSR1: an sbatch script's
`--signal=USR1@90`; SIGTERM; SIGINT, Ctrl-C) only sets a flag; the loop saves a checkpoint at the
next step boundary and then hands the signal on to the handler that was there before (submitit's
requeues the job). With the default handler the run stops with exit code 128 + the signal; a
second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Interrupted(SystemExit):
    """The run stopped on a signal, after its checkpoint or at its end; exit code: the signal's."""

    def __init__(self, code: int | str | None, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """The configured stop signals of one run (handlers: main thread only)."""

    def __init__(self, names: list[str], is_main: bool = True) -> None:
        self.names, self.is_main = list(names), is_main  # is_main: rank 0 speaks for the job
        self.stop_signal: int | None = None  # the signal the loop has yet to act on
        self.saving = False  # a checkpoint is being written
        self.previous: dict[int, Any] = {}  # signal -> the handler that was there before ours
        self.before_hand_on: Callable[[], None] = lambda: None  # the run's sinks' flush

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.stop_signal == signal.SIGINT:  # a second Ctrl-C: a hung step must not hold
                if self.saving:  # but a checkpoint half-written would be lost: finish it
                    return
                raise KeyboardInterrupt
            if self.is_main:
                print(
                    "Ctrl-C: stopping after this step's checkpoint (Ctrl-C again: at once)",
                    file=sys.stderr,
                )
        self.stop_signal = signum  # nothing else here: the loop acts at the next step boundary

    def hand_on(self, signum: int, step: int, path: Path) -> None:
        """Give the signal to the handler that was there before ours (submitit requeues). When
        that handler returns, the run stops after SIGTERM (submitit ignores it; SLURM's kill
        follows) and goes on after another (submitit's SIGUSR2 handler returns on ranks but 0)."""
        self.stop_signal = None
        name = signal.Signals(signum).name
        message = f"{name} at step {step}: checkpoint {path} saved"
        say = log.warning if self.is_main else log.debug  # once per job, not per rank
        previous = self.previous.get(signum, signal.SIG_DFL)
        if previous is signal.default_int_handler:  # Ctrl-C: a clean stop, not a traceback
            previous = signal.SIG_DFL
        if callable(previous):
            say("%s; handing the signal on", message)
            self.before_hand_on()  # submitit's requeue has SLURM end W&B's service at once
            try:
                previous(signum, None)
            except SystemExit as exit_:  # submitit requeued the job and exits
                raise Interrupted(exit_.code, f"{message}; handed on (requeue)") from exit_
            if signum == signal.SIGTERM:
                say("%s; the previous handler returned; stopping", message)
                raise Interrupted(128 + signum, f"{message}; handed on, stopping")
            say("the previous %s handler returned; training goes on", name)
        else:  # SIG_DFL (or a handler set outside Python): the default action ends the process
            run_dir = path.parent.parent  # <run dir>/checkpoints/step_N
            say(
                "%s; stopping (to resume: the same command with hydra.run.dir=%s, or for a "
                "sweep hydra.sweep.dir=%s)",
                message,
                run_dir,
                run_dir.parent,
            )
            raise Interrupted(128 + signum, f"{message}; stopping")

    def after_run(self, step: int) -> None:
        """The run ended (finished, pruned, failed) with a stop signal pending: SIGINT and SIGTERM
        stop the process now, its results written; another (a pre-timeout warning) is dropped."""
        signum, self.stop_signal = self.stop_signal, None
        if signum in (signal.SIGINT, signal.SIGTERM):
            name = signal.Signals(signum).name
            raise Interrupted(128 + signum, f"{name} at step {step}, as the run ended; stopping")

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        """Our handler on each signal while the block runs; the previous ones back after it."""
        main = threading.current_thread() is threading.main_thread()
        signums = [getattr(signal, n) for n in self.names] if main else []
        # a signal ignored before (nohup, a background job) stays ignored
        signums = [s for s in signums if signal.getsignal(s) is not signal.SIG_IGN]
        for signum in signums:
            self.previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self.on_signal)
        try:
            yield
        finally:
            for signum in signums:
                previous = self.previous.pop(signum)
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
