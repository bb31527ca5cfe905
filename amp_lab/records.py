"""The names of the files in a run directory, defined once.

The runner writes them, the checkpointer cuts them back or sets them aside, the W&B sink, the
report, the doctor and the sweep callback read them: every one imports its names from here.
"""

from __future__ import annotations

METRICS_FILE = "metrics.jsonl"  # one JSON record per log step and per evaluation
DIAGNOSTICS_FILE = "diagnostics.jsonl"  # the numerics probes' per-layer details
SUMMARY_FILE = "summary.json"  # the run's results; its `status` says how the run ended
AUDIT_FILE = "precision_audit.json"  # what the first step (of each start) computed in, judged
SETTINGS_FILE = "settings.json"  # the run's settings, flat: a resume or a rerun is compared to it
WANDB_ID_FILE = "wandb_run_id"  # the W&B run's id: a resumed job logs to the same W&B run
WANDB_GROUP_FILE = "wandb_group"  # in a sweep folder: its W&B group, the same for every job
SEARCH_FILE = "search.journal"  # a search's Optuna studies, in its sweep folder (amp_lab/search/)
REFUSED_FILE = "refused.txt"  # a sweep job amp_lab refused at start-up: `job N: reason`
CHECKPOINT_DIR = "checkpoints"  # step_NNNNNNNNN.pt, see amp_lab/checkpoint/store.py
HYDRA_DIR = ".hydra"  # Hydra's record of the job: config.yaml, overrides.yaml
RECORD_FILES = (METRICS_FILE, DIAGNOSTICS_FILE)  # cut back to the step a run resumes at
