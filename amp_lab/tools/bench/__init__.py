"""`amp_lab bench`: the runner's overhead against a bare loop, and throughput per model x mode."""
