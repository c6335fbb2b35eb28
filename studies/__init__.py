"""Studies built on capo_jax (they import it; capo_jax never imports them)."""
