"""``python -m capo_jax.eval``: the evaluator's command line."""

from capo_jax.eval import evaluate

if __name__ == "__main__":
  evaluate.cli()
