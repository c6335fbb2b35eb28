"""Confidence-based inference-time scaling, host-side NumPy.

Over a set of N responses to one question (docs/algorithms.md, "Confidence-
based scaling"): majority vote; best-of-N (highest confidence s wins); a
confidence-weighted vote (an answer scores the sum of ``p = exp(s)`` over all
its responses, identical completions included); PC
(perplexity consistency: answers grouped by equivalence, identical
completions count once, an answer scores the sum of ``p = exp(s)`` over its
distinct completions); RPC (PC after dropping a response whose p is below the
set's mean p and more likely under the lower-mean component of a
two-component Weibull mixture fitted by EM to the set's p values; each
component's weight is kept in [0.2, 0.8], as in the official RPC code).
Answers are grouped by ``capo_jax.eval.grouping`` (within a time budget).

Conventions (choices): a response without an answer (``None``, group -1)
abstains in every method and a set where all abstain scores 0. Ties are
split: the expected accuracy of a uniformly random pick among the tied best
answers (PC scores tie within a relative ``tie_rtol``; vote counts and s
exactly). An answer group's correctness is the mean ``correct`` flag of its
members over the question (identical for a consistent grader).

Accuracy against N averages, per question, over subsets of N of its samples:
all C(G, N) subsets when there are at most ``n_subsets`` of them (exact),
else ``n_subsets`` (default 64) random ones, seeded by (seed, question
position, N). Questions with fewer than N samples are left out at that N.

The Weibull M-step needs no SciPy: for fixed responsibilities the scale has a
closed form and the shape solves a 1-D monotone equation, solved here for all
sets at once by a bracketed Newton iteration (not ~10^5 scipy.optimize calls).

Axis letters (unique across the package, see ``capo_jax/types.py``): G
samples of one question, E sets (subsets of a question's samples, or rows of
a batch of sets), U responses in a set (U = N above), A answer classes of a
question; ``_E2`` holds each set's two mixture components.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# group_answers and resolve_same_answer moved to grouping; re-exported for existing callers.
from capo_jax.eval.grouping import AnswerGrouper, group_answers, resolve_same_answer  # noqa: F401

METHODS: tuple[str, ...] = ("pc", "rpc", "majority", "weighted", "best_of_n")


@dataclasses.dataclass(frozen=True)
class WeibullFitConfig:
  """EM settings of the RPC mixture; shapes are kept in [k_min, k_max]."""

  n_iter: int = 100
  tol: float = 1e-6  # relative change of the log-likelihood that stops EM
  newton_steps: int = 3  # shape-equation steps per M-step (warm-started)
  k_min: float = 1e-2
  k_max: float = 1e3  # bounds the likelihood when a component collapses
  # Each component's weight stays in [weight_min, 1 - weight_min], the bound of the official
  # RPC code (w1 in [0.2, 0.8]): without it one component can shrink onto a single outlier.
  weight_min: float = 0.2

  def __post_init__(self) -> None:
    if not 0.0 <= self.weight_min <= 0.5:
      raise ValueError(f"WeibullFitConfig.weight_min must be in [0, 0.5], got {self.weight_min}")


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
  """Which N, how many subsets, which methods (see the module docstring)."""

  ns: tuple[int, ...] = (1, 2, 4, 8, 16)
  n_subsets: int = 64
  seed: int = 0
  methods: tuple[str, ...] = METHODS
  tie_rtol: float = 1e-9
  weibull: WeibullFitConfig = WeibullFitConfig()

  def __post_init__(self) -> None:
    if not self.ns or min(self.ns) < 1:
      raise ValueError(f"ScalingConfig.ns must be positive, got {self.ns}")
    if self.n_subsets < 1:
      raise ValueError(f"ScalingConfig.n_subsets must be >= 1, got {self.n_subsets}")
    unknown = set(self.methods) - set(METHODS)
    if unknown:
      raise ValueError(f"ScalingConfig.methods: unknown {sorted(unknown)}; known: {METHODS}")


@dataclasses.dataclass(frozen=True)
class QuestionSamples:
  """One question's responses, ready for selection (all arrays length G).

  group_G: answer-equivalence class (0, 1, ...), -1 for no answer.
  s_G: confidence (mean token log-prob). correct_G: bool.
  completion_G: equal ids mark identical completions.
  n_unresolved: answer pairs whose check timed out, counted as different.
  """

  group_G: np.ndarray
  s_G: np.ndarray
  correct_G: np.ndarray
  completion_G: np.ndarray
  n_unresolved: int = 0

  def __post_init__(self) -> None:
    g = len(self.group_G)
    for name in ("s_G", "correct_G", "completion_G"):
      if len(getattr(self, name)) != g:
        raise ValueError(
          f"QuestionSamples.{name} has length {len(getattr(self, name))}, group_G has {g}"
        )


def prepare_question(
  answers: Sequence[str | None],
  completions: Sequence[str],
  s: Sequence[float] | np.ndarray,
  correct: Sequence[bool] | np.ndarray,
  same_answer: Callable[[str, str], bool] | AnswerGrouper,
) -> QuestionSamples:
  """Builds QuestionSamples from raw strings (groups answers, ids completions).

  ``same_answer``: a callable run one pair at a time, or an ``AnswerGrouper``
  (``capo_jax.eval.grouping``: slow checks in a pool, within a time budget).
  """
  ids: dict[str, int] = {}
  completion_G = np.array([ids.setdefault(c, len(ids)) for c in completions], dtype=np.int64)
  grouper = same_answer if isinstance(same_answer, AnswerGrouper) else AnswerGrouper(same_answer)
  grouped = grouper.group(answers)
  return QuestionSamples(
    grouped.group_G,
    np.asarray(s, dtype=np.float64),
    np.asarray(correct, dtype=bool),
    completion_G,
    grouped.n_unresolved,
  )


# ---------------------------------------------------------------- Weibull fit
# All Weibull maths takes log x = s (p = exp(s)), so tiny p never underflow.


def _log_pdf(s: np.ndarray, k: np.ndarray, log_lam: np.ndarray) -> np.ndarray:
  z = s - log_lam
  return np.log(k) - log_lam + (k - 1.0) * z - np.exp(k * z)


def _tilted(
  s: np.ndarray, a: np.ndarray, k: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """log sum a e^{ks}, and mean / variance of s under weights a e^{ks}."""
  ks = np.where(a > 0, k[..., None] * s, -np.inf)
  top = np.max(ks, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  q = np.where(a > 0, a * np.exp(ks - top), 0.0)
  tot = q.sum(-1)
  mean = (q * s).sum(-1) / tot
  var = (q * (s - mean[..., None]) ** 2).sum(-1) / tot
  return np.log(tot) + top[..., 0], mean, var


def _m_step(
  s: np.ndarray, a: np.ndarray, k: np.ndarray, steps: int, cfg: WeibullFitConfig
) -> tuple[np.ndarray, np.ndarray]:
  """Weighted Weibull MLE: shape k (warm start given) and log scale.

  The shape solves f(k) = 1/k + mean_a(s) - mean_{a e^{ks}}(s) = 0, which
  decreases in k (f' = -1/k^2 - var); Newton kept inside a shrinking bracket.
  """
  total = a.sum(-1)
  mean_s = (a * s).sum(-1) / total
  lo, hi = np.full_like(k, cfg.k_min), np.full_like(k, cfg.k_max)
  for _ in range(steps):
    _, mean_q, var_q = _tilted(s, a, k)
    f = 1.0 / k + mean_s - mean_q
    lo, hi = np.where(f > 0, k, lo), np.where(f > 0, hi, k)
    newton = k + f / (1.0 / k**2 + var_q)
    k = np.where((newton > lo) & (newton < hi), newton, np.sqrt(lo * hi))
  log_sum, _, _ = _tilted(s, a, k)
  return k, (log_sum - np.log(total)) / k


def _initial_shape(s: np.ndarray, a: np.ndarray, cfg: WeibullFitConfig) -> np.ndarray:
  # std(log X) = pi / (k sqrt 6) for a Weibull: a moment guess for k.
  total = a.sum(-1)
  mean = (a * s).sum(-1) / total
  std = np.sqrt((a * (s - mean[..., None]) ** 2).sum(-1) / total)
  return np.clip(1.2825 / np.maximum(std, 1e-12), cfg.k_min, cfg.k_max)


def fit_weibull(
  p: Sequence[float],
  weights: Sequence[float] | None = None,
  config: WeibullFitConfig = WeibullFitConfig(),
) -> tuple[float, float]:
  """Maximum-likelihood (weighted) Weibull fit of positive p: (shape, scale)."""
  p_arr = np.asarray(p, dtype=np.float64)
  if p_arr.ndim != 1 or p_arr.size == 0 or (p_arr <= 0).any():
    raise ValueError("fit_weibull: p must be a non-empty 1-D array of p > 0")
  a = np.ones_like(p_arr) if weights is None else np.asarray(weights, float)
  if a.shape != p_arr.shape or (a < 0).any() or a.sum() <= 0:
    raise ValueError("fit_weibull: weights must be >= 0, not all 0, shaped like p")
  s = np.log(p_arr)[None]
  k0 = _initial_shape(s, a[None], config)
  k, log_lam = _m_step(s, a[None], k0, 100, config)
  return float(k[0]), float(np.exp(log_lam[0]))


@dataclasses.dataclass(frozen=True)
class WeibullMixture:
  """Fitted mixtures, one per row; component 0 has the lower mean."""

  weight_E2: np.ndarray
  shape_E2: np.ndarray
  scale_E2: np.ndarray
  loglik_E: np.ndarray
  fitted_E: np.ndarray  # False: no p below the row's mean, or the fit failed


def fit_weibull_mixture(
  s_EU: np.ndarray,
  valid_EU: np.ndarray | None = None,
  config: WeibullFitConfig = WeibullFitConfig(),
) -> WeibullMixture:
  """EM fit of a 2-component Weibull mixture to p = exp(s) of each row.

  Starts from the split p < row-mean p (low) / the rest (high).
  """
  s = np.asarray(s_EU, dtype=np.float64)
  v = np.ones(s.shape, bool) if valid_EU is None else np.asarray(valid_EU, bool)
  if s.ndim != 2 or v.shape != s.shape:
    raise ValueError(
      f"s_EU must be 2-D with a valid_EU of the same shape, got {s.shape} and {v.shape}"
    )
  if not np.isfinite(s[v]).all():
    raise ValueError("s_EU has NaN or inf at valid positions")
  s = np.where(v, s, 0.0)
  p = np.exp(s)
  mean_p = (p * v).sum(-1, keepdims=True) / np.maximum(v.sum(-1, keepdims=True), 1)
  low = v & (p < mean_p)
  fitted = low.any(-1) & (v & ~low).any(-1)
  # Rows that cannot be split get a harmless dummy split, masked at the end.
  low = np.where(fitted[:, None], low, v & (np.arange(s.shape[1]) % 2 == 0))
  resp = np.stack([low, v & ~low], axis=1).astype(np.float64)
  s3, v3 = s[:, None, :], v[:, None, :]
  loglik = np.full(s.shape[0], -np.inf)
  active = np.flatnonzero(fitted)  # rows still iterating
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    k = _initial_shape(s3, resp * v3, config)
    log_lam, weight = np.zeros_like(k), np.full_like(k, 0.5)
    for _ in range(config.n_iter):
      if not active.size:
        break
      sa, va, a = s3[active], v3[active], resp[active] * v3[active]
      total = a.sum(-1)
      # The weights' M-step objective is concave, so clipping its maximiser is the exact
      # M-step under the bound (and EM still never lowers the likelihood).
      w0 = np.clip(total[:, 0] / total.sum(-1), config.weight_min, 1.0 - config.weight_min)
      weight[active] = np.stack([w0, 1.0 - w0], axis=-1)
      k[active], log_lam[active] = _m_step(sa, a, k[active], config.newton_steps, config)
      logf = np.log(weight[active])[..., None] + _log_pdf(
        sa, k[active][..., None], log_lam[active][..., None]
      )
      lse = np.logaddexp(logf[:, 0], logf[:, 1])
      resp[active] = np.exp(logf - lse[:, None])
      new = np.where(va[:, 0], lse, 0.0).sum(-1)
      done = np.abs(new - loglik[active]) <= config.tol * (1.0 + np.abs(new))
      loglik[active] = new
      active = active[~done]
    log_mean = log_lam + np.vectorize(math.lgamma)(1.0 + 1.0 / k)
  fitted &= np.isfinite(loglik) & np.isfinite(log_mean).all(-1)
  order = np.argsort(np.where(np.isfinite(log_mean), log_mean, 0.0), axis=-1)
  take = lambda x: np.take_along_axis(x, order, axis=-1)  # noqa: E731
  return WeibullMixture(take(weight), take(k), take(np.exp(log_lam)), loglik, fitted)


def rpc_keep_mask(
  s_EU: np.ndarray,
  valid_EU: np.ndarray | None = None,
  config: WeibullFitConfig = WeibullFitConfig(),
) -> np.ndarray:
  """RPC pruning of each row: False where a sample is dropped."""
  s = np.asarray(s_EU, dtype=np.float64)
  v = np.ones(s.shape, bool) if valid_EU is None else np.asarray(valid_EU, bool)
  mix = fit_weibull_mixture(s, v, config)
  s_safe = np.where(v, s, 0.0)
  log_lam = np.log(mix.scale_E2)[:, :, None]
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    logpost = np.log(mix.weight_E2)[:, :, None] + _log_pdf(
      s_safe[:, None, :], mix.shape_E2[:, :, None], log_lam
    )
  p = np.exp(s_safe)
  mean_p = (p * v).sum(-1, keepdims=True) / np.maximum(v.sum(-1, keepdims=True), 1)
  drop = (p < mean_p) & (logpost[:, 0] > logpost[:, 1]) & mix.fitted_E[:, None]
  return v & ~drop


# ------------------------------------------------------------------ selection


def _pick_groups(
  group_EU: np.ndarray,
  weight_EU: np.ndarray,
  include_EU: np.ndarray,
  correct_A: np.ndarray,
  rtol: float,
) -> np.ndarray:
  """Expected accuracy per row of picking the group with the largest weight."""
  if correct_A.size == 0:  # no sample of the question has an answer: all abstain
    return np.zeros(group_EU.shape[0])
  onehot = (group_EU[..., None] == np.arange(correct_A.size)) & include_EU[..., None]
  score_EA = np.einsum("eu,eua->ea", weight_EU, onehot)
  eligible = onehot.any(axis=1)
  best = np.max(np.where(eligible, score_EA, 0.0), axis=1, keepdims=True)
  tied = eligible & (score_EA >= best - rtol * np.abs(best))
  n_tied = tied.sum(-1)
  return np.where(n_tied > 0, (tied * correct_A).sum(-1) / np.maximum(n_tied, 1), 0.0)


def _group_correct(group_G: np.ndarray, correct_G: np.ndarray) -> np.ndarray:
  k = int(group_G.max(initial=-1)) + 1
  answered = group_G >= 0
  n = np.bincount(group_G[answered], minlength=k)
  hits = np.bincount(group_G[answered], weights=correct_G[answered], minlength=k)
  return hits / np.maximum(n, 1)


def _first_occurrence(ids_EU: np.ndarray) -> np.ndarray:
  same = ids_EU[:, :, None] == ids_EU[:, None, :]
  earlier = np.tril(np.ones(same.shape[1:], bool), k=-1)
  return ~(same & earlier).any(-1)


def subset_accuracy(
  question: QuestionSamples,
  idx_EU: np.ndarray,
  method: str,
  keep_EU: np.ndarray | None = None,
  tie_rtol: float = 1e-9,
) -> np.ndarray:
  """Expected accuracy of ``method`` on each subset (row of sample indices).

  ``keep_EU`` is RPC's pruning mask of the subsets (needed for "rpc").
  """
  g, s = question.group_G[idx_EU], question.s_G[idx_EU]
  correct = np.asarray(question.correct_G, bool)
  answered = g >= 0
  if method == "best_of_n":
    best = np.max(np.where(answered, s, -np.inf), axis=1, keepdims=True)
    tied = answered & (s == best)
    n = tied.sum(-1)
    return np.where(n > 0, (tied & correct[idx_EU]).sum(-1) / np.maximum(n, 1), 0.0)
  correct_A = _group_correct(question.group_G, correct)
  if method == "majority":
    return _pick_groups(g, np.ones(g.shape), answered, correct_A, 0.0)
  if method == "weighted":  # PC without de-duplication: a repeated completion votes again
    return _pick_groups(g, np.exp(s), answered, correct_A, tie_rtol)
  if method not in ("pc", "rpc"):
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")
  include = answered & _first_occurrence(question.completion_G[idx_EU])
  if method == "rpc":
    if keep_EU is None:
      raise ValueError("method 'rpc' needs keep_EU (see rpc_keep_mask)")
    include &= keep_EU
  return _pick_groups(g, np.exp(s), include, correct_A, tie_rtol)


def _subsets(g: int, n: int, config: ScalingConfig, position: int) -> np.ndarray:
  if math.comb(g, n) <= config.n_subsets:
    return np.array(list(itertools.combinations(range(g), n)), dtype=np.int64)
  rng = np.random.default_rng([config.seed, position, n])
  return np.argsort(rng.random((config.n_subsets, g)), axis=1)[:, :n]


def scaling_curves(
  questions: Sequence[QuestionSamples], config: ScalingConfig = ScalingConfig()
) -> dict[str, Any]:
  """Accuracy against N for each method, averaged over subsets and questions.

  Returns ``{"n": [...], "n_questions": [...], "n_subsets": int, "seed": int,
  <method>: [accuracy per N]}``; accuracy is NaN at an N no question reaches.
  """
  out: dict[str, Any] = {
    "n": list(config.ns),
    "n_questions": [],
    "n_subsets": config.n_subsets,
    "seed": config.seed,
  }
  for method in config.methods:
    out[method] = []
  for n in config.ns:
    used = [(i, q) for i, q in enumerate(questions) if len(q.group_G) >= n]
    out["n_questions"].append(len(used))
    idx = [_subsets(len(q.group_G), n, config, i) for i, q in used]
    keep: Sequence[np.ndarray | None] = [None] * len(used)
    if "rpc" in config.methods and used:
      s_all = np.concatenate([q.s_G[ix] for (_, q), ix in zip(used, idx)])
      keep_all = rpc_keep_mask(s_all, None, config.weibull)
      keep = np.split(keep_all, np.cumsum([len(ix) for ix in idx])[:-1])
    for method in config.methods:
      accs = [
        subset_accuracy(q, ix, method, kp, config.tie_rtol).mean()
        for (_, q), ix, kp in zip(used, idx, keep)
      ]
      out[method].append(float(np.mean(accs)) if accs else float("nan"))
  return out
