"""The search: an Optuna study per sweep value (e.g. per precision) over a space of settings;
`space` checks and draws the settings, `study` reads a trial's run directory into Optuna's
verdict, `trial` lets a running trial report its validation loss and be pruned."""
