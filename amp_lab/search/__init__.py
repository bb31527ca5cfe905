"""The search: an Optuna study per sweep value (e.g. per precision) over a space of settings.

The sweeper (hydra_plugins/amp_lab_search/) asks each study for trials and hands them as
override lists to the configured launcher; `space` checks and draws the settings, `study` reads a
trial's run directory into Optuna's verdict, `trial` lets a running trial report its validation
loss and be pruned. `amp_lab report` reads a search through amp_lab/tools/report/search.py.
"""
