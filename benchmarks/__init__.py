"""Benchmarks of grpo-lightning; run them as scripts, e.g. ``python benchmarks/phase_time.py``."""
