"""Where a run's records go: the sink interface, the console, metrics.jsonl and W&B."""
