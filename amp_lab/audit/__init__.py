"""The precision audit: the first training step of each start of a run, observed (gemm_flops.py,
observe.py), its parts read after it (record.py), judged against the mode's promise
(promises.py), its GEMM FLOPs summed per dtype (coverage.py), recorded and acted on (audit.py).
`amp_lab audit` (amp_lab/tools/audit.py) runs it alone."""
