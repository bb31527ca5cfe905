"""The one judge: every verdict about a run, and about a run against its reference.

rules.py is the table of facts a run states about itself (unstable, underflow, stalled, diverged,
...), monitor.py feeds it from one per-step device buffer and decides when a run must stop, and
compare.py decides what a difference between runs is worth against the seeds' noise. summary.json,
the console, the report and the doctor read their findings; none restates a threshold, all of
which live in the schema (`health.*`, amp_lab/config.py HealthConfig).
"""
