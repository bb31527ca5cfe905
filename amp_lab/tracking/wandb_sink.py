"""Weights & Biases tracking: every run is a real W&B run, offline by default, never fatal.

wandb is imported lazily and never prompts: online without credentials, or a failing init (after
at most `$WANDB_INIT_TIMEOUT` s), is one warning and offline instead, and training goes on. The
mode used, and why, is in summary.json (`tracking`). The run id is kept in
`<run dir>/wandb_run_id`, so a resumed job continues its W&B run (docs/tracking.md).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import shutil
import string
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from amp_lab.config import AmpLabConfig, LoggerConfig
from amp_lab.records import HYDRA_DIR, SUMMARY_FILE, WANDB_GROUP_FILE, WANDB_ID_FILE
from amp_lab.tracking.sinks import Record, Sink

log = logging.getLogger(__name__)

METRIC_PREFIXES = ("train", "val", "amp", "throughput", "memory")  # all plotted against `step`
ATTEMPT_LOGS = "online-attempt-logs"  # <run dir>/wandb/: wandb's logs of a failed online init
INIT_TIMEOUT_S = 30.0  # online init gives up after this long (or $WANDB_INIT_TIMEOUT), then offline


def resolve_mode(cfg: LoggerConfig) -> str:
    """logger.mode, replaced by $WANDB_MODE when that is set (unless logger.mode=disabled)."""
    if cfg.mode == "disabled":
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    env = "offline" if env == "dryrun" else env
    return env if env in ("offline", "online", "disabled") else cfg.mode


def credentials() -> str | None:
    """Where wandb would find credentials without asking; None: online init would prompt."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(name):
            return name
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return None
    return ".netrc" if entry and entry[2] else None


def redact(text: str) -> str:
    """The text with the W&B API key (if any) masked, for warnings and reports."""
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


