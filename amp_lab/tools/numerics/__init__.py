"""The divergence finder, `amp_lab numerics` (docs/diagnostics.md). It drives builds, so it
stands above amp_lab/build.py, not in amp_lab/diagnostics/, which the build uses."""
