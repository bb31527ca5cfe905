"""W&B tracking, checked against what the run really wrote to W&B's own offline files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyte
import pytest
from helpers import FAST, ROOT, run_cli, settings
from helpers.resume import SignalAt
from helpers.sinks import Boom
from helpers.wandb_records import offline_runs, read_run

from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.config import ConfigError
from amp_lab.records import WANDB_GROUP_FILE, WANDB_ID_FILE
from amp_lab.tracking.wandb_sink import (
    ATTEMPT_LOGS,
    WandbSink,
    build_tracking_sinks,
    resolve_mode,
    sweep_group,
)
from amp_lab.trainer import Trainer

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, like a real key
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor moves on a terminal


def _jsonl(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


def _no_key_anywhere(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_run_logs_config_identity_history_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    summary = Trainer(
        build(
            settings(
                "logger.mode=offline",
                "logger.group=study-a",
                "precision=bf16",
                "scaler.init_scale=32768",
                "lr.scale=0.7",
                "+logger.tags=[mine]",
            ),
            tmp_path,
        )
    ).fit()
    [wandb_file] = offline_runs(tmp_path)
    run = read_run(wandb_file)
    assert run.run_id == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert (run.project, run.group, run.job_type) == ("amp_lab", "study-a", "bf16")
    assert {"model:test_vit", "precision:bf16", "mine"} <= set(run.tags)
    # nested keys, searchable as precision.name, scaler.init_scale, lr.scale in W&B
    assert run.config["precision"]["name"] == "bf16"
    assert run.config["scaler"]["init_scale"] == 32768
    assert run.config["lr"]["scale"] == 0.7
    assert run.config["resolved"]["lr"]["peak"] == pytest.approx(0.7e-3)
    assert "logger" in run.config and FAKE_KEY not in json.dumps(run.config)
    # every metrics.jsonl record is a W&B history row, plotted against `step`
    train = [row for row in run.history if "train/loss" in row]
    assert [row["step"] for row in train] == [r["step"] for r in _jsonl(tmp_path, "train")]
    assert [row["train/loss"] for row in train] == pytest.approx(
        [r["train/loss"] for r in _jsonl(tmp_path, "train")]
    )
    assert [row["val/acc"] for row in run.history if "val/acc" in row] == pytest.approx(
        [r["val/acc"] for r in _jsonl(tmp_path, "val")]
    )
    assert {run.metrics[f"{p}/*"] for p in ("train", "val", "amp", "throughput")} == {"step"}
    assert run.summary["final_val_acc"] == pytest.approx(summary["final_val_acc"])
    assert run.summary["status"] == "completed" and run.summary["precision"]["name"] == "bf16"
    # the precision audit's headline reaches W&B's run summary through summary.json's path
    assert run.summary["precision_audit"]["headline"] == "bf16: 100.0% of GEMM FLOPs in bf16"
    assert run.exit_code == 0
    assert summary["tracking"] == {
        "wandb_requested": "offline",
        "wandb_mode": "offline",
        "wandb_fallback": None,
        "wandb_stopped": None,
    }
    _no_key_anywhere(tmp_path)


def test_each_sweep_has_a_group_of_its_own_that_every_job_reads(tmp_path):
    """Two sweeps whose folders end in the same two names get groups of their own; the jobs of
    one, starting at once (racing as nodes do on a shared file system), requeued or resumed
    later, all read the group its first job stored."""
    sweeps = [tmp_path / project / "multirun" / "lr" for project in ("a", "b")]
    for sweep in sweeps:
        sweep.mkdir(parents=True)
    start = threading.Barrier(16)

    def job(_: int) -> str:
        start.wait()
        return sweep_group(sweeps[0])

    with ThreadPoolExecutor(16) as pool:
        [group] = set(pool.map(job, range(16)))
    assert re.fullmatch(r"multirun/lr-[a-z0-9]{6}", group)
    assert (sweeps[0] / WANDB_GROUP_FILE).read_text() == group + "\n"
    assert [p.name for p in sweeps[0].iterdir()] == [WANDB_GROUP_FILE]  # no job's own copy left
    assert sweep_group(sweeps[0]) == group  # a requeued job, a resumed sweep
    other = sweep_group(sweeps[1])
    assert other != group and other.startswith("multirun/lr-")


@pytest.mark.slow
def test_a_sweeps_runs_share_its_group_for_side_by_side_comparison(tmp_path):
    """`python -m amp_lab -m ...` as a user types it (the default multirun/<date>/<time>): every
    job's W&B run is in the sweep's group, with its precision as job type and its overrides as
    name."""
    fast = [o for o in FAST if not o.startswith(("logger.", "trainer.max_steps"))]
    proc = run_cli(
        "-m", "precision=fp32,bf16", *fast, "trainer.max_steps=2", "logger.mode=offline",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [sweep] = tmp_path.glob("multirun/*/*")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert len(jobs) == 2
    runs = {job.name: read_run(f) for job in jobs for f in offline_runs(job)}
    assert len(runs) == 2  # one W&B run per job
    group = (sweep / WANDB_GROUP_FILE).read_text().strip()  # the sweep's date/time and its id
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-[a-z0-9]{6}", group)
    assert group.startswith(f"{sweep.parent.name}/{sweep.name}-")
    for job_dir, run in runs.items():
        precision = "bf16" if "precision=bf16" in job_dir else "fp32"
        assert run.group == group
        assert run.job_type == precision
        assert run.name == job_dir.split("_", 1)[1]  # the override_dirname: 0_<overrides>
        assert f"precision={precision}" in run.name and "model=test_vit" in run.name
    # wandb prints nothing; amp_lab says once per job where its W&B run is
    printed = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in printed if line.startswith("wandb")]
    for job in jobs:
        [sync_dir] = job.glob("wandb/offline-run-*")
        where = f"W&B offline run {runs[job.name].run_id}: {sync_dir}"
        assert sum(line.endswith(where) for line in printed) == 1, where
    # launched again into its folder (a resumed sweep), from elsewhere: the same group
    again = run_cli("-m", "trainer.seed=1", *fast, "trainer.max_steps=2", "logger.mode=offline",
                    f"hydra.sweep.dir={sweep}", cwd=tmp_path / "multirun")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    [seed1] = [read_run(f) for f in sweep.glob("*trainer.seed=1*/wandb/offline-run-*/*.wandb")]
    assert seed1.group == group


@pytest.mark.slow
def test_resumed_job_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / WANDB_ID_FILE).write_text("resume01\n")  # as a checkpoint restores it
    every = "checkpoint.every_steps=2"
    with pytest.raises(RuntimeError, match="boom"):  # dies at step 4, after its checkpoint at 2
        Trainer(build(settings("logger.mode=offline", every), tmp_path), [Boom()]).fit()
    Trainer(
        build(settings("logger.mode=offline", every), tmp_path)
    ).fit()  # the requeued one finishes
    files = offline_runs(tmp_path)
    assert len(files) == 2 and {read_run(f).run_id for f in files} == {"resume01"}


@pytest.mark.slow
def test_a_requeue_finds_the_runs_records_on_disk(tmp_path, monkeypatch):
    """submitit's requeue has SLURM end every process of the job at once, W&B's service too:
    what the run logged is in its offline file before the signal is handed on to submitit."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    seen = []

    def submitit_like(signum, frame):  # requeues, and exits
        seen.append(
            [row["step"] for run in map(read_run, offline_runs(tmp_path)) for row in run.history]
        )
        raise SystemExit(-1)

    before = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        with pytest.raises(Interrupted, match="SIGUSR2 at step 4"):
            Trainer(build(settings("logger.mode=offline"), tmp_path), [SignalAt(4)]).fit()
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert seen == [[2, 4]]


