"""`hydra/sweeper=amp_lab_search`: an Optuna study per sweep value, trials run by any launcher.

`amp_lab -m +search=lr precision=fp32,fp16,bf16` opens one study per precision (a sweep
override's values name the studies; `key=value` overrides hold for every trial). Each round asks
every unfinished study for `n_jobs` trials and hands them as one batch of override lists to the
configured launcher (basic, submitit_local, submitit_slurm): the launcher never knows it runs a
search. The studies live in `search.journal` in the sweep folder, so a rerun of the same command
with the same `hydra.sweep.dir` resumes. hydra-optuna-sweeper pins optuna < 3, prunes nothing
and runs one study per sweep: this is the thin layer the lab needs over current Optuna.
"""

# no `from __future__ import annotations`: Hydra runs this module outside sys.modules, where
# dataclasses cannot resolve string annotations

import itertools
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
ALL = "all"  # the one study of a search that sweeps no setting


@dataclass
class PrunerConf:
    """Optuna's MedianPruner: a trial whose validation loss at an evaluation is worse than the
    median of earlier trials' at the same step stops there."""

    enabled: bool = True
    n_startup_trials: int = 3  # trials of a study that finish before any is pruned
    n_warmup_steps: int = 0  # a trial's steps before it may be pruned


@dataclass
class SearchSweeperConf:
    """The search's settings (conf/search/lr.yaml fills them for an LR search)."""

    _target_: str = "hydra_plugins.amp_lab_search.search_sweeper.SearchSweeper"
    n_trials: int = 8  # per study; a resumed search runs only the ones still missing
    n_jobs: int = 1  # trials of each study launched at once (one batch holds every study's)
    seed: int = 0  # the sampler's seed
    n_startup_trials: int = 4  # TPE: random trials before its model of the loss takes over
    space: dict[str, Any] = field(default_factory=dict)  # {lr: {base: {low, high, log}}}
    # overrides a study config carries, as if typed first on the command line: {precision:
    # "fp32,fp16,bf16"} opens a study per precision (BasicSweeper's `params`)
    params: dict[str, str] = field(default_factory=dict)
    pruner: PrunerConf = field(default_factory=PrunerConf)


ConfigStore.instance().store(
    group="hydra/sweeper", name="amp_lab_search", node=SearchSweeperConf, provider="amp_lab"
)


def _split(arguments: list[str], parser: Any) -> tuple[list[str], list[list[str]], set[str]]:
    """(overrides every trial gets, one override list per study, the keys fixed for all); of two
    overrides of one key the later wins (the command line over the config's params)."""
    from amp_lab.search.space import SearchError

    last = {override.get_key_element(): override for override in parser.parse_overrides(arguments)}
    fixed, axes, keys = [], [], set()
    for key, override in last.items():
        if not override.is_sweep_override():
            fixed.append(f"{key}={override.get_value_element_as_str()}")
            keys.add(override.key_or_group)
        elif override.is_discrete_sweep():
            axes.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            raise SearchError(
                f"{override.input_line}: a search draws ranges from hydra.sweeper.space; "
                "list values (a,b,c) name one study each"
            )
    return fixed, [list(c) for c in itertools.product(*axes)], keys


def _next_job(sweep_dir: Path) -> int:
    """The first job number no earlier launch into this sweep folder used."""
    numbers = [int(m.group(1)) for p in sweep_dir.iterdir() if (m := re.match(r"(\d+)_", p.name))]
    return max(numbers, default=-1) + 1


class SearchSweeper(BasicSweeper):
    """Asks the studies for trials, launches them, tells each study its trials' outcomes (its
    setup, the launcher and the `params` overrides are BasicSweeper's)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = OmegaConf.structured(SearchSweeperConf(**settings))
        super().__init__(max_batch_size=None, params=self.settings.params)

    def sweep(self, arguments: list[str]) -> list[list[JobReturn]]:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from amp_lab.search import study as studies
        from amp_lab.search.space import SearchError, parse_space

        assert self.config is not None and self.hydra_context is not None and self.launcher
        s = self.settings
        if s.n_trials < 1 or s.n_jobs < 1:
            raise SearchError(f"hydra.sweeper.n_trials={s.n_trials}, n_jobs={s.n_jobs}: use >= 1")
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        fixed, axes, keys = _split([*self._parse_config(), *arguments], parser)
        space = parse_space(OmegaConf.to_container(s.space), keys)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        opened = [(axis, self._open(axis, sweep_dir)) for axis in axes]
        returns = []
        while batch := self._ask(opened, fixed, space, sweep_dir):
            overrides = [job for _, _, job in batch]
            self.validate_batch_is_legal(overrides)
            results = self.launcher.launch(overrides, initial_job_idx=_next_job(sweep_dir))
            for (study, trial, _), ret in zip(batch, results):
                job_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir)
                result = studies.tell(study, trial, job_dir, sweep_dir, _error(ret))
                log.info("%s trial %d: %s", study.study_name, trial.number, result)
            returns.append(list(results))
        for _, study in opened:
            print(f"amp_lab: {studies.verdict(study)}", file=sys.stderr)
        return returns

    def _open(self, axis: list[str], sweep_dir: Path) -> Any:
        """The study of the sweep values `axis` (named after them) in the sweep folder's journal,
        its interrupted trials queued again."""
        import optuna

        from amp_lab.search import study as studies

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is ours
        name = ",".join(axis) or ALL
        study = optuna.create_study(
            study_name=name, storage=studies.storage(sweep_dir), load_if_exists=True
        )
        # every study of a launch draws the same random trials (one seed), so the precisions'
        # curves meet at the same LRs; a resumed search draws anew, or it would replay them
        study.sampler = optuna.samplers.TPESampler(
            seed=self.settings.seed + len(study.trials),
            n_startup_trials=self.settings.n_startup_trials,
        )
        study.set_user_attr(studies.AXIS, axis)  # the report pairs each study with fp32's
        if retried := studies.retry_interrupted(study):
            log.info("%s: %d interrupted trial(s) queued again", name, retried)
        return study

    def _ask(
        self,
        opened: list[tuple[list[str], Any]],
        fixed: list[str],
        space: dict[str, Any],
        sweep_dir: Path,
    ) -> list[tuple[Any, Any, list[str]]]:
        """The next batch: up to n_jobs new trials of each study short of n_trials."""
        from amp_lab.search.space import override
        from amp_lab.search.study import finished
        from amp_lab.search.trial import env_override

        pruner = self.settings.pruner
        median = {key: value for key, value in pruner.items() if key != "enabled"}
        batch = []
        for axis, study in opened:
            todo = self.settings.n_trials - len(finished(study))
            for _ in range(min(self.settings.n_jobs, todo)):
                trial = study.ask(space)
                job = [*fixed, *axis, *(override(key, trial.params[key]) for key in space)]
                if pruner.enabled:
                    job.append(env_override(study.study_name, trial.number, sweep_dir, median))
                batch.append((study, trial, job))
        return batch


def _error(ret: JobReturn) -> str | None:
    """A failed job's exception, in one line (its summary.json may say more)."""
    if ret.status != JobStatus.FAILED:
        return None
    # the exception itself: `return_value` would raise it and print "Error executing job" for
    # every pruned trial
    err = ret._return_value
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
