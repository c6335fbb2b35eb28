"""Accuracy and calibration metrics of sampled responses (host-side NumPy).

Axis letters: Q questions, G samples per question. Per-question functions
take ``s_QG`` / ``correct_QG`` shaped ``[Q, G]`` and an optional boolean
``valid_QG`` mask for ragged data (questions with different numbers of
samples, padding, or masked samples); invalid cells are ignored and may hold
anything. Pooled functions take ``s`` / ``correct`` of any shape. The
confidence score ``s`` of a response is its mean token log-probability over
its completion tokens (``s = -log PPL``); higher means more confident.
Definitions (docs/algorithms.md, "Evaluation metrics"):

- ``mean_at_k``: mean correctness of the first k valid samples of each
  question, averaged over questions (each question weighs the same).
- ``pass_at_k``: the unbiased estimator ``1 - C(n - c, k) / C(n, k)`` per
  question (n valid samples, c correct), averaged over questions.
- ``maj_at_k``: majority vote over the answers of the first k valid samples.
  ``None`` answers abstain. Ties: ``"split"`` (default) scores the expected
  accuracy of a uniformly random pick among the tied answers, like PC in
  ``capo_jax.eval.scaling``; ``"first"`` picks the tied answer that appears first
  (lowest sample position). An answer's correctness is the mean of its
  samples' ``correct`` flags (identical for a consistent grader).
- ``auc_per_question`` / ``auc_mean``: ROC-AUC of s against correctness inside
  each question, ties counting 1/2; questions whose valid samples are all
  correct or all wrong have no AUC (NaN) and are skipped by the mean.
- ``auc_by_bucket``: AUC-mean over questions grouped by their fraction of
  correct samples; default buckets (0, 0.25], (0.25, 0.5], (0.5, 0.75] and
  (0.75, 1) (fractions 0 and 1 have no AUC).
- ``pooled_auc``: one ROC-AUC over all valid samples of a benchmark.
- ``precision_coverage`` / ``aurc``: answer only when ``s >= threshold``;
  one curve point per distinct score. AURC is the area under the step curve
  risk(coverage) = 1 - precision, i.e. ``sum_m (cov_m - cov_{m-1}) * risk_m``;
  without ties it is the usual ``(1/n) sum_k risk(top k)``.
- ``ece`` / ``brier``: of the probability ``exp(s)`` against correctness; ECE
  uses ``n_bins`` equal-width bins on [0, 1], right-open except the last. Not the
  paper's metrics: exp(s) is the geometric-mean token probability, ~0.9-1.0 for
  every chain-of-thought sample, so ECE is close to 1 - accuracy. Reports keep them
  out of their tables (``capo_jax.eval.comparison.ECE_NOTE``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

# (lo, hi]: questions whose fraction of correct samples lies in it. The last
# bucket is open at 1 in effect, since all-correct questions have no AUC.
DEFAULT_BUCKETS: tuple[tuple[float, float], ...] = (
  (0.0, 0.25),
  (0.25, 0.5),
  (0.5, 0.75),
  (0.75, 1.0),
)

# Bound on the elements of the [chunk, G, G] pair tensor of auc_per_question.
_PAIR_CHUNK_ELEMENTS = 1 << 22


def _check_2d(name: str, x: Any) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim != 2:
    raise ValueError(f"{name} must be 2-D [Q, G], got shape {arr.shape}")
  return arr


def _as_bool(name: str, x: np.ndarray) -> np.ndarray:
  if x.dtype == bool:
    return x
  if x.dtype.kind not in "iuf" or not np.isin(x, (0, 1)).all():
    raise ValueError(f"{name} must be boolean or 0/1, got dtype {x.dtype}")
  return x.astype(bool)


def _valid(valid_QG: Any, shape: tuple[int, ...]) -> np.ndarray:
  if valid_QG is None:
    return np.ones(shape, dtype=bool)
  valid = _as_bool("valid_QG", np.asarray(valid_QG))
  if valid.shape != shape:
    raise ValueError(f"valid_QG has shape {valid.shape}, expected {shape}")
  return valid


def _inputs_qg(
  s_QG: Any, correct_QG: Any, valid_QG: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Checks shapes / values and returns float s, bool correct, bool valid."""
  correct = _as_bool("correct_QG", _check_2d("correct_QG", correct_QG))
  valid = _valid(valid_QG, correct.shape)
  if s_QG is None:
    return np.zeros(correct.shape), correct, valid
  s = _check_2d("s_QG", s_QG).astype(np.float64)
  if s.shape != correct.shape:
    raise ValueError(f"s_QG has shape {s.shape} but correct_QG has {correct.shape}")
  if not np.isfinite(s[valid]).all():
    raise ValueError("s_QG has NaN or inf at valid positions")
  return s, correct, valid


