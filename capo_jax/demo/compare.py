"""Comparing RL runs on the demo task: paired per-question AUC, fixed buckets, matching.

What the demo and ``studies/grpo_vs_capo/run.py`` report beside AUC-mean
(``docs/algorithms.md``, "Evaluation metrics"), all on the same held-out
questions and evaluation seed for every method:

- ``paired_delta_auc`` (from ``capo_jax.eval.paired``, which the evaluator's
  ``--compare`` shares): the mean over (seed, question) of AUC_A - AUC_B, over
  the questions that are mixed (some right, some wrong) under both methods of
  that seed, with a bootstrap 95% interval that resamples seeds and questions
  (two-way: one question draw shared by the seeds, since the questions are).
- ``difficulty_buckets``: questions grouped by the *warm start's* accuracy on
  them, so every method is scored on the same questions (a method's own
  accuracy buckets would move questions between buckets as it learns).
- ``value_at_accuracy``: a metric read off a run's eval curve where its
  accuracy first reaches a target (linear between evaluations): methods
  compared at matched accuracy, not only at the final step.
- ``NoisyGrader``: a verifier that flips a seeded fraction of rewards (the
  paper's noisy-verifier setting that the noise mask is for).
- ``FalseNegativeGrader``: a verifier that rejects correct answers of one fluent
  form (structured false negatives: the paper's "near misses").

Letters: I seeds (independent runs), Q questions, G samples per question.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from capo_jax.data import rewards as rewards_lib
from capo_jax.eval import calibration

# Re-exported: the demo, its study and studies/grpo_vs_capo/run.py call it from here.
from capo_jax.eval.paired import paired_delta_auc  # noqa: F401  pylint: disable=unused-import

BUCKET_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)

# The methods the demo and its study compare: config overrides of configs/demo.py.
_CAPO = {"algo.name": "capo", "algo.mask": "on"}
_GRPO = {"algo.name": "grpo", "algo.mask": "off"}
# Mask thresholds that mask 10% of the warm start's wrong samples (lowest reference
# perplexity) and 10% of its correct ones (highest): capo_jax/demo/mask.py.
QMASK = {"demo.mask_quantiles": (0.1, 0.9)}
_FNEG = {"demo.false_negative": "negative", "demo.false_negative_rate": 0.5}
VARIANTS: dict[str, dict[str, Any]] = {
  "capo": _CAPO,
  "grpo": _GRPO,
  # The paper's other baselines (docs/algorithms.md), without the mask as in the paper.
  "gspo": {"algo.name": "gspo", "algo.mask": "off"},
  "codapo": {"algo.name": "codapo", "algo.mask": "off"},
  "cde": {"algo.name": "cde", "algo.mask": "off"},
  "simko": {"algo.name": "simko", "algo.mask": "off"},
  # Controls: which part of CAPO does the work, its logistic weights or GRPO's 1/std.
  "dr_grpo": {"algo.name": "dr_grpo", "algo.mask": "off"},
  "capo_tau10": {**_CAPO, "algo.tau": 10.0},  # large tau: Dr.GRPO up to a constant
  "capo_adapt0.5": {**_CAPO, "algo.adaptive_tau": 0.5},
  "capo_adapt1": {**_CAPO, "algo.adaptive_tau": 1.0},
  "capo_adapt2": {**_CAPO, "algo.adaptive_tau": 2.0},
  # The tau study (docs/studies/tau/README.md): the paper's grid {0.4, 0.6, 1.0} relative to the
  # measured spread of s, with its default 0.6 at tau = spread (studies/tau/design.py).
  **{f"capo_rtau{t:g}": {**_CAPO, "algo.adaptive_tau": t / 0.6} for t in (0.4, 0.6, 1.0)},
  # Learning-rate sweep (x the default 1e-4).
  "grpo_lr0.5": {**_GRPO, "optim.lr": 5e-5},
  "grpo_lr2": {**_GRPO, "optim.lr": 2e-4},
  "capo_lr0.5": {**_CAPO, "optim.lr": 5e-5},
  "capo_lr2": {**_CAPO, "optim.lr": 2e-4},
  # The mask: ablations, and a verifier that flips 10% of the training rewards.
  "capo_nomask": {"algo.name": "capo", "algo.mask": "off"},
  "grpo_mask": {"algo.name": "grpo", "algo.mask": "on"},
  "grpo_noise": {**_GRPO, "demo.reward_flip": 0.1},
  "capo_noise": {**_CAPO, "demo.reward_flip": 0.1},
  "capo_nomask_noise": {"algo.name": "capo", "algo.mask": "off", "demo.reward_flip": 0.1},
  # The mask study (docs/studies/mask/README.md): the mask's thresholds at the paper's
  # values or at the reference's perplexity quantiles (QMASK), under the flips above and
  # under structured false negatives (a verifier rejecting half the correct negative answers).
  "capo_qmask_noise": {**_CAPO, **QMASK, "demo.reward_flip": 0.1},
  "grpo_fneg": {**_GRPO, **_FNEG},
  "capo_fneg": {**_CAPO, **_FNEG},
  "capo_qmask_fneg": {**_CAPO, **QMASK, **_FNEG},
  "capo_nomask_fneg": {"algo.name": "capo", "algo.mask": "off", **_FNEG},
  # DAPO's dynamic sampling (rollout.dynamic_sampling), compared at equal wall time.
  "grpo_dyn": {**_GRPO, "rollout.dynamic_sampling": True},
  "capo_dyn": {**_CAPO, "rollout.dynamic_sampling": True},
}


def difficulty_buckets(
  warm_correct_QG: Any, edges: Sequence[float] = BUCKET_EDGES
) -> tuple[np.ndarray, list[str]]:
  """Bucket index per question from the warm start's accuracy, and the labels.

  Bucket i holds accuracies in (edges[i], edges[i + 1]], the first also holds
  edges[0] (0.0: questions the warm start never solves).
  """
  acc_Q = np.asarray(warm_correct_QG, bool).mean(axis=1)
  idx_Q = np.clip(np.searchsorted(np.asarray(edges[1:-1]), acc_Q, side="left"), 0, len(edges) - 2)
  labels = [
    ("[" if i == 0 else "(") + f"{edges[i]:g}, {edges[i + 1]:g}]" for i in range(len(edges) - 1)
  ]
  return idx_Q, labels


def bucket_auc(auc_Q: Any, bucket_Q: np.ndarray, num_buckets: int) -> list[tuple[float, int]]:
  """(AUC-mean, mixed questions) per bucket; NaN where no question is mixed."""
  auc_Q = np.asarray(auc_Q, np.float64)
  out = []
  for i in range(num_buckets):
    sel = (bucket_Q == i) & np.isfinite(auc_Q)
    out.append((float(auc_Q[sel].mean()) if sel.any() else float("nan"), int(sel.sum())))
  return out


def value_at_accuracy(evals: Sequence[dict[str, float]], target: float, key: str) -> float:
  """``key`` where the eval curve's accuracy first reaches ``target``, linear between
  evaluations; NaN when it never does."""
  for prev, cur in zip(evals, evals[1:]):
    a0, a1 = prev["accuracy"], cur["accuracy"]
    if a0 >= target:
      return float(prev[key])
    if a1 >= target:
      frac = (target - a0) / (a1 - a0)
      return float(prev[key] + frac * (cur[key] - prev[key]))
  if evals and evals[-1]["accuracy"] >= target:
    return float(evals[-1][key])
  return float("nan")


def value_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
  """``ys`` linear in ``xs`` (increasing) at ``x``; NaN outside their range."""
  xp, fp = np.asarray(xs, float), np.asarray(ys, float)
  if not len(xp) or x < xp[0] or x > xp[-1]:
    return float("nan")
  return float(np.interp(x, xp, fp))


def summary(
  s_QG: np.ndarray, correct_QG: np.ndarray, bucket_Q: np.ndarray, num_buckets: int
) -> dict[str, Any]:
  """The headline numbers of one evaluation, on fixed buckets."""
  auc_Q = calibration.auc_per_question(s_QG, correct_QG)
  used = np.isfinite(auc_Q)
  return dict(
    accuracy=float(correct_QG.mean()),
    auc_mean=float(auc_Q[used].mean()) if used.any() else float("nan"),
    pooled_auc=calibration.pooled_auc(s_QG, correct_QG),
    aurc=calibration.aurc(s_QG, correct_QG),
    buckets=bucket_auc(auc_Q, bucket_Q, num_buckets),
  )


def _content_rng(
  seed: int, completions: Sequence[str], golds: Sequence[str]
) -> np.random.Generator:
  """A generator seeded by (seed, the batch's completions and golds): a resumed run that
  redraws the same samples gets the same verdicts."""
  h = hashlib.sha256(str(seed).encode())
  for c, g in zip(completions, golds):
    h.update(c.encode() + b"\0" + g.encode() + b"\1")
  return np.random.default_rng(int.from_bytes(h.digest()[:8], "little"))


class NoisyGrader:
  """Wraps a grader and flips each reward with probability ``flip_prob``.

  The flips are a function of (seed, the batch's completions and golds), so a
  resumed run that redraws the same samples gets the same flips. ``score``
  returns the flipped rewards and the wrapped grader's health counters (which
  describe the true verdicts).
  """

  def __init__(self, grader: Any, flip_prob: float, seed: int = 0):
    if not 0.0 <= flip_prob < 0.5:
      raise ValueError(f"NoisyGrader: flip_prob={flip_prob} must be in [0, 0.5)")
    self.grader, self.flip_prob, self.seed = grader, flip_prob, seed

  def score(self, completions: Sequence[str], golds: Sequence[str]) -> tuple[np.ndarray, Any]:
    rewards, health = self.grader.score(completions, golds)
    flip = _content_rng(self.seed, completions, golds).random(len(rewards)) < self.flip_prob
    return np.where(flip, 1.0 - rewards, rewards).astype(np.float32), health


# Structured false negatives: the forms of a correct answer the faulty verifier rejects.
FALSE_NEGATIVE_FORMS = ("", "negative")


def false_negative_form(completion: str, form: str) -> bool:
  """Whether ``completion``'s final boxed answer is written in ``form``: "negative" is a
  leading minus sign (``\\boxed{-7}``, and ``\\boxed{-0}``: the parser's fault is the
  sign, whatever the value)."""
  if form not in FALSE_NEGATIVE_FORMS[1:]:
    raise ValueError(
      f"false_negative_form: form={form!r}, expected one of {FALSE_NEGATIVE_FORMS[1:]}"
    )
  answer = rewards_lib.extract_boxed(completion)
  return answer is not None and answer.strip().startswith("-")


class FalseNegativeGrader:
  """Wraps a grader and rejects correct answers written in ``form``, each with
  probability ``rate`` (training rewards only: the held-out evaluation keeps the true
  grader). Wrong answers, and correct answers in other forms, keep their verdict.

  Why negative answers: they are the toy's analogue of the paper's near misses (a
  correct fraction written as a decimal that the verifier fails to match): a fluent,
  correct form that a parser which mishandles a leading minus rejects. Why a rate and
  not every such answer: in the paper the policy writes the same value in an accepted
  and a rejected form, so a group holds both and the rejected ones get a negative
  advantage. Here the policy has one form per value, so rejecting every correct
  negative answer would only make those questions' groups all-wrong (zero advantage,
  no gradient, nothing for a mask to do); rejecting each with probability ``rate`` is
  the reward process of a policy that writes the rejected form ``rate`` of the time.
  The rejections are seeded by (seed, the batch's content), as ``NoisyGrader``'s flips.
  """

  def __init__(self, grader: Any, form: str, rate: float = 0.5, seed: int = 0):
    if form not in FALSE_NEGATIVE_FORMS[1:]:
      raise ValueError(
        f"FalseNegativeGrader: form={form!r}, expected one of {FALSE_NEGATIVE_FORMS[1:]}"
      )
    if not 0.0 < rate <= 1.0:
      raise ValueError(f"FalseNegativeGrader: rate={rate} must be in (0, 1]")
    self.grader, self.form, self.rate, self.seed = grader, form, rate, seed

  def score(self, completions: Sequence[str], golds: Sequence[str]) -> tuple[np.ndarray, Any]:
    rewards, health = self.grader.score(completions, golds)
    in_form = np.array([false_negative_form(c, self.form) for c in completions], bool)
    draw = _content_rng(self.seed, completions, golds).random(len(rewards)) < self.rate
    reject = in_form & draw & (np.asarray(rewards) > 0.5)
    return np.where(reject, 0.0, rewards).astype(np.float32), health


def training_grader(
  grader: Any,
  *,
  reward_flip: float = 0.0,
  false_negative: str = "",
  false_negative_rate: float = 0.5,
  seed: int = 0,
) -> Any:
  """``grader`` with the demo's training-only verifier faults (None: none asked):
  structured false negatives first, then random flips of what that verifier says."""
  if false_negative not in FALSE_NEGATIVE_FORMS:
    raise ValueError(
      f"config.demo.false_negative={false_negative!r}: expected one of {FALSE_NEGATIVE_FORMS}"
    )
  if not false_negative and reward_flip <= 0:
    return None
  if false_negative:
    grader = FalseNegativeGrader(grader, false_negative, false_negative_rate, seed=seed)
  if reward_flip > 0:
    grader = NoisyGrader(grader, reward_flip, seed=seed)
  return grader
