"""Precision modes: the mode table and policy, loss scalers, master weights, fp8, fp32 modules."""
