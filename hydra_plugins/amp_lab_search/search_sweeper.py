"""`hydra/sweeper=amp_lab_search`: hydra-optuna-sweeper's interface on today's Optuna, with
pruning, resume and a study per value of the `study_per` keys; trials run by any launcher.

Each round asks every unfinished study for `n_jobs` trials and hands them as one batch to the
configured launcher, which never knows it runs a search. The studies live in `search.journal` in
the sweep folder (or `storage`): the same command with the same `hydra.sweep.dir` resumes
(docs/sweeps.md; the grammar of the space: amp_lab/search/space.py).
"""

# no `from __future__ import annotations`: Hydra runs this module outside sys.modules, where
# dataclasses cannot resolve string annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import MISSING, OmegaConf, open_dict

log = logging.getLogger(__name__)
ALL = "all"  # the name of the one study of a search without study_per or study_name

# hydra/sweeper/sampler=tpe|random|cmaes|gp|qmc: that optuna.samplers class, seeded so that a
# search repeats. TPE's multivariate and constant liar (optuna 5's defaults) pinned on 4.x too:
# warmup and LR are drawn jointly, a round's trials asked before any is told; 4 random trials.
SAMPLERS = ("TPESampler", "RandomSampler", "CmaEsSampler", "GPSampler", "QMCSampler")
TPE = {"n_startup_trials": 4, "multivariate": True, "constant_liar": True}


@dataclass
class PrunerConf:
    """Optuna's MedianPruner: a trial worse than the median of earlier ones at a step stops."""

    enabled: bool = True
    n_startup_trials: int = 3  # trials of a study that finish before any is pruned
    n_warmup_steps: int = 0  # a trial's steps before it may be pruned


@dataclass
class SearchSweeperConf:
    """hydra-optuna-sweeper's settings (docs/sweeps.md says where amp_lab's differ) and amp_lab's
    objective, study_per and pruner; conf/search/lr.yaml fills them for an LR search."""

    _target_: str = "hydra_plugins.amp_lab_search.search_sweeper.SearchSweeper"
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING  # hydra/sweeper/sampler=tpe|random|cmaes|gp|qmc
    objective: str = "final_val_loss"  # the summary.json figure a trial scores (study.OBJECTIVES)
    direction: str | None = None  # minimize | maximize; None: the objective's own
    storage: str | None = None  # an Optuna storage URL; None: search.journal in the sweep dir
    study_name: str | None = None  # None: a study is named by its study_per values, or "all"
    n_trials: int = 8  # per study, in all: a resumed search runs only the ones still missing
    n_jobs: int = 1  # trials of each study launched at once (one batch holds every study's)
    max_failure_rate: float = 0.0  # crashed or refused trials of a round, above it the sweep stops
    params: dict[str, str] | None = None  # the space, as overrides typed before the command's
    custom_search_space: str | None = None  # module.function(cfg, trial) that suggests more
    study_per: list[str] = field(default_factory=list)  # keys whose each value gets a study
    pruner: PrunerConf = field(default_factory=PrunerConf)


ConfigStore.instance().store(
    group="hydra/sweeper", name="amp_lab_search", node=SearchSweeperConf, provider="amp_lab"
)
for _cls in SAMPLERS:
    _node = {"_target_": f"optuna.samplers.{_cls}", "seed": 0, **(TPE if _cls[:3] == "TPE" else {})}
    _name = _cls.removesuffix("Sampler").lower()
    ConfigStore.instance().store(
        name=_name, node=_node, group="hydra/sweeper/sampler", provider="amp_lab"
    )


def _next_job(sweep_dir: Path) -> int:
    """The first job number no earlier launch into this sweep folder used."""
    numbers = [int(m.group(1)) for p in sweep_dir.iterdir() if (m := re.match(r"(\d+)_", p.name))]
    return max(numbers, default=-1) + 1


def _error(ret: JobReturn) -> str | None:
    """A failed job's exception, in one line (its summary.json may say more)."""
    # the exception itself: `return_value` would raise it, printing "Error executing job"
    err = ret._return_value
    line = str(err).strip().partition("\n")[0]
    return f"{type(err).__name__}: {line}" if ret.status == JobStatus.FAILED else None