@pytest.mark.slow
def test_crashed_run_is_finished_with_its_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(build(settings("logger.mode=offline"), tmp_path), [Boom()]).fit()
    run = read_run(offline_runs(tmp_path)[0])
    assert run.summary["status"].startswith("crashed: RuntimeError: boom")
    assert run.exit_code == 1
    # the run's own sinks log a record before the sinks a caller adds (Boom fails at step 4)
    assert [row["step"] for row in run.history if "train/loss" in row] == [2, 4]


@pytest.mark.slow
def test_init_failure_falls_back_to_offline(tmp_path, monkeypatch, caplog):
    """Online with an unreachable server: a warning, then an offline run with every metric."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with caplog.at_level(logging.WARNING, logger="amp_lab.tracking.wandb_sink"):
        summary = Trainer(build(settings("logger.mode=online"), tmp_path)).fit()
    assert summary["status"] == "completed"
    assert "W&B online unavailable (init failed" in caplog.text
    assert "logging offline instead" in caplog.text
    assert FAKE_KEY not in caplog.text
    run = read_run(offline_runs(tmp_path)[0])
    assert [row["step"] for row in run.history if "train/loss" in row] == [2, 4, 6]
    assert run.summary["final_val_acc"] == pytest.approx(summary["final_val_acc"])
    _no_key_anywhere(tmp_path)


@contextlib.contextmanager
def _local_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A W&B server stand-in on a free loopback port; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


class _RecordEveryRequest(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_an_offline_run_sends_nothing_to_the_wandb_server(tmp_path, monkeypatch):
    """Offline posts nothing to the W&B server, not even W&B's own analytics (wandb 0.31 posts
    them to /sdk/otel/v1/metrics at exit unless the process, not only the run, is set up
    offline)."""
    _RecordEveryRequest.seen = []
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with _local_server(_RecordEveryRequest) as url:
        monkeypatch.setenv("WANDB_BASE_URL", url)
        Trainer(build(settings("logger.mode=offline"), tmp_path)).fit()
    assert read_run(offline_runs(tmp_path)[0]).exit_code == 0
    assert _RecordEveryRequest.seen == []


@pytest.mark.slow
def test_modes_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode(settings("logger.mode=online").logger) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # an offline cluster's switch wins
    assert resolve_mode(settings("logger.mode=online").logger) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")  # but never re-enables a disabled logger
    assert build_tracking_sinks(settings("logger=disabled"), tmp_path) == []
    monkeypatch.setenv("WANDB_MODE", "disabled")
    Trainer(build(settings("logger.mode=offline", "trainer.max_steps=2"), tmp_path)).fit()
    assert not (tmp_path / "wandb").exists() and (tmp_path / "summary.json").exists()
    with pytest.raises(ConfigError, match="logger.mode='onlin' is unknown"):
        settings("logger.mode=onlin")


def test_a_dead_wandb_service_never_replaces_the_runs_own_exit(tmp_path, caplog):
    """On a SLURM requeue, SIGTERM can end the W&B service before the run closes its sink: the
    failure is a warning, so the requeue's SystemExit is what leaves the job."""

    class DeadService:
        def __getattr__(self, name):
            raise ConnectionResetError("Connection lost")

    class DeadRun:
        summary = DeadService()

        def finish(self, exit_code):
            raise ConnectionResetError("Connection lost")

    (tmp_path / "summary.json").write_text('{"status": "interrupted: SIGTERM at step 4"}')
    sink = WandbSink(settings(), tmp_path, "offline")
    sink.run = DeadRun()
    sink.finish({"status": "completed"})
    sink.close()  # raises nothing
    assert sink.run is None
    assert [r.message for r in caplog.records if "W&B" in r.message] == [
        "W&B summary failed (Connection lost)",
        "W&B finish failed (Connection lost)",
    ]


