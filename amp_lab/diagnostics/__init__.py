"""What watches a training step's numbers, per layer: the observer behind `diagnostics=`
(observer.py), the module probe, gradient and optimizer-state statistics, scale events, early
signals; and the pitfall lab, which breaks a step on purpose (pitfalls.py)."""
