"""Calibration on questions whose prompt carries a misleading cue (host-side NumPy).

A *trap* is a question whose prompt suggests a wrong answer (a decoy); a policy
that learned to trust the cue copies it, and may copy it as confidently as it
answers right, a failure AUC-mean hides: once every sample of a trap is wrong
the question has no AUC and drops out of the mean. What the cued studies report
(``studies/cued_bandit``, ``studies/cued``), from per-sample scores ``s_QG``,
correctness ``correct_QG``, ``copy_QG`` (the sample answered the cue) and the
trap flags ``trap_Q``:

- ``accuracy``; ``auc_mean`` over the ``mixed`` questions (how many it averages);
  ``pooled_auc`` (one AUC over every sample: all-wrong questions count);
- ``confidently_wrong``: the share of questions whose samples are all wrong and
  whose mean probability ``exp(s)`` is at least ``confident`` (1/2 by default: the
  policy puts most of its mass on wrong answers and never samples the truth);
- on cued questions: ``cued_accuracy``; on traps: ``trap_accuracy``, ``trap_auc``
  (pooled over the trap samples), ``decoy_copied`` (share of trap samples that
  answer the cue) and ``trap_gap``: mean s of the decoy copies minus mean s of
  the correct answers (> 0: the policy is surer of the shortcut than of the truth;
  NaN without a copy or without a correct trap sample).

AUCs are ``capo_jax.eval.calibration``'s (ties count 1/2). Letters: Q questions,
G samples per question.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from capo_jax.eval import calibration

# What every cued report shows beside AUC-mean (issue 43, item 3).
SUMMARY_KEYS = ("accuracy", "auc_mean", "mixed", "pooled_auc", "confidently_wrong")
TRAP_KEYS = ("cued_accuracy", "trap_accuracy", "trap_auc", "decoy_copied", "trap_gap")


def _mean(x: np.ndarray) -> float:
  return float(x.mean()) if x.size else float("nan")


def confidently_wrong(s_QG: Any, correct_QG: Any, confident: float = 0.5) -> float:
  """Share of questions with every sample wrong and mean ``exp(s)`` >= ``confident``."""
  s_QG, correct_QG = np.asarray(s_QG, np.float64), np.asarray(correct_QG, bool)
  sure_Q = np.exp(s_QG).mean(axis=1) >= confident
  return _mean(~correct_QG.any(axis=1) & sure_Q)


def summary(s_QG: Any, correct_QG: Any, confident: float = 0.5) -> dict[str, float]:
  """``SUMMARY_KEYS``: accuracy, AUC-mean and its mixed questions, pooled AUC and the
  confidently-wrong share; for any task, traps or not."""
  s_QG, correct_QG = np.asarray(s_QG, np.float64), np.asarray(correct_QG, bool)
  auc_mean, mixed = calibration.auc_mean(s_QG, correct_QG)
  return {
    "accuracy": _mean(correct_QG),
    "auc_mean": auc_mean,
    "mixed": float(mixed),
    "pooled_auc": calibration.pooled_auc(s_QG, correct_QG),
    "confidently_wrong": confidently_wrong(s_QG, correct_QG, confident),
  }


def heldout_metrics(
  s_QG: Any, correct_QG: Any, copy_QG: Any, trap_Q: Any, *, confident: float = 0.5
) -> dict[str, float]:
  """``SUMMARY_KEYS`` and ``TRAP_KEYS`` (the module docstring). A copy on a cued
  question (where the cue is right) is a correct answer, not a copy."""
  s_QG, correct_QG = np.asarray(s_QG, np.float64), np.asarray(correct_QG, bool)
  copy_QG, trap_Q = np.asarray(copy_QG, bool), np.asarray(trap_Q, bool)
  if (
    s_QG.ndim != 2
    or correct_QG.shape != s_QG.shape
    or copy_QG.shape != s_QG.shape
    or trap_Q.shape != s_QG.shape[:1]
  ):
    raise ValueError(
      f"traps.heldout_metrics: s_QG {s_QG.shape}, correct_QG {correct_QG.shape}, copy_QG "
      f"{copy_QG.shape}, trap_Q {trap_Q.shape} do not fit [Q, G], [Q]"
    )
  trap_s, trap_c = s_QG[trap_Q], correct_QG[trap_Q]
  copy_QG = copy_QG & trap_Q[:, None]
  return {
    **summary(s_QG, correct_QG, confident),
    "cued_accuracy": _mean(correct_QG[~trap_Q]),
    "trap_accuracy": _mean(trap_c),
    "trap_auc": calibration.pooled_auc(trap_s, trap_c) if trap_s.size else float("nan"),
    "decoy_copied": _mean(copy_QG[trap_Q]),
    "trap_gap": _mean(s_QG[copy_QG]) - _mean(trap_s[trap_c]),
  }
