"""Benchmarks that print numbers: `python -m tpguard.bench.<name>` (speed is shown here, never by timed tests)."""
