"""What plans and compiles for a TPU slice; run each from the repo root (``python -m tools.X``)."""
