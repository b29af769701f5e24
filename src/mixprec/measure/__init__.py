"""Measuring candidates on the real training step: runner, isolation, sweep, FLOPs."""
