"""The search's grammar and verdicts, without a run: hydra-optuna-sweeper's own test cases
(plugins/hydra_optuna_sweeper/tests in facebookresearch/hydra) adapted to amp_lab's sweeper, and
how a run's summary.json becomes a trial's state."""

from __future__ import annotations

import json
import math

import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from amp_lab.search.space import SearchError, distribution, split
from amp_lab.search.study import OBJECTIVE, RESULT, objective, outcome, results, verdict
from hydra_plugins.amp_lab_search.search_sweeper import SearchSweeper

PARSER = OverridesParser.create()


def _parsed(*overrides: str):
    return PARSER.parse_overrides(list(overrides))


def test_hydra_discovers_the_sweeper():
    assert SearchSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("key=choice(1,2)", CategoricalDistribution([1, 2])),
        ("key=choice(true, false)", CategoricalDistribution([True, False])),
        ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
        ("key=fp16,bf16", CategoricalDistribution(["fp16", "bf16"])),
        ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2))),
        ("key=range(1,3)", IntDistribution(1, 3)),
        ("key=interval(1, 5)", FloatDistribution(1, 5)),
        ("key=int(interval(1, 5))", IntDistribution(1, 5)),
        ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
        ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
        ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
    ],
)
def test_an_override_becomes_optunas_distribution(override, expected):
    actual = distribution(_parsed(override)[0])
    if isinstance(expected, CategoricalDistribution):  # shuffle() reorders the choices
        assert set(actual.choices) == set(expected.choices)
    else:
        assert actual == expected


@pytest.mark.parametrize(
    "overrides, fixed, space",
    [
        (["key=choice(1,2)"], [], {"key": CategoricalDistribution([1, 2])}),
        (
            ["key1=choice(1,2)", "key2=5", "key3=range(1,3)"],
            ["key2=5"],
            {"key1": CategoricalDistribution([1, 2]), "key3": IntDistribution(1, 3)},
        ),
        (["~z", "key=range(1,3)"], ["~z"], {"key": IntDistribution(1, 3)}),
        # the command line after the config's params: the later override of a key wins
        (
            ["key=range(1,3)", "key=2", "other=interval(0, 1)"],
            ["key=2"],
            {"other": FloatDistribution(0, 1)},
        ),
    ],
)
def test_choice_range_and_interval_are_dimensions_of_one_study(overrides, fixed, space):
    found = split(_parsed(*overrides), study_per=[])
    assert (found.fixed, found.studies, found.distributions) == (fixed, [[]], space)


def test_study_per_keys_open_a_study_per_value():
    found = split(
        _parsed("precision=fp32,bf16", "trainer.seed=range(0,2)", "lr.base=interval(0.1, 1)"),
        study_per=["precision", "trainer.seed"],
    )
    assert found.studies == [
        ["precision=fp32", "trainer.seed=0"],
        ["precision=fp32", "trainer.seed=1"],
        ["precision=bf16", "trainer.seed=0"],
        ["precision=bf16", "trainer.seed=1"],
    ]
    assert list(found.distributions) == ["lr.base"]
    with pytest.raises(SearchError, match="a study_per key takes a list of values"):
        split(_parsed("precision=interval(0, 1)", "x=interval(0, 1)"), study_per=["precision"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["x=1"], r"the search space is empty"),
        # the reason is Optuna's own, worded differently by Optuna 5 and 4
        (["x=interval(2, 1)"], r"x=interval\(2, 1\): (`low <= high` must hold|The `low` value)"),
        (["x=tag(log, interval(0, 1))"], r"(`low > 0` must hold for `log=True`|larger than 0)"),
    ],
)
def test_a_bad_space_is_one_search_error(overrides, message):
    with pytest.raises(SearchError, match=message):
        split(_parsed(*overrides), study_per=[])


def _summary(tmp_path, **fields):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", **fields}))
    return tmp_path


