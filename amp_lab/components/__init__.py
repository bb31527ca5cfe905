"""The run's building blocks: data, models, optimizers, LR schedules, metrics, the DDP world."""
