"""amp_lab: a lab for mixed-precision training: Hydra configs, sweeps, diagnostics, reports."""

__version__ = "0.1.0"