@pytest.mark.parametrize(
    "fields, objective, expected",
    [
        ({"final_val_loss": 0.5}, "final_val_loss", ("COMPLETE", 0.5, "completed")),
        (
            {"final_val_loss": 0.5, "best_val_acc": 0.8},
            "best_val_acc",
            ("COMPLETE", 0.8, "completed"),
        ),
        # a NaN loss is pruned (ranked last), never a FAIL the sampler forgets
        (
            {"final_val_loss": math.nan},
            "final_val_loss",
            ("PRUNED", None, "diverged: final val loss nan"),
        ),
        (
            {"status": "diverged", "diverged": True},
            "final_val_loss",
            ("PRUNED", None, "diverged"),
        ),
        (
            {
                "status": "stopped: pruned by the search at step 4 (val/loss nan)",
                "final_val_loss": math.nan,
            },
            "final_val_loss",
            ("PRUNED", None, "diverged: pruned by the search at step 4 (val/loss nan)"),
        ),
        (
            {"final_val_loss": 0.5, "time_to_target_s": None},
            "time_to_target_s",
            ("PRUNED", None, "missed: time_to_target_s is None"),
        ),
        (
            {"status": "crashed: RuntimeError: boom"},
            "final_val_loss",
            ("FAIL", None, "crashed: RuntimeError: boom"),
        ),
    ],
)
def test_a_runs_summary_becomes_its_trials_state(tmp_path, fields, objective, expected):
    assert outcome(_summary(tmp_path, **fields), None, objective) == expected


def test_a_run_without_summary_crashed_with_its_exception(tmp_path):
    assert outcome(tmp_path, "TypeError: bad", "final_val_loss") == (
        "FAIL",
        None,
        "crashed: TypeError: bad",
    )


def test_the_results_file_is_hydras_for_one_study_and_per_study_for_several():
    one = optuna.create_study(study_name="all")
    one.add_trial(
        optuna.trial.create_trial(
            params={"x": 0.123456}, distributions={"x": FloatDistribution(0, 1)}, value=2.0
        )
    )
    assert results([one]) == {"name": "optuna", "best_params": {"x": 0.1235}, "best_value": 2.0}
    none = optuna.create_study(study_name="precision=fp16")
    assert results([one, none])["studies"]["precision=fp16"] == {
        "best_params": None,
        "best_value": None,
    }


@pytest.mark.parametrize(
    "name, expected",
    [
        ("final_val_loss", ("minimize", "val/loss")),
        ("best_val_acc", ("maximize", "val/acc")),
        ("final_val_acc", ("maximize", "val/acc")),
        ("time_to_target_s", ("minimize", "val/loss")),  # pruned on its loss
        ("steps_to_target", ("minimize", "val/loss")),
    ],
)
def test_an_objective_has_its_direction_and_reports_its_evaluation(name, expected):
    assert objective(name, None) == objective(name, expected[0]) == expected


def _study(objective: str, *told: tuple[str, float | None, str]) -> optuna.Study:
    study = optuna.create_study(study_name="precision=fp16")
    study.set_user_attr(OBJECTIVE, objective)
    for i, (state, value, result) in enumerate(told):
        trial = create_trial(
            params={"lr.base": 0.01 * (i + 1)},
            distributions={"lr.base": FloatDistribution(1e-4, 1)},
            value=value,
            state=TrialState[state],
            user_attrs={RESULT: result},
        )
        study.add_trial(trial)
    return study


CRASH = ("FAIL", None, "crashed: TypeError: bad")
DIVERGED = ("PRUNED", None, "diverged")


@pytest.mark.parametrize(
    "study, expected",
    [
        (
            _study("final_val_loss", ("COMPLETE", 0.5, "completed"), DIVERGED, CRASH),
            "best lr.base=0.01: final_val_loss 0.5 (trial 0; 3 trials: 1 completed, 1 diverged, "
            "1 crashed); trial 2 crashed: TypeError: bad",
        ),
        (
            _study("final_val_loss", DIVERGED, DIVERGED),
            "no trial of 2 finished with a finite final_val_loss (2 diverged): no best setting; "
            "lower the searched ranges' upper bounds",
        ),
        (  # a crash is named before any divergence
            _study("final_val_loss", DIVERGED, CRASH),
            "no trial of 2 finished with a finite final_val_loss (1 diverged, 1 crashed): no best "
            "setting; trial 1 crashed: TypeError: bad: fix that first",
        ),
        (
            _study("steps_to_target", ("PRUNED", None, "missed: steps_to_target is None")),
            "no trial of 1 finished with a finite steps_to_target (1 missed): no best setting; "
            "no run reached trainer.target_acc: lower it or train longer",
        ),
    ],
)
def test_the_verdict_names_the_best_trial_or_why_none_is(study, expected):
    assert verdict(study).startswith(f"search precision=fp16: {expected}")