def _inputs_flat(s: Any, correct: Any, valid: Any) -> tuple[np.ndarray, np.ndarray]:
  """Pools valid samples of any shape into 1-D float s and bool correct."""
  s = np.asarray(s, dtype=np.float64)
  c = _as_bool("correct", np.asarray(correct))
  if s.shape != c.shape:
    raise ValueError(f"s has shape {s.shape} but correct has {c.shape}")
  v = _valid(valid, s.shape)
  s, c = s[v], c[v]
  if not np.isfinite(s).all():
    raise ValueError("s has NaN or inf at valid positions")
  return s, c


def _first_k(valid: np.ndarray, k: int | None, what: str) -> np.ndarray:
  """Mask of the first k valid samples of each question (all when k is None)."""
  if k is None:
    return valid
  if k < 1:
    raise ValueError(f"{what}: k must be >= 1, got {k}")
  n = valid.sum(axis=1)
  short = np.flatnonzero(n < k)
  if short.size:
    raise ValueError(
      f"{what}: k={k} but {short.size} question(s) have fewer "
      f"valid samples (first: row {short[0]} has {n[short[0]]})"
    )
  return valid & (np.cumsum(valid, axis=1) <= k)


def mean_at_k(correct_QG: Any, k: int | None = None, valid_QG: Any = None) -> float:
  """Mean correctness of the first k valid samples, averaged over questions."""
  _, correct, valid = _inputs_qg(None, correct_QG, valid_QG)
  take = _first_k(valid, k, "mean_at_k")
  n = take.sum(axis=1)
  if (n == 0).any():
    raise ValueError("mean_at_k: a question has no valid sample")
  return float(np.mean((correct & take).sum(axis=1) / n))


def pass_at_k(correct_QG: Any, k: int, valid_QG: Any = None) -> float:
  """Unbiased pass@k, ``1 - C(n-c, k) / C(n, k)``, averaged over questions."""
  _, correct, valid = _inputs_qg(None, correct_QG, valid_QG)
  _first_k(valid, k, "pass_at_k")  # only checks that every n >= k
  n = valid.sum(axis=1)[:, None]
  c = (correct & valid).sum(axis=1)[:, None]
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i); a zero factor (i = k)
  # appears exactly when n - c < k, i.e. every k-subset holds a correct one.
  i = np.arange(1, correct.shape[1] + 1)[None, :]
  factor = np.where((i > n - c) & (i <= n), 1.0 - k / i, 1.0)
  return float(np.mean(1.0 - np.prod(factor, axis=1)))


def _vote(keys: Sequence[Hashable | None], correct: np.ndarray, ties: str) -> float:
  """Expected accuracy of a majority vote over one question's answer keys."""
  counts: dict[Hashable, int] = {}
  hits: dict[Hashable, int] = {}
  for key, ok in zip(keys, correct):
    if key is None:
      continue
    counts[key] = counts.get(key, 0) + 1
    hits[key] = hits.get(key, 0) + int(ok)
  if not counts:
    return 0.0
  best = max(counts.values())
  tied = [key for key, n in counts.items() if n == best]  # first-seen order
  if ties == "first":
    tied = tied[:1]
  return float(np.mean([hits[key] / counts[key] for key in tied]))


