"""A run directory's records: settings.json, finished-run detection, old files set aside under a
dated name instead of deleted. The caller decides which rank touches the files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from amp_lab.config import AmpLabConfig, ConfigError, changed_settings, flat_settings
from amp_lab.records import (
    AUDIT_FILE,
    CHECKPOINT_DIR,
    RECORD_FILES,
    SETTINGS_FILE,
    SUMMARY_FILE,
    WANDB_ID_FILE,
)

log = logging.getLogger(__name__)

FINISHED = ("completed", "diverged")  # summary statuses of a run that needs no more training


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
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


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, written atomically."""
    write_atomic(path, lambda f: f.write(data))


class RunDir:
    """The records of one run directory."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def finished(self, settings: AmpLabConfig) -> dict[str, Any] | None:
        """The summary of a run that already ended here (completed or diverged), else None; one
        with other settings is refused."""
        try:
            summary = json.loads((self.path / SUMMARY_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if summary.get("status") not in FINISHED:
            return None
        with contextlib.suppress(OSError, json.JSONDecodeError):
            saved = json.loads((self.path / SETTINGS_FILE).read_text())
            if changed := changed_settings(saved, settings):
                raise ConfigError(
                    f"{self.path} holds a finished run with other settings: "
                    f"{', '.join(changed)}; use another run directory, or set "
                    "trainer.resume=false to train there afresh (the old files "
                    "are kept)"
                )
        return summary

    def write_settings(self, settings: AmpLabConfig) -> None:
        """settings.json: what this run trains with."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(
            self.path / SETTINGS_FILE, json.dumps(flat_settings(settings), indent=1).encode()
        )

    def wandb_id(self) -> str | None:
        """The W&B run id the W&B sink left here, if any."""
        path = self.path / WANDB_ID_FILE
        return path.read_text().strip() if path.exists() else None

    def keep_wandb_id(self, run_id: str) -> None:
        """Put back a checkpoint's W&B run id, so the resumed run logs to the same W&B run."""
        if self.wandb_id() != run_id:
            (self.path / WANDB_ID_FILE).write_text(run_id + "\n")

    def truncate_records(self, step: int) -> bool:
        """Drop records past `step` (and a half-written last line), so nothing is logged twice.
        Returns whether any line was dropped."""
        dropped = False
        for name in RECORD_FILES:
            path = self.path / name
            if not path.exists():
                continue
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            kept = []
            for line in lines:
                with contextlib.suppress(json.JSONDecodeError):
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line + "\n")
            dropped |= len(kept) < len(lines)
            write_bytes_atomic(path, "".join(kept).encode())
        return dropped

    def set_aside(self, *names: str) -> None:
        """Keep these files under a dated name (by default every file of a run:
        trainer.resume=false in a used run dir); without its W&B id, a run gets a new W&B run."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        names = names or (
            CHECKPOINT_DIR,
            *RECORD_FILES,
            SUMMARY_FILE,
            SETTINGS_FILE,
            WANDB_ID_FILE,
            AUDIT_FILE,
        )
        for path in (self.path / name for name in names):
            if path.exists():
                aside = path.with_name(f"{path.stem}.old-{stamp}{path.suffix}")
                n = 1
                while aside.exists():  # set aside twice within a second
                    aside, n = path.with_name(f"{path.stem}.old-{stamp}-{n}{path.suffix}"), n + 1
                path.rename(aside)
                log.warning("kept the previous %s as %s", path.name, aside.name)
