"""What plans and compiles for a TPU slice; run each from the repo root as ``python -m tools.NAME``."""
