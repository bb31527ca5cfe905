"""Read back what a run really logged, from W&B's own offline file (wandb ships no reader).

`offline-run-*/run-*.wandb` is a LevelDB-style log: a 7-byte header (b":W&B", magic 0xBEE1 as a
little-endian uint16, version 0), then 32 KiB blocks of chunks; each chunk has a 7-byte header
(crc32: 4 bytes, length: 2, type: 1 = full, 2 = first, 3 = middle, 4 = last) and its data. A
record is one full chunk or first + middle... + last; its bytes are a `Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[pb.Record]:
    """Every Record protobuf in a .wandb file, in order."""
    data = Path(path).read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path} is not a W&B log (header {data[:7]!r})"
    records, pending, pos = [], b"", len(HEADER)
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        body = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class LoggedRun:
    """What one offline W&B run holds: identity, config, history rows and summary."""

    run_id: str = ""
    project: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # define_metric: name -> step_metric
    exit_code: int | None = None


def read_run(wandb_file: Path) -> LoggedRun:
    """Fold a .wandb file's records into one LoggedRun."""
    run = LoggedRun()
    for record in read_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.project, run.group = r.run_id, r.project, r.run_group
            run.job_type, run.name, run.tags = r.job_type, r.display_name, list(r.tags)
            for item in r.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "metric" and record.metric.name:
            run.metrics[record.metric.name] = record.metric.step_metric
        elif kind == "metric" and record.metric.glob_name:
            run.metrics[record.metric.glob_name] = record.metric.step_metric
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(run_dir: Path) -> list[Path]:
    """The .wandb files under a run directory, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
