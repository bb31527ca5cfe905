"""Numerics: diagnostics, the module probe, gradient and optimizer-state statistics, scale
events, early signals, the pitfall lab."""
