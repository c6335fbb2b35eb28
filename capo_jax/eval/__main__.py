"""``python -m capo_jax.eval``: the evaluator's command line."""

from capo_jax.eval import cli

if __name__ == "__main__":
  cli.cli()
