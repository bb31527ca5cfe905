"""Sinks that fail on purpose, as a crashing job would."""

from __future__ import annotations

from amp_lab.tracking.sinks import Sink


class Boom(Sink):
    """Fails at the second train log, as a crashing job would."""

    def log(self, record: dict) -> None:
        if record["step"] == 4:
            raise RuntimeError("boom")
