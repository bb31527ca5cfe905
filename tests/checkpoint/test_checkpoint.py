"""Checkpoint and resume: a resumed run equals an uninterrupted one; signals; corrupt files."""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FAST, ROOT, run_cli, settings
from helpers.resume import RUN, SignalAt
from helpers.resume import curve as _curve
from helpers.resume import interrupt as _interrupt
from helpers.resume import rows as _rows

from amp_lab import records
from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.config import ConfigError, changed_settings, free_on_resume
from amp_lab.records import SETTINGS_FILE, SUMMARY_FILE
from amp_lab.search.trial import TrialPruned
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer

# fp16: a small growth interval, so the scale moves and a lost growth tracker would show
PRECISION = {
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16", "scaler.init_scale=1024", "scaler.growth_interval=3"],
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class KillAt(Sink):
    """Ends the run like a SIGKILL right after the records of `step` are written: no
    checkpoint, no clean exit (the W&B-less run's summary says crashed)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, record: dict) -> None:
        if record["step"] == self.step:
            raise KeyboardInterrupt


def _diagnostics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "diagnostics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_resumed_run_equals_uninterrupted_run(precision, tmp_path):
    overrides = [*RUN, *PRECISION[precision]]
    whole = Trainer(build(settings(*overrides), tmp_path / "whole"))
    whole.fit()

    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "wandb_run_id").write_text("abc123\n")
    stopped = _interrupt(tmp_path / "split", overrides, at_step=5)
    assert stopped.code == 128 + signal.SIGUSR2 and "SIGUSR2 at step 5" in str(stopped)
    assert max(r["step"] for r in _rows(tmp_path / "split")) == 5
    (tmp_path / "split" / "wandb_run_id").unlink()

    resumed = Trainer(build(settings(*overrides), tmp_path / "split"))
    assert resumed.run.state.step == 5 and resumed.run.state.batch_in_epoch == 5
    assert (tmp_path / "split" / "wandb_run_id").read_text().strip() == "abc123"
    summary = resumed.fit()

    assert _curve(tmp_path / "split") == _curve(tmp_path / "whole")  # also: no gap, no repeat
    assert [r["step"] for r in _rows(tmp_path / "split") if r["kind"] == "train"] == list(
        range(1, 13)
    )
    for a, b in zip(whole.run.model.state_dict().values(), resumed.run.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert resumed.run.scaler.state_dict() == whole.run.scaler.state_dict()
    assert summary["steps"] == 12 and summary["status"] == "completed"
    if precision == "fp16":  # the scale really moved, so the restored tracker mattered
        assert (
            len({r["amp/loss_scale"] for r in _rows(tmp_path / "whole") if r["kind"] == "train"})
            > 1
        )


@pytest.mark.slow
def test_resumed_diagnostics_carry_on_the_history_mid_window(tmp_path):
    """A kill between a mid-window checkpoint and the next one: the resumed run's scale events,
    probe results and pitfall verdicts are those of an uninterrupted run (no invented events,
    no false signature, no record twice)."""
    overrides = [
        *RUN,
        *PRECISION["fp16"],
        "trainer.log_every=4",
        "diagnostics.every=2",
        "checkpoint.every_steps=3",
    ]
    whole = Trainer(build(settings(*overrides), tmp_path / "whole")).fit()
    with pytest.raises(KeyboardInterrupt):  # after step 8's records; the checkpoint is step 6
        Trainer(build(settings(*overrides), tmp_path / "split"), [KillAt(8)]).fit()
    resumed = Trainer(build(settings(*overrides), tmp_path / "split"))
    assert resumed.run.state.step == 6
    summary = resumed.fit()
    assert _diagnostics(tmp_path / "split") == _diagnostics(tmp_path / "whole")
    assert [r["step"] for r in _diagnostics(tmp_path / "split")] == [4, 8, 12]
    assert summary["diagnostics"] == whole["diagnostics"]
    assert whole["diagnostics"]["scale_events"] and not whole["diagnostics"]["signatures"]
    assert _curve(tmp_path / "split") == _curve(tmp_path / "whole")


@pytest.mark.slow
def test_a_resume_with_changed_settings_is_refused_before_anything_changes(tmp_path, caplog):
    _interrupt(tmp_path, RUN, at_step=5)
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for changed, named in [
        (["optim=sgd"], 'optim.name "adamw" -> "sgd"'),
        (["trainer.batch_size=8"], "trainer.batch_size 16 -> 8"),
        (["precision=fp16"], 'precision.name "fp32" -> "fp16"'),
    ]:
        with pytest.raises(ConfigError, match="written with other settings: ") as refused:
            Trainer(build(settings(*RUN, *changed), tmp_path))
        assert named in str(refused.value) and "trainer.resume=false" in str(refused.value)
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # settings that leave training unchanged may differ
    resumed = Trainer(build(settings(*RUN, "diagnostics=full", "trainer.eval_every=6"), tmp_path))
    assert resumed.run.state.step == 5


def test_a_checkpoint_resumes_only_on_the_world_size_that_wrote_it(tmp_path):
    """The global batch is batch_size x ranks: a checkpoint of another world would resume
    another run under the same settings."""
    _interrupt(tmp_path, RUN, at_step=5)
    [path] = list((tmp_path / "checkpoints").glob("step_*.pt"))
    payload = torch.load(path, weights_only=True)
    assert payload["world_size"] == 1
    torch.save({**payload, "world_size": 2}, path)  # as 2 DDP ranks write it
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as refused:
        Trainer(build(settings(*RUN), tmp_path))
    assert str(refused.value) == (
        f"checkpoint {path} was written by 2 rank(s), this run has 1; resume it on 2, or set "
        "trainer.resume=false to start fresh"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_checkpoint_holds_plain_data_and_loads_weights_only(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="amp_lab.checkpoint.signals"):
        _interrupt(tmp_path, [*RUN, "precision=fp16"], at_step=3, signum=signal.SIGTERM)
    assert "SIGTERM at step 3: checkpoint" in caplog.text and "; stopping" in caplog.text
    assert f"(to resume: the same command with hydra.run.dir={tmp_path}, or for a" in caplog.text
    [path] = list((tmp_path / "checkpoints").glob("step_*.pt"))
    assert path.name == "step_000000003.pt"
    payload = torch.load(path, weights_only=True)
    assert set(payload["parts"]) == {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "monitor",
        "diagnostics",
    }
    assert payload["loop"]["step"] == 3 and payload["loop"]["epoch"] == 0
    assert payload["parts"]["scaler"]["_growth_tracker"] == 3  # fp16 default interval: 2000
    assert payload["parts"]["scheduler"]["last_epoch"] == 3
    assert set(payload["rng"]) == {"torch", "cuda", "python", "numpy"}
    assert isinstance(payload["rng"]["numpy"]["keys"], list)
    assert not list(tmp_path.glob("checkpoints/*.tmp"))


def test_stop_signal_is_handed_on_after_the_checkpoint(tmp_path):
    """Like submitit: the previous handler requeues and exits; it runs after the save."""
    seen = []

    def submitit_like(signum, frame):
        seen.append(sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")))
        raise SystemExit(-1)

    before = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        stopped = _interrupt(tmp_path, RUN, at_step=4)
        assert signal.getsignal(signal.SIGUSR2) is submitit_like  # ours is gone again
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert seen == [["step_000000004.pt"]] and stopped.code == -1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"].startswith("interrupted: SIGUSR2 at step 4")


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_stops_cleanly_and_twice_stops_at_once(tmp_path, capsys, ctrl_c):
    stopped = _interrupt(tmp_path / "once", RUN, at_step=5, signum=signal.SIGINT)
    assert stopped.code == 130 and "SIGINT at step 5: checkpoint" in str(stopped)
    assert "Ctrl-C: stopping after this step's checkpoint" in capsys.readouterr().err
    assert (
        Trainer(build(settings(*RUN), tmp_path / "once")).run.state.step == 5
    )  # and it resumes there
    with pytest.raises(KeyboardInterrupt):
        Trainer(
            build(settings(*RUN), tmp_path / "twice"), [SignalAt(5, signal.SIGINT, times=2)]
        ).fit()
    assert not (tmp_path / "twice" / "checkpoints").exists()


def test_ctrl_c_at_the_last_step_finishes_the_run_then_stops(tmp_path, ctrl_c):
    """A sweep's next job must not start: the signal is not swallowed by the run's end."""
    stopped = _interrupt(tmp_path, RUN, at_step=12, signum=signal.SIGINT)
    assert stopped.code == 130 and str(stopped) == "SIGINT at step 12, as the run ended; stopping"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert not (tmp_path / "checkpoints").exists()


class PrunedAt(SignalAt):
    """Ctrl-C, then the trial is pruned at the same step (before the step's checkpoint)."""

    def log(self, record: dict) -> None:
        super().log(record)
        if record["kind"] == "train" and record["step"] == self.step:
            raise TrialPruned(f"pruned at step {self.step}")


def test_ctrl_c_as_a_trial_is_pruned_stops_instead_of_the_next_trial(tmp_path, ctrl_c):
    with pytest.raises(Interrupted, match="SIGINT at step 3, as the run ended") as stopped:
        Trainer(build(settings(*RUN), tmp_path), [PrunedAt(3, signal.SIGINT)]).fit()
    assert stopped.value.code == 130
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped: pruned at step 3"


def test_a_signal_ignored_before_stays_ignored(tmp_path):
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup
    try:
        summary = Trainer(build(settings(*RUN), tmp_path), [SignalAt(4, signal.SIGINT)]).fit()
    finally:
        signal.signal(signal.SIGINT, before)
    assert summary["status"] == "completed" and not (tmp_path / "checkpoints").exists()


def test_a_second_ctrl_c_waits_for_the_checkpoint_being_written(tmp_path):
    signals = Trainer(build(settings(*RUN), tmp_path)).run.checkpointer.signals
    signals.stop_signal = signal.SIGINT  # the first Ctrl-C
    signals.saving = True
    signals.on_signal(signal.SIGINT, None)  # the second, during the save: no effect
    signals.saving = False
    with pytest.raises(KeyboardInterrupt):
        signals.on_signal(signal.SIGINT, None)  # the second, during a step: at once


def test_a_previous_handler_that_returns_lets_training_go_on(tmp_path):
    """As submitit's SIGUSR2 handler does on ranks other than 0 (rank 0 requeues the job)."""
    calls = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        summary = Trainer(build(settings(*RUN), tmp_path), [SignalAt(4, signal.SIGUSR2)]).fit()
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert calls == [signal.SIGUSR2] and summary["status"] == "completed"
    assert summary["steps"] == 12
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.pt")] == ["step_000000004.pt"]


def test_sigterm_stops_after_the_checkpoint_even_when_its_handler_returns(tmp_path):
    """submitit only logs SIGTERM; SLURM sends it before killing a preempted, timed-out or
    requeued job, so training on would be work thrown away."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        stopped = _interrupt(tmp_path, RUN, at_step=4, signum=signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert calls == [signal.SIGTERM] and stopped.code == 128 + signal.SIGTERM
    assert "handed on, stopping" in str(stopped)
    assert json.loads((tmp_path / "summary.json").read_text())["status"].startswith(
        "interrupted: SIGTERM at step 4"
    )
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.pt")] == ["step_000000004.pt"]


@pytest.mark.parametrize("keep, expected", [(2, [8, 4]), (1, [8])])
def test_periodic_checkpoints_keep_the_newest(keep, expected, tmp_path):
    trainer = Trainer(
        build(settings(*RUN, "checkpoint.every_steps=4", f"checkpoint.keep={keep}"), tmp_path)
    )
    trainer.fit()  # step 12 ends the run: its results are the summary, not a checkpoint
    assert [int(p.stem.split("_")[1]) for p in trainer.run.checkpointer.checkpoints()] == expected


def test_corrupt_checkpoint_falls_back_to_the_previous_good_one(tmp_path, caplog):
    whole = tmp_path / "whole"
    Trainer(build(settings(*RUN), whole)).fit()
    run = tmp_path / "run"
    _interrupt(run, [*RUN, "checkpoint.every_steps=4"], at_step=10)
    newest = run / "checkpoints" / "step_000000010.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a job killed while copying, say

    with caplog.at_level(logging.WARNING, logger="amp_lab.checkpoint.store"):
        resumed = Trainer(build(settings(*RUN), run))
    assert "step_000000010.pt is unusable" in caplog.text
    assert resumed.run.state.step == 8
    assert max(r["step"] for r in _rows(run)) == 8  # records past the checkpoint dropped
    assert (run / "checkpoints" / "step_000000010.pt.corrupt").exists()  # kept, out of the way
    resumed.fit()
    assert _curve(run) == _curve(whole)


@pytest.mark.slow
def test_no_usable_checkpoint_is_one_clear_error_and_deletes_nothing(tmp_path, monkeypatch):
    _interrupt(tmp_path / "run", [*RUN, "checkpoint.every_steps=2"], at_step=5)
    files = sorted((tmp_path / "run" / "checkpoints").iterdir())
    for path in files:
        path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="no usable checkpoint in .*trainer.resume=false"):
        Trainer(build(settings(*RUN), tmp_path / "run"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_cli(
        *RUN,
        "trainer.progress=false",
        "model=test_vit",
        "data.img_size=16",
        "trainer.device=cpu",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1].startswith("amp_lab: error: no usable checkpoint in")
    )
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == files
    assert max(r["step"] for r in _rows(tmp_path / "run")) == 5  # metrics untouched too


def test_resume_false_starts_fresh_and_keeps_the_old_files(tmp_path):
    _interrupt(tmp_path, RUN, at_step=5)
    (tmp_path / "wandb_run_id").write_text("abc123\n")  # as the W&B sink leaves it
    trainer = Trainer(build(settings(*RUN, "trainer.resume=false"), tmp_path))
    assert trainer.run.state.step == 0
    trainer.fit()
    assert [r["step"] for r in _rows(tmp_path) if r["kind"] == "train"] == list(range(1, 13))
    assert [r["step"] for r in _diagnostics(tmp_path)] == list(range(1, 13))
    for old in [
        "checkpoints.old-*",
        "metrics.old-*.jsonl",
        "diagnostics.old-*.jsonl",
        "summary.old-*.json",
        "wandb_run_id.old-*",
    ]:
        assert len(list(tmp_path.glob(old))) == 1, old
    assert not (tmp_path / "wandb_run_id").exists()  # no W&B: a new run would get its own id


def test_a_finished_run_is_not_trained_again(tmp_path, caplog):
    first = Trainer(build(settings(*RUN, "checkpoint.every_steps=4"), tmp_path)).fit()
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with caplog.at_level(logging.WARNING, logger="amp_lab.trainer"):
        again = Trainer(
            build(settings(*RUN, "checkpoint.every_steps=5", "trainer.eval_every=3"), tmp_path)
        ).fit()  # settings that leave training unchanged may differ
    assert (
        again == first and "already holds a finished run (completed after 12 steps)" in caplog.text
    )
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    with pytest.raises(
        ConfigError,
        match="holds a finished run with other settings: "
        "trainer.max_steps 12 -> 20; use another run",
    ):
        Trainer(build(settings(*RUN, "trainer.max_steps=20"), tmp_path))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


@pytest.mark.slow
def test_a_resume_from_a_run_without_diagnostics_starts_their_history_there(tmp_path):
    """The checkpoint was written with diagnostics=off; the resumed run watches from its step
    on, from the scale it resumed at (1 for the scaler-less half_model loop), inventing no
    event before it."""
    common = [
        *RUN,
        "precision=fp16",
        "pitfall=half_model",
        "trainer.log_every=4",
        "checkpoint.every_steps=4",
    ]
    with pytest.raises(KeyboardInterrupt):
        Trainer(build(settings(*common, "diagnostics=off"), tmp_path), [KillAt(8)]).fit()
    summary = Trainer(build(settings(*common, "diagnostics=light"), tmp_path)).fit()
    assert list(summary["diagnostics"]["signatures"]) == ["half_model"]
    assert summary["diagnostics"]["scale_events"] == []
    assert [r["step"] for r in _diagnostics(tmp_path)] == [8, 12]


def test_an_attempt_killed_before_its_first_checkpoint_starts_over_cleanly(tmp_path, caplog):
    Trainer(build(settings(*RUN), tmp_path / "whole")).fit()
    run = tmp_path / "run"
    run.mkdir()
    lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[:4]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "tr')  # killed mid-line
    (run / "wandb_run_id").write_text("abc123\n")  # the W&B run those records went to
    with caplog.at_level(logging.WARNING, logger="amp_lab.checkpoint.store"):
        Trainer(build(settings(*RUN), run)).fit()
    assert "earlier attempt's records but no checkpoint: starting over from step 0" in caplog.text
    assert _curve(run) == _curve(tmp_path / "whole")
    assert len(list(run.glob("wandb_run_id.old-*"))) == 1  # a new W&B run, not appended


def test_bad_checkpoint_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="checkpoint.keep=0 must be >= 1"):
        settings("checkpoint.keep=0")
    with pytest.raises(ConfigError, match="'USR2' is not a signal name"):
        settings("checkpoint.signals=[USR2]")
    with pytest.raises(ConfigError, match="SIGKILL cannot be caught"):
        settings("checkpoint.signals=[SIGKILL]")


# How tests/snapshots/checkpoint_format2_step2.pt was written, by the checkpointer before it was
# split into store/run_dir/signals: these settings, checkpoint.every_steps=2, killed after step 2
SNAPSHOT = ROOT / "tests" / "snapshots" / "checkpoint_format2_step2.pt"
SNAPSHOT_RUN = [
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "data.val_fraction=0.05",
    "checkpoint.every_minutes=0",
    "precision=fp16",
    "scaler.init_scale=1024",
    "scaler.growth_interval=1",
    "+model.kwargs.depth=2",
    "+model.kwargs.embed_dim=32",
]


def test_a_checkpoint_written_before_the_split_still_resumes(tmp_path):
    assert SNAPSHOT.stat().st_size < 1_000_000  # a small file in the repository
    payload = torch.load(SNAPSHOT, weights_only=True)
    assert payload["format"] == 2 and payload["step"] == 2
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(SNAPSHOT, tmp_path / "run" / "checkpoints" / "step_000000002.pt")
    resumed = Trainer(build(settings(*SNAPSHOT_RUN), tmp_path / "run"))
    assert (
        resumed.run.state.step == 2 and resumed.run.scaler.get_scale() == 4096.0
    )  # 1024, grown twice
    for name, value in resumed.run.model.state_dict().items():
        assert torch.equal(value, payload["parts"]["model"][name]), name
    summary = resumed.fit()
    whole = Trainer(build(settings(*SNAPSHOT_RUN), tmp_path / "whole"))
    whole.fit()
    assert summary["status"] == "completed" and summary["steps"] == 3
    [last] = [r for r in _rows(tmp_path / "run") if r["kind"] == "train"]  # step 3 alone
    [*_, expected] = [r for r in _rows(tmp_path / "whole") if r["kind"] == "train"]
    assert last["step"] == 3 and last["amp/loss_scale"] == expected["amp/loss_scale"] == 8192.0
    # same data position, RNG and optimizer state: the step's loss matches (slack for another
    # torch build's CPU kernels)
    assert last["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-3)


def test_free_on_resume_metadata_names_exactly_the_settings_a_resume_may_change(tmp_path):
    assert free_on_resume() == {
        "checkpoint",
        "logger",
        "diagnostics",
        "trainer.progress",
        "trainer.resume",
        "trainer.device",
        "trainer.compile",
        "trainer.compile_backend",
        "trainer.eval_every",
        "trainer.target_acc",
        "health",
        "audit",
        "report",
        "trainer.timing_warmup",
        "data.root",
        "data.prefetch_factor",
        "data.pin_memory",
        "trainer.threads",
    }
    _interrupt(tmp_path, RUN, at_step=5)
    # the workers seed the augmentation: a resume with other workers is refused
    with pytest.raises(ConfigError, match=r"data.num_workers 0 -> [12]"):
        Trainer(build(settings(*RUN, "data.num_workers=2"), tmp_path))
    resumed = Trainer(
        build(
            settings(
                *RUN,
                "trainer.timing_warmup=2",
                "data.prefetch_factor=4",
                "logger.project=elsewhere",
            ),
            tmp_path,
        )
    )
    assert resumed.run.state.step == 5


def test_settings_json_of_a_run_records_choices_as_plain_strings(tmp_path):
    """An old run's settings.json (plain JSON strings) compares equal with Enum choices."""
    Trainer(build(settings(*RUN, "precision=bf16", "scaler=hysteresis"), tmp_path)).fit()
    saved = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert saved["precision.name"] == '"bf16"' and saved["scaler.kind"] == '"hysteresis"'
    assert saved["trainer.clip_mode"] == '"norm"' and saved["diagnostics.mode"] == '"light"'
    assert changed_settings(saved, settings(*RUN, "precision=bf16", "scaler=hysteresis")) == []
    assert changed_settings(saved, settings(*RUN, "precision=fp16", "scaler=hysteresis")) == [
        'precision.name "bf16" -> "fp16"'
    ]
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["scaler"]["kind"] == "hysteresis" and summary["lr"]["schedule"] == "cosine"


RUN_DIR_NAMES = {v for k, v in vars(records).items() if k.isupper() and isinstance(v, str)}


def test_run_dir_file_names_are_written_once_in_the_package():
    """Every module takes the run directory's file names from amp_lab/records.py (a dict key
    of the same spelling, the checkpoint's "wandb_run_id", is not a file name)."""
    found = []
    for path in (ROOT / "amp_lab").rglob("*.py"):
        if path.name == "records.py":
            continue
        tree = ast.parse(path.read_text())
        keys = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)} | {
            id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in RUN_DIR_NAMES
                and id(node) not in keys
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert RUN_DIR_NAMES >= {"summary.json", "metrics.jsonl", "wandb_run_id", "refused.txt"}
    assert found == []


@pytest.mark.slow
def test_usr1_from_an_sbatch_signal_option_saves_stops_in_one_line_and_resumes_exactly(tmp_path):
    """`#SBATCH --signal=USR1@90` on a plain sbatch script: USR1 mid-run checkpoints at the next
    step, stops with 128 + USR1 and the one line naming how to resume, and the same command
    resumes there: its curve is the uninterrupted run's, no step lost or repeated."""
    fast = [o for o in FAST if not o.startswith(("trainer.max_steps", "trainer.log_every"))]
    args = [*fast, "trainer.max_steps=40", "trainer.log_every=1", "checkpoint.every_steps=10"]
    whole = run_cli(*args, "hydra.run.dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    command = [sys.executable, "-m", "amp_lab", *args, "hydra.run.dir=split"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    job = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics, deadline = tmp_path / "split" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and '"step": 15' in metrics.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before step 15"
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=300)  # Hydra logs to the console's stdout
    assert job.returncode == 128 + signal.SIGUSR1, output[-2000:]
    [line] = [line for line in output.splitlines() if "SIGUSR1 at step" in line]
    step = int(line.split("SIGUSR1 at step ")[1].split(":")[0])
    assert 15 <= step < 40 and f"hydra.run.dir={tmp_path / 'split'}" in line
    assert f"step_{step:09d}.pt" in line  # saved at the next step, not the last periodic one
    resumed = run_cli(*args, "hydra.run.dir=split", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _curve(tmp_path / "split") == _curve(tmp_path / "whole")
