"""Numerics: the device counters, diagnostics, run health, the module probe, gradient and
optimizer-state statistics, scale events, the pitfall lab."""