class SearchSweeper(BasicSweeper):
    """Asks the studies for trials, launches them, tells each study its trials' outcomes."""

    def __init__(self, sampler: Any, **settings: Any) -> None:
        # `sampler` arrives instantiated; each study instantiates its own, seeded, from the config
        self.settings = OmegaConf.merge(OmegaConf.structured(SearchSweeperConf), settings)
        super().__init__(max_batch_size=None, params=self.settings.params or {})

    def sweep(self, arguments: list[str]) -> list[list[JobReturn]]:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.utils import get_method

        from amp_lab.search import study as studies
        from amp_lab.search.space import SearchError, split

        assert self.config is not None and self.hydra_context is not None and self.launcher
        s = self.settings
        if s.n_trials < 1 or s.n_jobs < 1 or not 0 <= s.max_failure_rate <= 1:
            raise SearchError(
                f"hydra.sweeper.n_trials={s.n_trials}, n_jobs={s.n_jobs}, max_failure_rate="
                f"{s.max_failure_rate}: use n_trials, n_jobs >= 1, max_failure_rate in [0, 1]"
            )
        self.direction, report = studies.objective(s.objective, s.direction)
        self.extend = get_method(s.custom_search_space) if s.custom_search_space else None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        space = split(parser.parse_overrides([*self._parse_config(), *arguments]), s.study_per)
        self._check(space.fixed, space.distributions)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        pruner = {k: v for k, v in s.pruner.items() if k != "enabled"} if s.pruner.enabled else None
        # what a trial's run needs to report to its study (trial.py)
        self.where = {"sweep_dir": str(sweep_dir.resolve()), "storage": s.storage}
        self.where |= {"report": report, "pruner": pruner}
        opened = [(axis, self._open(axis, sweep_dir)) for axis in space.studies]
        returns = []
        while batch := self._ask(opened, space.fixed, space.distributions):
            overrides = [job for _, _, job in batch]
            self.validate_batch_is_legal(overrides)
            results = self.launcher.launch(overrides, initial_job_idx=_next_job(sweep_dir))
            failed = []
            for (study, trial, _), ret in zip(batch, results):
                job_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir)
                state, result = studies.tell(
                    study, trial, job_dir, sweep_dir, _error(ret), s.objective
                )
                log.info("%s trial %d: %s", study.study_name, trial.number, result)
                if state == "FAIL":
                    failed.append(
                        f"trial {trial.number} of {study.study_name} {result} ({job_dir})"
                    )
            returns.append(list(results))
            if len(failed) / len(batch) > s.max_failure_rate:
                raise SearchError(
                    f"{failed[0]}; {len(failed)} of the round's {len(batch)} trials failed, more "
                    f"than hydra.sweeper.max_failure_rate={s.max_failure_rate}: fix it and rerun "
                    f"the same command with hydra.sweep.dir={sweep_dir} (finished trials stay)"
                )
        for _, study in opened:
            print(f"amp_lab: {studies.verdict(study)}", file=sys.stderr)
        found = studies.results([study for _, study in opened])
        OmegaConf.save(OmegaConf.create(found), sweep_dir / "optimization_results.yaml")
        return returns

    def _check(self, fixed: list[str], space: dict[str, Any]) -> None:
        """Each end of each range and each choice composed and checked as its job would be, so
        that a bad value is one line before any trial runs."""
        from amp_lab.compose import validate
        from amp_lab.config import ConfigError
        from amp_lab.search.space import SearchError
        from amp_lab.search.study import value_text

        assert self.hydra_context is not None and self.config is not None
        for key, dist in space.items():
            for value in getattr(dist, "choices", None) or (dist.low, dist.high):
                job = [*fixed, f"{key}={value_text(value)}"]
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, job)
                with open_dict(cfg):
                    del cfg["hydra"]
                try:
                    validate(cfg)
                except ConfigError as err:
                    raise SearchError(f"the search draws {job[-1]}: {err}") from None

    def _open(self, axis: list[str], sweep_dir: Path) -> Any:
        """The study of the study_per values `axis` (named after them) in the storage, its
        interrupted trials queued again."""
        import optuna
        from hydra.utils import instantiate

        from amp_lab.search import study as studies

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is ours
        name = ",".join(filter(None, [self.settings.study_name, *axis])) or ALL
        where = studies.storage(sweep_dir, self.settings.storage)
        study = optuna.create_study(
            study_name=name, storage=where, direction=self.direction, load_if_exists=True
        )
        # every study of a launch draws the same random trials (one seed), so the precisions'
        # curves meet at the same points; a resumed search draws anew, or it would replay them
        sampler = self.config.hydra.sweeper.sampler
        seed = {"seed": sampler.seed + len(study.trials)} if sampler.get("seed") is not None else {}
        study.sampler = instantiate(sampler, **seed)
        study.set_user_attr(studies.AXIS, axis)  # the report pairs each study with fp32's
        study.set_user_attr(studies.OBJECTIVE, self.settings.objective)
        if retried := studies.retry_interrupted(study):
            log.info("%s: %d interrupted trial(s) queued again", name, retried)
        return study

    def _ask(
        self, opened: list[tuple[list[str], Any]], fixed: list[str], space: dict[str, Any]
    ) -> list[tuple[Any, Any, list[str]]]:
        """The next batch: up to n_jobs new trials of each study short of n_trials."""
        from amp_lab.search.study import finished, value_text
        from amp_lab.search.trial import env_override

        batch = []
        for axis, study in opened:
            for _ in range(
                min(self.settings.n_jobs, self.settings.n_trials - len(finished(study)))
            ):
                trial = study.ask(space)
                if self.extend:
                    self.extend(self.config, trial)
                drawn = [f"{key}={value_text(value)}" for key, value in trial.params.items()]
                where = {**self.where, "study": study.study_name, "trial": trial.number}
                batch.append((study, trial, [*fixed, *axis, *drawn, env_override(where)]))
        return batch