def test_records_reach_wandb_in_order_and_a_failure_stops_only_wandb(tmp_path, caplog):
    """A record that fails in W&B is one warning; the later records are dropped for W&B only."""

    class RecordingRun:
        def __init__(self):
            self.calls: list[dict] = []
            self.summary: dict = {}

        def log(self, values):
            self.calls.append(values)
            if values["step"] == 2:
                raise ConnectionResetError("Connection lost")

    run = RecordingRun()
    sink = WandbSink(settings(), tmp_path, "offline")
    sink.run = run
    for step in range(1, 5):
        sink.log({"kind": "train", "step": step, "train/loss": 1.0 / step})
    sink.finish({"status": "completed"})
    assert [values["step"] for values in run.calls] == [1, 2]  # in order; none after the failure
    assert all("kind" not in values for values in run.calls)
    assert sink.run is None and run.summary == {}
    assert [r.message for r in caplog.records if "W&B" in r.message] == [
        "W&B log failed: Connection lost; W&B logging stops, metrics.jsonl goes on"
    ]
    assert sink.describe()["wandb_stopped"] == "log failed: Connection lost"


STOPPED_RUN = """
import os, signal, sys
from pathlib import Path
from helpers import settings
from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer

signal.signal(signal.SIGINT, signal.default_int_handler)  # as on a terminal, if pytest's is ignored

def wandb_core():
    \"\"\"The pid of this process's wandb-core, W&B's service process.\"\"\"
    [pid] = [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if stat.read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())
        and b"wandb-core" in (stat.parent / "cmdline").read_bytes()
    ]
    return pid

class Stop(Sink):
    def log(self, record):
        if record["step"] == 4:
            {action}

run = build(settings("logger.mode=offline", "trainer.max_steps=8"), sys.argv[1])
Trainer(run, [Stop()]).fit()
"""