def sweep_group(sweep_dir: Path) -> str:
    """The W&B group of a sweep's jobs: its folder's last two names and a random suffix
    (`2026-11-29/21-30-00-k3x9q2`), stored in the folder by the first job for all the others."""
    path = Path(sweep_dir) / WANDB_GROUP_FILE
    if not path.exists():
        mine = path.with_name(f"{path.name}.{_random_id(8)}")  # this job's own, on any node
        mine.write_text("/".join(path.resolve().parent.parts[-2:]) + f"-{_random_id(6)}\n")
        try:  # a hard link never replaces a file: of jobs starting at once on any node, one wins
            os.link(mine, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins
            os.replace(mine, path)
        mine.unlink(missing_ok=True)
    return path.read_text().strip()


def _random_id(length: int) -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


def run_identity(out_dir: Path, cfg: LoggerConfig) -> tuple[str | None, str]:
    """(group, name): logger.group, else a multirun's sweep_group; the job's overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    group, name = cfg.group, ""
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        name = hydra_cfg.job.override_dirname
        if hydra_cfg.mode == RunMode.MULTIRUN and group is None:
            group = sweep_group(Path(hydra_cfg.runtime.cwd) / hydra_cfg.sweep.dir)
    elif (out_dir / HYDRA_DIR / "overrides.yaml").exists():
        name = ",".join(yaml.safe_load((out_dir / HYDRA_DIR / "overrides.yaml").read_text()) or [])
    return group, name or out_dir.name


def log_file_only(name: str) -> logging.Logger:
    """The logger `name`, writing to the root logger's log files (Hydra's `<run dir>/<job>.log`)
    and never to the terminal."""
    quiet = logging.getLogger(name)
    quiet.propagate = False
    files: list[logging.Handler] = [
        h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
    ]
    quiet.handlers = files or [logging.NullHandler()]  # a job's own file: Hydra sets it per job
    quiet.setLevel(logging.INFO)
    return quiet


def run_id(out_dir: Path) -> str:
    """The W&B run id stored in the run directory; a new one is created and stored if absent."""
    path = out_dir / WANDB_ID_FILE
    if path.exists():
        return path.read_text().strip()
    new_id = _random_id(8)
    path.write_text(new_id + "\n")
    return new_id


class WandbSink(Sink):
    """Logs every record, the resolved config and the summary to one W&B run."""

    def __init__(self, settings: AmpLabConfig, out_dir: Path, mode: str) -> None:
        self.settings, self.out_dir, self.mode = settings, Path(out_dir), mode
        self.requested, self.reason = mode, ""  # self.mode becomes the mode really used
        self.run: Any = None
        self.summary_logged = False
        self.stopped = ""  # why W&B stopped during the run, if it did
        self.wandb: Any = None  # the wandb module, once start() has set it up

    def describe(self) -> Record:
        """The W&B mode asked for, the one used and why they differ (summary.json's `tracking`)."""
        return {
            "wandb_requested": self.requested,
            "wandb_mode": self.mode,
            "wandb_fallback": self.reason or None,
            "wandb_stopped": self.stopped or None,
        }

    def start(self, info: Record) -> None:
        import wandb

        self.wandb = wandb
        s, cfg = self.settings, self.settings.logger
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.mode == "online" and credentials() is None:  # wandb would prompt on a terminal
            self._fall_back("no API key: set WANDB_API_KEY or run `wandb login`")
        group, name = run_identity(self.out_dir, cfg)
        precision = s.precision.name
        kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            group=group,
            job_type=precision,
            name=name,
            tags=[f"model:{s.model.name}", f"precision:{precision}", *cfg.tags, *s.tags],
            config={**asdict(s), "resolved": {k: v for k, v in info.items() if k != "step"}},
            dir=str(self.out_dir),
            id=run_id(self.out_dir),
            resume="allow",
            settings=wandb.Settings(
                init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S)),
                console="off",
                silent=True,  # nothing on the terminal, from wandb or its wandb-core process
                disable_git=True,
                save_code=False,
            ),
        )
        self.run = self._init(wandb, kwargs)
        if self.run is None:
            return
        self.run.define_metric("step")
        self.run.define_metric("time_s", step_metric="step")
        for prefix in METRIC_PREFIXES:
            self.run.define_metric(f"{prefix}/*", step_metric="step")
        if not self.reason:  # a fall-back's warning has already said where the run is
            where = self.run.url if self.mode == "online" else self.run.settings.sync_dir
            log.info("W&B %s run %s: %s", self.mode, self.run.id, where)

    def _fall_back(self, reason: str) -> None:
        log.warning(
            "W&B %s unavailable (%s); logging offline instead, publish later with "
            "`wandb sync %s/wandb/offline-run-*`",
            self.mode,
            reason,
            self.out_dir,
        )
        self.mode, self.reason = "offline", reason

    def _init(self, wandb: Any, kwargs: dict[str, Any]) -> Any:
        kwargs["config"]["logger"]["mode"] = self.mode  # the W&B config tells the mode used
        kwargs["config"]["tracking"] = self.describe()
        before = set((self.out_dir / "wandb").glob("run-*"))
        try:
            # W&B's own analytics follow the process's setup mode, not the run's: offline sends none
            wandb.setup(settings=wandb.Settings(mode=self.mode))
            # wandb's own fall-back for silent mode: its messages to a logger, not to stderr
            wandb.termsetup(wandb.Settings(silent=True), log_file_only(f"{__name__}.wandb"))
            log_file_only("opentelemetry")  # wandb's analytics: a rejected key's export errors
            return wandb.init(mode=self.mode, **kwargs)
        except Exception as err:  # noqa: BLE001 - W&B must never stop training
            message = redact(f"{type(err).__name__}: {err}").splitlines()[0]
            if self.mode == "offline":
                log.warning(
                    "W&B offline init failed (%s); the run is in metrics.jsonl only", message
                )
                self.reason = f"offline init failed: {message}"
                return None
            wandb.teardown()  # the failed run still holds its id in the W&B service
            kept = self.out_dir / "wandb" / ATTEMPT_LOGS
            for stray in set((self.out_dir / "wandb").glob("run-*")) - before:
                # the aborted online attempt's folder goes; its logs (wandb's retries) stay
                if (stray / "logs").is_dir():
                    shutil.rmtree(kept, ignore_errors=True)
                    shutil.move(stray / "logs", kept)
                shutil.rmtree(stray, ignore_errors=True)
            self._fall_back(f"init failed: {message}")
            return self._init(wandb, kwargs)

    def log(self, record: Record) -> None:
        if self.run is None:  # never started, or an earlier record failed
            return
        try:
            self.run.log({k: v for k, v in record.items() if k != "kind"})
        except Exception as err:  # noqa: BLE001 - metrics.jsonl keeps the record anyway
            self.stopped = redact(f"log failed: {err}")
            log.warning("W&B %s; W&B logging stops, metrics.jsonl goes on", self.stopped)
            self.run = None

    def finish(self, summary: Record) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update(summary)
            self.summary_logged = True
        except Exception as err:  # noqa: BLE001 - summary.json keeps the summary anyway
            log.warning("W&B summary failed (%s)", redact(str(err)))

    def flush(self) -> None:
        """wandb cannot flush a run that goes on: the run is finished here, with W&B's own
        summary; should training go on after all, it goes on in metrics.jsonl only."""
        self.close(summary_file=False)

    def close(self, summary_file: bool = True) -> None:
        """Finish the W&B run (after a crash, the crashed summary.json is its summary) and end
        wandb's service, which returns once every record is on disk."""
        run, self.run = self.run, None
        path = self.out_dir / SUMMARY_FILE
        try:  # SLURM's SIGTERM (a preemption) may have ended the W&B service already
            if run is not None:
                if summary_file and not self.summary_logged and path.exists():
                    run.summary.update(json.loads(path.read_text()))
                run.finish(exit_code=0 if self.summary_logged else 1)
        except Exception as err:  # noqa: BLE001 - a failing finish must not break the sweep
            log.warning("W&B finish failed (%s)", redact(str(err)))
            run = None  # one warning is enough
        if self.wandb is None:
            return
        wandb, self.wandb = self.wandb, None
        try:
            wandb.teardown()
        # a dead service: teardown raises, or exits with the service's code, which must not
        # replace the run's own exit; its warning was given when W&B stopped
        except (Exception, SystemExit) as err:  # noqa: BLE001
            if run is not None:
                log.warning("W&B finish failed (%s)", redact(str(err)))


def build_tracking_sinks(settings: AmpLabConfig, out_dir: Path) -> list[Sink]:
    """The W&B sink for this run, or none when W&B is disabled."""
    mode = resolve_mode(settings.logger)
    return [] if mode == "disabled" else [WandbSink(settings, out_dir, mode)]
