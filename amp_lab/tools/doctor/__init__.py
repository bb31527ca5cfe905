"""`amp_lab doctor`: probes a failing config, names why it fails, recommends and verifies a fix."""