def maj_at_k(
  answers_QG: Any, correct_QG: Any, k: int | None = None, valid_QG: Any = None, ties: str = "split"
) -> float:
  """Majority-vote accuracy over the first k valid samples of each question.

  Args:
    answers_QG: [Q][G] canonical answer keys (any hashable; equal keys are the
      same answer), ``None`` for a response without an answer (abstains).
    correct_QG: [Q, G] correctness of each sample.
    k: number of samples voting (first k valid ones); None = all valid.
    valid_QG: optional [Q, G] mask.
    ties: ``"split"`` (expected accuracy over the tied answers) or
      ``"first"`` (the tied answer seen first wins).

  Returns:
    Accuracy averaged over questions; a question where every voter abstains
    scores 0.
  """
  if ties not in ("split", "first"):
    raise ValueError(f"ties must be 'split' or 'first', got {ties!r}")
  _, correct, valid = _inputs_qg(None, correct_QG, valid_QG)
  if len(answers_QG) != correct.shape[0] or any(len(row) != correct.shape[1] for row in answers_QG):
    raise ValueError(f"answers_QG must be [Q][G] = {correct.shape} like correct_QG")
  take = _first_k(valid, k, "maj_at_k")
  accs = [
    _vote([a for a, t in zip(row, take_g) if t], corr_g[take_g], ties)
    for row, corr_g, take_g in zip(answers_QG, correct, take)
  ]
  return float(np.mean(accs))


