"""The one judge: rules.py (what a run states about itself), monitor.py (fed by every step, decides
when a run stops) and compare.py (what a difference between runs is worth); thresholds live in
the schema's `health.*`.
"""
