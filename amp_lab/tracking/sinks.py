"""Where a run's records go — console, metrics.jsonl, W&B — behind one small interface.

The runner hands every record to a `Sinks` container; each sink decides what to show or keep.
`close()` runs in a `finally`, so a failing job still leaves its files complete.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, RenderableType
from rich.file_proxy import FileProxy
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

Record = dict[str, Any]


class Sink:
    """A do-nothing sink; subclasses override what they need."""

    def start(self, info: Record) -> None:
        """Once, before the first step: the run's resolved settings."""

    def log(self, record: Record) -> None:
        """A train log (every log_every steps) or an evaluation."""

    def finish(self, summary: Record) -> None:
        """Once, with the final summary."""

    def flush(self) -> None:
        """Before a stop signal is handed on (a requeue ends every process of the job): to disk."""

    def close(self) -> None:
        """Always called, also after an error."""

    def describe(self) -> Record:
        """After start(): what the sink really did (e.g. W&B's mode), for summary.json."""
        return {}


class JsonlSink(Sink):
    """metrics.jsonl: one JSON object per record, flushed at once so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: TextIO | None = None

    def start(self, info: Record) -> None:
        self.file = self.path.open("a", encoding="utf-8")  # a resumed run appends

    def log(self, record: Record) -> None:
        assert self.file is not None, "start() opens metrics.jsonl"
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class _BarOverMetrics(Progress):
    """The bar, the step count and the time left on one line, the latest metrics on the next:
    on an 80-column terminal neither squeezes the other out."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.fields["status"]:
                yield Text(task.fields["status"], no_wrap=True, overflow="ellipsis")


class ConsoleSink(Sink):
    """A rich progress bar on a terminal; plain lines at each evaluation elsewhere (SLURM logs)."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.console = Console(stderr=True)
        self.total_steps = total_steps
        self.live = enabled and self.console.is_terminal
        self.progress = _BarOverMetrics(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total_steps, status="")
        self.last: Record = {}
        self.rerouted: list[tuple[logging.StreamHandler, Any]] = []

    def start(self, info: Record) -> None:
        self.progress.start()
        if self.live:
            self._log_above_the_bar()
        self.progress.update(self.task, completed=info.get("step", 0))  # a resumed run's step

    def _log_above_the_bar(self) -> None:
        """While the bar is live, the log handlers writing to this terminal write through rich's
        proxies of stdout and stderr: a log line then lands whole above the bar, not inside it
        (where the bar's next refresh erased what did not fit)."""
        proxies = [stream for stream in (sys.stdout, sys.stderr) if isinstance(stream, FileProxy)]
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:  # a FileHandler keeps its file
                for proxy in proxies:
                    if handler.stream is proxy.rich_proxied_file:
                        self.rerouted.append((handler, handler.setStream(proxy)))

    def _stop(self) -> None:
        self.progress.stop()
        for handler, stream in self.rerouted:
            handler.setStream(stream)
        self.rerouted = []

    def log(self, record: Record) -> None:
        self.last.update(record)
        status = "  ".join(
            f"{label} {_fmt(self.last[key])}"
            for label, key in [
                ("loss", "train/loss"),
                ("acc", "train/acc"),
                ("val", "val/acc"),
                ("scale", "amp/loss_scale"),
                ("samples/s", "throughput/samples_per_s"),
            ]
            if key in self.last
        )
        self.progress.update(self.task, completed=record["step"], status=status)
        if not self.live and "val/acc" in record:
            self.console.print(f"step {record['step']}/{self.total_steps}  {status}")

    def finish(self, summary: Record) -> None:
        self._stop()
        table = Table(title="amp_lab run summary", show_header=False)
        for key in [
            "status",
            "precision",
            "model",
            "steps",
            "final_val_acc",
            "best_val_acc",
            "steps_to_target",
            "time_to_target_s",
            "mean_samples_per_s",
            "skipped_steps",
            "peak_memory_mb",
            "wall_time_s",
            "precision_audit",
            "output_dir",
        ]:
            value = summary.get(key)
            if isinstance(value, dict):  # precision: its name; precision_audit: its headline
                value = value.get("name", value.get("headline"))
            table.add_row(key, _fmt(value))
        self.console.print(table)

    def close(self) -> None:
        self._stop()


class Sinks(Sink):
    """Fans every call out to its sinks; close() reaches all of them even if one fails."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def start(self, info: Record) -> None:
        for sink in self.sinks:
            sink.start(info)

    def log(self, record: Record) -> None:
        for sink in self.sinks:
            sink.log(record)

    def finish(self, summary: Record) -> None:
        for sink in self.sinks:
            sink.finish(summary)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def describe(self) -> Record:
        return {key: value for sink in self.sinks for key, value in sink.describe().items()}

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - the other sinks must still close
                errors.append(err)
        if errors:
            raise errors[0]