def auc_per_question(s_QG: Any, correct_QG: Any, valid_QG: Any = None) -> np.ndarray:
  """ROC-AUC of s against correctness per question; NaN when undefined.

  Counts pairs (correct i, wrong j) with ``s_i > s_j`` as 1 and ties as 1/2,
  over ``|P| * |N|`` pairs. Vectorised over a [Q, G, G] pair tensor, chunked
  over Q; cheap for the G <= 64 of RL batches and evaluations.
  """
  s_QG, correct, valid = _inputs_qg(s_QG, correct_QG, valid_QG)
  q, g = s_QG.shape
  pos, neg = correct & valid, ~correct & valid
  num = np.zeros(q)
  step = max(1, _PAIR_CHUNK_ELEMENTS // max(1, g * g))
  for lo in range(0, q, step):
    s = s_QG[lo : lo + step]
    pair = pos[lo : lo + step, :, None] & neg[lo : lo + step, None, :]
    diff = s[:, :, None] - s[:, None, :]
    win = (diff > 0) + 0.5 * (diff == 0)
    num[lo : lo + step] = np.sum(win * pair, axis=(1, 2))
  den = pos.sum(axis=1) * neg.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def auc_mean(s_QG: Any, correct_QG: Any, valid_QG: Any = None) -> tuple[float, int]:
  """Mean per-question AUC over non-degenerate questions, and their number.

  Returns ``(nan, 0)`` when every question is all-correct or all-wrong.
  """
  auc_Q = auc_per_question(s_QG, correct_QG, valid_QG)
  used = ~np.isnan(auc_Q)
  n = int(used.sum())
  return (float(auc_Q[used].mean()) if n else float("nan")), n


def auc_mean_traced(s_QG: Any, correct_QG: Any, valid_QG: Any) -> tuple[Any, Any]:
  """``auc_mean`` as jax.numpy (traceable: the trainer's rollout logs it without
  reading the scores back): (mean AUC over the questions that have one, or NaN;
  their number). Invalid samples take part in no pair."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  pos, neg = correct_QG & valid_QG, ~correct_QG & valid_QG
  pair_QGG = pos[:, :, None] & neg[:, None, :]
  diff_QGG = s_QG[:, :, None] - s_QG[:, None, :]
  win_QGG = (diff_QGG > 0) + 0.5 * (diff_QGG == 0)
  num_Q = jnp.sum(jnp.where(pair_QGG, win_QGG, 0.0), axis=(1, 2))
  den_Q = pos.sum(1) * neg.sum(1)
  used_Q = den_Q > 0
  n = used_Q.sum()
  auc_Q = num_Q / jnp.maximum(den_Q, 1)
  mean = jnp.where(n > 0, jnp.sum(jnp.where(used_Q, auc_Q, 0.0)) / jnp.maximum(n, 1), jnp.nan)
  return mean, n


def bucket_label(lo: float, hi: float) -> str:
  """Printable name of a difficulty bucket, e.g. ``(0.25, 0.5]``."""
  return f"({lo:g}, {hi:g})" if hi >= 1.0 else f"({lo:g}, {hi:g}]"


def auc_by_bucket(
  s_QG: Any,
  correct_QG: Any,
  valid_QG: Any = None,
  buckets: Sequence[tuple[float, float]] = DEFAULT_BUCKETS,
) -> dict[str, dict[str, float | int]]:
  """AUC-mean per difficulty bucket (fraction of correct valid samples).

  Returns ``{label: {"lo", "hi", "auc_mean", "n"}}`` in bucket order; a bucket
  holds the questions with ``lo < fraction <= hi`` that have an AUC, and its
  ``auc_mean`` is NaN when it holds none.
  """
  _, correct, valid = _inputs_qg(None, correct_QG, valid_QG)
  auc_Q = auc_per_question(s_QG, correct, valid)
  n_valid = valid.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    frac = (correct & valid).sum(axis=1) / n_valid
  out: dict[str, dict[str, float | int]] = {}
  for lo, hi in buckets:
    if not 0.0 <= lo < hi <= 1.0:
      raise ValueError(f"bucket ({lo}, {hi}] must satisfy 0 <= lo < hi <= 1")
    sel = (frac > lo) & (frac <= hi) & ~np.isnan(auc_Q)
    n = int(sel.sum())
    out[bucket_label(lo, hi)] = {
      "lo": float(lo),
      "hi": float(hi),
      "n": n,
      "auc_mean": float(auc_Q[sel].mean()) if n else float("nan"),
    }
  return out


def pooled_auc(s: Any, correct: Any, valid: Any = None) -> float:
  """One ROC-AUC over all valid samples (Mann-Whitney with mid-ranks)."""
  s, c = _inputs_flat(s, correct, valid)
  n_pos, n_neg = int(c.sum()), int((~c).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
  start = np.cumsum(counts) - counts  # samples strictly below each value
  mid_rank = start + (counts + 1) / 2.0
  rank_sum = mid_rank[inverse][c].sum()
  return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def precision_coverage(
  s: Any, correct: Any, valid: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Precision-coverage curve of pooled samples, answering when s >= t.

  Returns ``(coverage, precision, thresholds)``, one point per distinct score,
  thresholds decreasing (coverage increasing to 1).
  """
  s, c = _inputs_flat(s, correct, valid)
  if s.size == 0:
    raise ValueError("precision_coverage: no valid samples")
  order = np.argsort(-s, kind="stable")
  s_sorted, hits = s[order], np.cumsum(c[order])
  last = np.flatnonzero(np.append(s_sorted[1:] != s_sorted[:-1], True))
  answered = last + 1
  return answered / s.size, hits[last] / answered, s_sorted[last]


def aurc(s: Any, correct: Any, valid: Any = None) -> float:
  """Area under the risk-coverage step curve (risk = 1 - precision)."""
  coverage, precision, _ = precision_coverage(s, correct, valid)
  widths = np.diff(coverage, prepend=0.0)
  return float(np.sum(widths * (1.0 - precision)))


def ece(s: Any, correct: Any, valid: Any = None, n_bins: int = 10) -> float:
  """Expected calibration error of ``exp(s)`` with equal-width bins."""
  s, c = _inputs_flat(s, correct, valid)
  if n_bins < 1:
    raise ValueError(f"n_bins must be >= 1, got {n_bins}")
  if s.size == 0:
    return float("nan")
  conf = np.clip(np.exp(s), 0.0, 1.0)
  idx = np.minimum((conf * n_bins).astype(int), n_bins - 1)
  gap = np.bincount(idx, weights=c.astype(float), minlength=n_bins) - np.bincount(
    idx, weights=conf, minlength=n_bins
  )
  # Per bin |acc - conf| * n_b / n = |sum(correct) - sum(conf)| / n.
  return float(np.abs(gap).sum() / s.size)


def brier(s: Any, correct: Any, valid: Any = None) -> float:
  """Brier score: mean of ``(exp(s) - correct)^2``."""
  s, c = _inputs_flat(s, correct, valid)
  if s.size == 0:
    return float("nan")
  return float(np.mean((np.clip(np.exp(s), 0.0, 1.0) - c) ** 2))
