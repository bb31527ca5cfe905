"""The divergence finder (`amp_lab numerics`): one batch through the same weights in two builds
(capture.py), every module's error against the band its dtype explains (bands.py, compare.py),
the builds and their references (find.py), weights over training steps (weight_drift.py); the
command (cli.py, error_plot.py). It drives builds, so it stands above amp_lab/build.py, not in
amp_lab/diagnostics/, which the build uses."""
