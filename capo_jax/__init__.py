"""capo-jax: Calibration-Aware Policy Optimization for reasoning LLMs, in JAX."""

__version__ = "0.1.0"
