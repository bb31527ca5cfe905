"""W&B in its own process: the training process hands records over a socket and runs no W&B code.

W&B's client encodes every record in Python (0.5-0.6 ms of CPU for a train record on this
project's CPU) on threads that, in the training process, would share its GIL: the training
thread, which gives the GIL up in every op, could wait for them on its way back. Here the
training thread pickles the record onto a socket (~0.17 ms on that CPU, once per log step) and a
child process, started with the run and owning `wandb.init`, `log`, the summary and `finish`,
does the rest.

What an in-process sink would promise holds here too: records reach W&B in the order they were
logged, the summary and the end of the run wait for every record before them, and W&B never stops
training. If the child dies or stops answering, that is one warning, W&B stops, metrics.jsonl and
summary.json go on. The child ignores SIGINT and SIGTERM: the run's own signal handling decides
when it stops (a Ctrl-C or a SLURM requeue still finishes the W&B run from the training process).
If the training process dies without closing, the child sees the socket close and finishes the
W&B run with the crashed summary.json.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from amp_lab.config import AmpLabConfig
from amp_lab.tracking.sinks import Record, Sink
from amp_lab.tracking.wandb_sink import WandbSink, init_timeout, redact, resolve_mode

log = logging.getLogger(__name__)

FINISH_TIMEOUT_S = 300.0  # W&B's finish waits for its service to write every record to disk
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds amp_lab/


class WandbProcessSink(Sink):
    """The training process's side: forwards every call to a WandbSink in a child process."""

    def __init__(self, settings: AmpLabConfig, out_dir: Path, mode: str) -> None:
        self.settings, self.out_dir, self.mode = settings, Path(out_dir), mode
        self.conn: Connection | None = None
        self.readable = select.poll()  # one poll object: Connection.poll builds a selector a call
        self.process: subprocess.Popen[bytes] | None = None
        self.described: Record = {"wandb_requested": mode, "wandb_mode": mode}
        self.failed = ""  # why the child stopped, once it has

    # -- the Sink interface --------------------------------------------------------------------
    def start(self, info: Record) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the child imports this very package, installed or not
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,  # W&B must never prompt
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.readable.register(self.conn.fileno(), select.POLLIN)
        # init may time out, fall back to offline and init again: two time-outs and some slack
        reply = self._call(
            ("start", (self.settings, self.out_dir, self.mode, info)),
            timeout=2 * init_timeout() + 60,
        )
        if reply is not None:
            self.described = reply

    def describe(self) -> Record:
        """The child's answer to start (the mode used and why), and why W&B stopped, if it did."""
        return {**self.described, "wandb_stopped": self.failed or None}

    def log(self, record: Record) -> None:
        if self.conn is None:
            return
        self._send(("log", record))  # WandbSink.log leaves out the record's kind
        if self.readable.poll(0):  # a warning the child sent meanwhile (or its end), at no wait
            self._relay(timeout=0)

    def finish(self, summary: Record) -> None:
        self._call(("finish", summary), timeout=FINISH_TIMEOUT_S)

    def close(self) -> None:
        self._call(("close", None), timeout=FINISH_TIMEOUT_S)
        self._stop()

    # -- the socket ------------------------------------------------------------------------------
    def _send(self, message: tuple[str, Any]) -> bool:
        if self.conn is None:
            return False
        try:
            self.conn.send(message)
            return True
        except OSError:  # the child has gone
            self._fail(f"W&B process ended (exit code {self._exit_code()})")
            return False

    def _call(self, message: tuple[str, Any], timeout: float) -> Any:
        """Send, then relay the child's warnings until it answers; None if it never does."""
        if not self._send(message):
            return None
        return self._relay(timeout=timeout, until=message[0])

    def _relay(self, timeout: float, until: str | None = None) -> Any:
        """Log what the child logged; with `until`, wait for that answer (`timeout` s at most for
        each message)."""
        while self.conn is not None:
            try:
                if not self.conn.poll(timeout):
                    if until is not None:
                        self._fail(f"W&B process did not answer {until!r} in {timeout:.0f} s")
                    return None
                kind, *payload = self.conn.recv()
            except (EOFError, OSError):
                self._fail(f"W&B process ended (exit code {self._exit_code()})")
                return None
            if kind == "log":
                name, level, text = payload
                logging.getLogger(name).log(level, text)
            elif kind == until:
                return payload[0]
        return None

    def _exit_code(self) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _fail(self, reason: str) -> None:
        log.warning("%s; W&B logging stops, metrics.jsonl goes on", reason)
        self.failed = reason
        self._stop()

    def _stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None:
            try:
                self.process.wait(timeout=FINISH_TIMEOUT_S if not self.failed else 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


def build_tracking_sinks(settings: AmpLabConfig, out_dir: Path) -> list[Sink]:
    """The W&B sink for this run, or none when W&B is disabled."""
    mode = resolve_mode(settings.logger)
    return [] if mode == "disabled" else [WandbProcessSink(settings, out_dir, mode)]


# -- the child's side --------------------------------------------------------------------------
class _Relay(logging.Handler):
    """Sends amp_lab's log records to the training process, which logs them as its own."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(logging.INFO)
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.conn.send(("log", record.name, record.levelno, redact(record.getMessage())))
        except OSError:  # the training process has gone; the sink still finishes the run
            pass


def serve(conn: Connection) -> None:
    """Run a WandbSink on the calls that arrive, in order, until `close` or the socket closes."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the training process decides when W&B stops
    package_log = logging.getLogger("amp_lab")
    package_log.addHandler(_Relay(conn))
    package_log.setLevel(logging.INFO)
    package_log.propagate = False
    sink: WandbSink | None = None
    while True:
        try:
            verb, payload = conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError):  # the training process has gone
            verb, payload = "close", None
        if verb == "start":
            settings, out_dir, mode, info = payload
            sink = WandbSink(settings, out_dir, mode)
            sink.start(info)
            answer: Any = sink.describe()
        elif verb == "log":
            if sink is not None:
                sink.log(payload)
            continue  # records are not answered: the training thread does not wait for W&B
        elif verb == "finish":
            if sink is not None:
                sink.finish(payload)
            answer = None
        else:  # close
            if sink is not None:
                sink.close()
            _answer(conn, "close", None)
            return
        _answer(conn, verb, answer)


def _answer(conn: Connection, verb: str, answer: Any) -> None:
    try:
        conn.send((verb, answer))
    except OSError:  # the training process has gone: the next recv sees it, and W&B is closed
        pass


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
