"""What the paper reports: accuracy, per-question AUC, precision-coverage, confidence scaling.

``python -m capo_jax.eval`` is the evaluator's command line (``capo_jax.eval.evaluate``).
"""

from capo_jax.eval.comparison import compare
from capo_jax.eval.evaluate import EvalConfig, EvalPolicy, evaluate_policy
from capo_jax.eval.report import compute_results, load_results

__all__ = [
  "EvalConfig",
  "EvalPolicy",
  "compare",
  "compute_results",
  "evaluate_policy",
  "load_results",
]
