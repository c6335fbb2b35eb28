"""One script per speed claim; run each from the repo root as ``python -m benchmarks.NAME``."""
