"""Pure-functional JAX port of the Qwen2 / Qwen2.5 architecture."""
