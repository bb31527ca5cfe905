"""Numerics: diagnostics, the module probe, gradient statistics, scale events, the pitfall lab."""
