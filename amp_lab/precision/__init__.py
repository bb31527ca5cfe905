"""Precision modes: the mode table and policy, loss scalers (and GradScaler's internals, read in
one place), master weights, optimizer-state dtypes, fp8, fp32 modules."""
