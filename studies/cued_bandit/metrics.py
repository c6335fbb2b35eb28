"""What the cued-bandit study measures on held-out questions (host-side NumPy).

Held-out questions are half traps; each gets G samples. From the samples' answers,
scores s = log pi(a) and correctness:

- accuracy; AUC-mean (per-question AUC of s against correctness, over the mixed
  questions, and how many there are); pooled AUC (one AUC over every sample);
- on cued questions: accuracy; on traps: accuracy, trap AUC (pooled over the trap
  samples), decoy copies (share of trap samples that answer the cue), and the
  confidence gap: mean s of the decoy copies minus mean s of the correct answers
  (> 0: the policy is surer of the shortcut than of the truth);
- confidently wrong: the share of questions whose samples are all wrong and whose
  mean probability exp(s) is at least ``confident`` (1/2 by default: the policy puts
  most of its mass on one wrong answer and never samples the truth).

AUCs use ``capo_jax.eval.calibration`` (ties count 1/2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from capo_jax.eval import calibration


def _mean(x: np.ndarray) -> float:
  return float(x.mean()) if x.size else float("nan")


def heldout_metrics(
  a_QG: Any, s_QG: Any, cue_Q: Any, trap_Q: Any, *, confident: float = 0.5
) -> dict[str, float]:
  """The metrics above for answers ``a_QG`` (0 = true answer), scores ``s_QG``, the
  cued answer ``cue_Q`` and the trap flags ``trap_Q`` of Q questions."""
  a_QG, s_QG = np.asarray(a_QG), np.asarray(s_QG, np.float64)
  cue_Q, trap_Q = np.asarray(cue_Q), np.asarray(trap_Q, bool)
  q_shape = a_QG.shape[:1]
  if (
    a_QG.shape != s_QG.shape
    or a_QG.ndim != 2
    or cue_Q.shape != q_shape
    or (trap_Q.shape != q_shape)
  ):
    raise ValueError(
      f"heldout_metrics: a_QG {a_QG.shape}, s_QG {s_QG.shape}, cue_Q "
      f"{cue_Q.shape}, trap_Q {trap_Q.shape} do not fit [Q, G], [Q]"
    )
  correct_QG = a_QG == 0
  auc_mean, mixed = calibration.auc_mean(s_QG, correct_QG)
  trap_s, trap_c = s_QG[trap_Q], correct_QG[trap_Q]
  copy_QG = trap_Q[:, None] & (a_QG == cue_Q[:, None])
  all_wrong_Q = ~correct_QG.any(axis=1)
  sure_Q = np.exp(s_QG).mean(axis=1) >= confident
  return {
    "accuracy": _mean(correct_QG),
    "auc_mean": auc_mean,
    "mixed": mixed,
    "pooled_auc": calibration.pooled_auc(s_QG, correct_QG),
    "cued_accuracy": _mean(correct_QG[~trap_Q]),
    "trap_accuracy": _mean(trap_c),
    "trap_auc": calibration.pooled_auc(trap_s, trap_c) if trap_s.size else float("nan"),
    "decoy_copied": _mean(copy_QG[trap_Q]),
    "trap_gap": _mean(s_QG[copy_QG]) - _mean(trap_s[trap_c]),
    "confidently_wrong": _mean(all_wrong_Q & sure_Q),
  }
