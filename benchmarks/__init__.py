"""What measures the lab and its tools, outside the shipped package: the runner's overhead and
throughput beside the repo-only parts (bench.py: `make bench`), the doctor on its fixed and drawn
failure cases (doctor_suite.py: `make doctor-bench`), the early warnings' lead time
(lead_time.py: `make warnings-bench`), amp_lab against timm's own train.py (peer.py), and the
finder's training/inference mismatch (engine_mismatch.py). Dated results: results/."""
