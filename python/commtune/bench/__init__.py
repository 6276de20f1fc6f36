"""Library code behind benchmarks/: shared timing, environment and results helpers."""
