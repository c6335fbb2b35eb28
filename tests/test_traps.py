"""Trap metrics (capo_jax/eval/traps.py) against a hand-computed case and sklearn."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from capo_jax.eval import traps

# 4 questions x 3 samples; q2 and q3 are traps. correct / copied the decoy / s:
C_QG = np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0]], bool)
COPY_QG = np.array([[1, 0, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]], bool)  # q0: cue is right
S_QG = np.array([[-0.2, -1.5, -0.2], [-0.9, -0.9, -2.0], [-0.3, -1.2, -0.5], [-0.1, -0.1, -0.4]])
TRAP_Q = np.array([False, False, True, True])


def test_metrics_by_hand():
  got = traps.heldout_metrics(S_QG, C_QG, COPY_QG, TRAP_Q)
  assert got["accuracy"] == pytest.approx(3 / 12)
  # Mixed: q0 (correct -0.2, -0.2 above the wrong -1.5: AUC 1) and q2 (the correct -1.2
  # below both wrong -0.3, -0.5: AUC 0); q1 and q3 are all wrong.
  assert (got["auc_mean"], got["mixed"]) == (pytest.approx(0.5), 2)
  assert got["cued_accuracy"] == pytest.approx(2 / 6)
  assert got["trap_accuracy"] == pytest.approx(1 / 6)
  # Copies on traps: q2 g0 (-0.3), q3 g0 and g1 (-0.1, -0.1); q0's are right answers.
  assert got["decoy_copied"] == pytest.approx(3 / 6)
  assert got["trap_gap"] == pytest.approx(np.mean([-0.3, -0.1, -0.1]) - (-1.2))
  # All wrong: q1 (mean p = (2 e^-0.9 + e^-2) / 3 = 0.32) and q3 (mean p 0.87 >= 1/2).
  assert got["confidently_wrong"] == pytest.approx(1 / 4)
  assert traps.confidently_wrong(S_QG, C_QG, confident=0.3) == pytest.approx(2 / 4)


def test_pooled_aucs_match_sklearn():
  rng = np.random.default_rng(0)
  s_QG = rng.normal(size=(30, 8)).round(1)  # rounded: ties, which count 1/2 in both
  c_QG = rng.random((30, 8)) < 0.4
  trap_Q = np.arange(30) % 2 == 0
  got = traps.heldout_metrics(s_QG, c_QG, ~c_QG, trap_Q)
  assert got["pooled_auc"] == pytest.approx(roc_auc_score(c_QG.ravel(), s_QG.ravel()))
  assert got["trap_auc"] == pytest.approx(roc_auc_score(c_QG[trap_Q].ravel(), s_QG[trap_Q].ravel()))
  per_q = [roc_auc_score(c, s) for c, s in zip(c_QG, s_QG) if 0 < c.sum() < c.size]
  assert (got["auc_mean"], got["mixed"]) == (pytest.approx(np.mean(per_q)), len(per_q))
  assert traps.summary(s_QG, c_QG) == {k: got[k] for k in traps.SUMMARY_KEYS}


def test_undefined_parts_are_nan():
  got = traps.heldout_metrics(S_QG[:2], C_QG[:2], COPY_QG[:2], TRAP_Q[:2])  # no trap
  assert all(np.isnan(got[k]) for k in traps.TRAP_KEYS if k != "cued_accuracy")
  no_copy = traps.heldout_metrics(S_QG, C_QG, np.zeros_like(COPY_QG), TRAP_Q)
  assert np.isnan(no_copy["trap_gap"]) and no_copy["decoy_copied"] == 0.0


def test_misfit_shapes_are_named():
  with pytest.raises(ValueError, match="traps.heldout_metrics.*copy_QG"):
    traps.heldout_metrics(S_QG, C_QG, COPY_QG[:, :2], TRAP_Q)
