"""The demo's sampled evaluation of a policy: G answers per question, then the sums.

``evaluate_policy`` samples G answers per held-out question with the project's
evaluator (``capo_jax.eval.evaluate``) and reports mean@G accuracy, AUC-mean of the
confidence score (mean token log-prob), the mean per-token entropy and the mean
completion length; ``DemoSampling`` says how it samples, ``completion_budget`` how
many tokens a completion may take. The warm start's validation and the demo's
held-out metrics both use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from capo_jax.data.tokenizer import Tokenizer
from capo_jax.demo import tasks
from capo_jax.demo.task import Example
from capo_jax.eval import calibration, evaluate


@dataclasses.dataclass(frozen=True)
class DemoSampling:
  """How ``evaluate_policy`` samples the demo's questions.

  Attributes:
    num_samples: answers per question (G).
    max_new_tokens: completion budget; None: ``completion_budget`` of the questions.
    temperature: sampling temperature.
    batch_questions: at most this many questions per sampler call (rows = that x G);
      the questions are split into equal batches.
    progress: show a progress bar.
  """

  num_samples: int = 16
  max_new_tokens: int | None = None
  temperature: float = 1.0
  batch_questions: int = 128
  progress: bool = False


def evaluate_policy(
  policy: evaluate.EvalPolicy,
  examples: list[Example],
  sampling: DemoSampling = DemoSampling(),
  rng: jax.Array | None = None,
) -> dict[str, Any]:
  """Samples ``sampling.num_samples`` answers per question with the project's evaluator
  and sums up.

  Returns a dict: ``accuracy`` (mean@G), ``auc_mean`` and ``auc_n_used``
  (per-question ROC-AUC of s against correctness, ties 1/2; all-right or
  all-wrong questions skipped),
  ``entropy`` (mean per-token entropy of the policy over its generated
  tokens, as its unbiased sample estimate: the mean of -log pi(token)),
  ``mean_length`` (tokens, stop token included), ``truncated`` (fraction of
  samples that used all ``max_new_tokens``), and per sample, grouped by
  question: ``s`` [Q, G] (mean token log-prob), ``correct`` [Q, G] (bool),
  ``lengths`` [Q, G] and ``completions`` (Q*G texts).
  """
  if not examples:
    raise ValueError("evaluate_policy: no examples")
  rng = jax.random.key(0) if rng is None else rng
  max_new_tokens = sampling.max_new_tokens
  if max_new_tokens is None:
    max_new_tokens = completion_budget(policy.tokenizer, examples)
  # Equal batches (200 questions -> 2 x 100, not 128 + 72 padded to 128).
  n_batches = -(-len(examples) // sampling.batch_questions)
  eval_cfg = evaluate.EvalConfig(
    num_samples=sampling.num_samples,
    max_new_tokens=max_new_tokens,
    temperature=sampling.temperature,
    batch_size=-(-len(examples) // n_batches),
    progress=sampling.progress,
  )
  # The cued task's checker for its bare answers; None: the math grader.
  grader = tasks.grader(examples)
  records = evaluate.evaluate_policy(
    policy, examples, eval_cfg, rng, benchmark="demo", grader=grader
  )
  Q, G = len(examples), sampling.num_samples
  s_QG = np.array([r.s for r in records], np.float64).reshape(Q, G)
  correct_QG = np.array([r.correct for r in records], bool).reshape(Q, G)
  lengths_QG = np.array([r.length for r in records], np.int64).reshape(Q, G)
  auc, n_used = calibration.auc_mean(s_QG, correct_QG)
  return dict(
    accuracy=float(correct_QG.mean()),
    auc_mean=auc,
    auc_n_used=n_used,
    entropy=float(-(s_QG * lengths_QG).sum() / max(lengths_QG.sum(), 1)),
    mean_length=float(lengths_QG.mean()),
    truncated=float((lengths_QG >= max_new_tokens).mean()),
    s=s_QG,
    correct=correct_QG,
    lengths=lengths_QG,
    completions=[r.completion for r in records],
  )


def completion_budget(tokenizer: Tokenizer, examples: list[Example], slack: int = 8) -> int:
  """max_new_tokens: the longest gold solution plus EOS, plus ``slack``."""
  return max(len(tokenizer.encode(ex.meta["solution"])) for ex in examples) + 1 + slack