def _stopped_run(tmp_path: Path, action: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A run in a process of its own (and its own process group, for a Ctrl-C) that does
    `action` at step 4."""
    script = tmp_path / "run.py"
    script.write_text(STOPPED_RUN.format(action=action))
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env.update(PYTHONPATH=path, OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=env,
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("action", "code", "status"),
    [
        # Ctrl-C reaches the whole process group (wandb-core has a session of its own)
        ("os.killpg(0, signal.SIGINT)", 130, "interrupted: SIGINT at step 4"),
        # SLURM's SIGTERM at a time-out or requeue
        ("os.killpg(0, signal.SIGTERM)", 128 + signal.SIGTERM, "interrupted: SIGTERM at step 4"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stopped_run_still_finishes_its_wandb_run(tmp_path, action, code, status):
    """The run's own signal handling checkpoints, closes the sinks and so finishes the W&B run:
    when the process has exited, every record is on disk and the run has its exit record."""
    proc, out = _stopped_run(tmp_path, action)
    assert proc.returncode == code, proc.stderr[-2000:]
    run = read_run(offline_runs(out)[0])
    assert run.exit_code == 1
    assert [row["step"] for row in run.history if "train/loss" in row] == [2, 4]
    assert run.summary["status"].startswith(status)
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_dead_wandb_service_is_one_warning_and_training_goes_on(tmp_path):
    """wandb-core killed mid-run (the OOM killer's pick, a crash): one warning, training and
    metrics.jsonl go on, summary.json says W&B stopped, and wandb's exit hook prints nothing."""
    proc, out = _stopped_run(tmp_path, "os.kill(wandb_core(), signal.SIGKILL)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in _jsonl(out, "train")] == [2, 4, 6, 8]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    stopped = summary["tracking"]["wandb_stopped"]
    assert stopped.startswith("log failed: "), summary["tracking"]
    warnings = [line for line in proc.stderr.splitlines() if "W&B" in line]
    assert warnings == [f"W&B {stopped}; W&B logging stops, metrics.jsonl goes on"]
    assert "Traceback" not in proc.stderr


# -- online W&B as a new user meets it: on a terminal, no key / a bad key / no network ---------
TERMINAL_RUN = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.device=cpu",
    "trainer.progress=false",
    "logger.mode=online",
]


def _on_terminal(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """`python -m amp_lab ARGS` with stdin/stdout/stderr on a pseudo-terminal that stays open:
    a prompt would wait for input until the timeout. Returns (exit code, output, seconds)."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "amp_lab", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = -1
    seconds = time.monotonic() - start
    reader.join(timeout=5)
    os.close(master)
    return code, b"".join(chunks).decode(errors="replace"), seconds


def _terminal_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"  # no ~/.netrc, no W&B settings: a new user's account
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **env,
        "HOME": str(home),
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "TERM": "xterm",
        **extra,
    }


class _RejectEveryKey(BaseHTTPRequestHandler):
    """A W&B server that answers every request 401, as the real one does for a wrong key."""

    def _reject(self) -> None:
        body = b'{"errors": [{"message": "user is not logged in"}]}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reject

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def rejecting_server() -> Iterator[str]:
    with _local_server(_RejectEveryKey) as url:
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no key", "fake key, no network", "bad key"])
def test_online_on_a_terminal_never_prompts(case, tmp_path, rejecting_server):
    extra = {
        "no key": {},
        # nothing listens on port 9: the connection is refused at once, like no network
        "fake key, no network": {"WANDB_API_KEY": FAKE_KEY, "WANDB_BASE_URL": "http://127.0.0.1:9"},
        "bad key": {"WANDB_API_KEY": FAKE_KEY, "WANDB_BASE_URL": rejecting_server},
    }[case]
    run_dir = tmp_path / "run"
    code, output, seconds = _on_terminal(
        [*TERMINAL_RUN, f"hydra.run.dir={run_dir}"],
        _terminal_env(tmp_path, WANDB_INIT_TIMEOUT="8", **extra),
        timeout=150,
    )
    assert code == 0, output[-3000:]
    assert FAKE_KEY not in output
    # amp_lab's fall-back warning is the one W&B line on the terminal: no wandb progress,
    # retries or errors (wandb printed 40-odd "wandb: ERROR retrying" lines with no network)
    lines = ANSI.sub("", output).splitlines()
    assert not [line for line in lines if line.lstrip().startswith("wandb")]
    [warning] = [line for line in lines if "W&B" in line]
    assert "logging offline instead" in warning
    assert "ERROR" not in output and "retrying" not in output
    # ... and the run's log file has it, after wandb's own lines
    [log_file] = run_dir.glob("*.log")
    logged = log_file.read_text()
    assert "logging offline instead" in logged
    if case != "no key":  # wandb was started: what it had to say is in the log file
        assert "wandb: " in logged
    if case == "fake key, no network":  # wandb's retries, in its log of the online attempt
        attempt_log = run_dir / "wandb" / ATTEMPT_LOGS / "debug-internal.log"
        assert "connection refused" in attempt_log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    tracking = summary["tracking"]
    assert (tracking["wandb_requested"], tracking["wandb_mode"]) == ("online", "offline")
    assert ("no API key" in tracking["wandb_fallback"]) == (case == "no key")
    # the aborted online attempt leaves no run folder beside the offline run, only its logs
    assert sorted(p.name.split("-")[0] for p in (run_dir / "wandb").glob("*run-*")) == ["offline"]
    run = read_run(offline_runs(run_dir)[0])
    assert run.config["logger"]["mode"] == "offline"
    assert run.config["tracking"]["wandb_fallback"] == tracking["wandb_fallback"]
    assert run.group == ""  # a single run (not -m) has no group unless logger.group is set
    assert [row["step"] for row in run.history if "train/loss" in row] == [2, 4]
    if case == "fake key, no network":  # wandb retries until its time-out: setup, not training
        assert summary["setup_s"] >= 8 > summary["train_time_s"]
    assert max(r["time_s"] for r in _jsonl(run_dir, "train")) <= summary["train_time_s"]
    _no_key_anywhere(run_dir)


@pytest.mark.slow
def test_on_an_80_column_terminal_the_bar_keeps_its_count_and_log_lines_stay_whole(tmp_path):
    """What the terminal shows (pyte replays the run's output on an 80 x 200 screen): log lines
    whole above the bar, the bar with its step count and time left, the metrics whole under it.
    Before, rich squeezed all on one line ("train ╸ … … loss 2.287 ...") and its refreshes erased
    the log lines that landed inside it (the run's closing "run health" line among them)."""
    shown = [arg for arg in TERMINAL_RUN if not arg.startswith(("trainer.progress", "logger"))]
    code, output, _ = _on_terminal(
        [*shown, "logger.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}"],
        _terminal_env(tmp_path, COLUMNS="80"),
        timeout=120,
    )
    assert code == 0, output[-3000:]
    screen = pyte.Screen(80, 200)
    pyte.Stream(screen).feed(output)
    lines = [line.rstrip() for line in screen.display if line.strip()]
    bar = next(i for i, line in enumerate(lines) if line.startswith("train "))
    assert re.fullmatch(r"train ━+ 4/4 \d:\d\d:\d\d", lines[bar]), lines
    assert re.fullmatch(r"loss \S+  acc \S+  val \S+  scale \S+  samples/s [\d.]+", lines[bar + 1])
    logged = "".join(lines[:bar])  # the log lines, wrapped at 80 columns
    assert "[amp_lab.audit.audit][INFO] - precision audit: fp32:" in logged
    assert "GEMM FLOPs in fp32[" in logged  # whole, and the next log line after it
    assert logged.endswith("[amp_lab.trainer][INFO] - run health: ok (no finding)"), lines[:bar]
    assert lines[bar + 2].strip() == "amp_lab run summary"
