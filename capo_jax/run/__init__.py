"""The run's orchestration: the typed run description, the training loop, its set-up,
evaluation during training, the one builder of a step's programs and their
ahead-of-time compile. It sits above ``capo_jax.rl`` and ``capo_jax.eval``."""
