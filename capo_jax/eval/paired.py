"""Paired per-question AUC differences between runs, with bootstrap intervals.

AUC-mean averages over the questions that are mixed (some samples right,
some wrong); on AIME that is 10-15 questions, so two runs' AUC-means differ
by more than their calibration does: they average over different questions,
and over few. Pairing by question removes the first effect (each question is
compared with itself), the interval shows the second.

- ``paired_delta_auc``: the demo's form, seeds x questions: the mean over
  (seed, question) of AUC_A - AUC_B over the cells mixed under both, with a
  two-way bootstrap (seeds and questions resampled; one question draw shared
  by the seeds, since the questions are). With fewer than ``T_BELOW`` seeds a
  bootstrap over them has too few distinct draws to be trusted, so a
  t-interval over the seeds' means (``t_interval``) stands beside it.
- ``t_interval``: the Student-t interval of a mean over a few clusters
  (df = clusters - 1, sample sd with ddof = 1); ``t_pvalue`` its two-sided p-value
  against 0, and ``holm`` which of several such tests hold together (Holm's step-down,
  family-wise error at most alpha).
- ``match_questions`` / ``delta_interval``: the evaluator's form, one run
  against another on a benchmark: questions matched by id, the mean difference
  over the pairs mixed in both, and a bootstrap over questions; pooled over
  benchmarks, the resampling is stratified (questions drawn within each
  benchmark, so every replicate keeps each benchmark's number of pairs).
- ``paired_section``: the "Paired ΔAUC" section of ``comparison.md``.

Letters: I seeds (independent runs), Q questions, O bootstrap replicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

N_BOOT, SEED, LEVEL = 2000, 0, 0.95
T_BELOW = 10  # fewer clusters than this: a t-interval over cluster means beside the bootstrap
# Student-t 0.975 quantiles for df 1..9, used when scipy is not installed (level 0.95 only).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)
MISSING = "not in results.json: re-run the evaluation"


def _interval(est_O: np.ndarray, level: float) -> tuple[float, float]:
  alpha = (1.0 - level) / 2
  lo, hi = np.quantile(est_O, [alpha, 1.0 - alpha])
  return float(lo), float(hi)


def _t_quantile(q: float, df: int) -> float:
  try:
    from scipy import stats  # pylint: disable=import-outside-toplevel
  except ImportError:
    if q != 0.975 or not 1 <= df <= len(_T975):
      raise ValueError(
        f"t_interval: without scipy only level 0.95 and df 1..{len(_T975)} "
        f"are tabled; got quantile {q}, df {df}"
      ) from None
    return _T975[df - 1]
  return float(stats.t.ppf(q, df))


def t_interval(means: Any, level: float = LEVEL) -> dict[str, float]:
  """Student-t interval of the mean of cluster means: ``m +- t_{df} * sd / sqrt(n)``.

  sd is the sample sd (ddof = 1), df = n - 1. Returns ``t_mean``, ``t_lo``, ``t_hi``
  and ``clusters``; the bounds are NaN with fewer than 2 finite means.
  """
  m = np.asarray(means, np.float64).ravel()
  m = m[np.isfinite(m)]
  n = m.size
  if n < 2:
    return dict(
      t_mean=float(m.mean()) if n else float("nan"),
      t_lo=float("nan"),
      t_hi=float("nan"),
      clusters=n,
    )
  half = _t_quantile(1.0 - (1.0 - level) / 2, n - 1) * m.std(ddof=1) / np.sqrt(n)
  return dict(
    t_mean=float(m.mean()), t_lo=float(m.mean() - half), t_hi=float(m.mean() + half), clusters=n
  )


def t_pvalue(means: Any) -> float:
  """Two-sided p-value of the mean of cluster means against 0 (the test ``t_interval``
  inverts: p < 1 - level exactly when its interval excludes 0); NaN under 2 means."""
  from scipy import stats  # pylint: disable=import-outside-toplevel  (a jax dependency)

  m = np.asarray(means, np.float64).ravel()
  m = m[np.isfinite(m)]
  if m.size < 2:
    return float("nan")
  t = m.mean() / (m.std(ddof=1) / np.sqrt(m.size))
  return float(2 * stats.t.sf(abs(t), m.size - 1))


def holm(pvalues: Mapping[str, float], alpha: float = 1 - LEVEL) -> dict[str, bool]:
  """Holm's step-down over a family of tests: the k-th smallest p-value of m holds
  while it and every smaller one are below alpha / (m - k + 1). The family-wise error
  (any true null rejected) stays at most alpha, whatever the tests' dependence.
  A NaN p-value counts in m and never holds."""
  order = sorted(pvalues, key=lambda k: (np.isnan(pvalues[k]), pvalues[k]))
  out = dict.fromkeys(pvalues, False)
  for k, name in enumerate(order):
    if not pvalues[name] < alpha / (len(order) - k):
      break
    out[name] = True
  return out


def beside_bootstrap(cluster_means: Any, level: float = LEVEL) -> dict[str, float]:
  """``t_interval`` of the cluster means when there are fewer than ``T_BELOW`` of them,
  else ``{}`` (the cluster bootstrap is then left to speak alone)."""
  m = np.asarray(cluster_means, np.float64).ravel()
  return t_interval(m, level) if m.size < T_BELOW else {}


def t_note(d: Mapping[str, Any], what: str = "seeds") -> str:
  """ ", t over N <what> [lo, hi]" for a result holding a finite t-interval, else ""."""
  if not np.isfinite(d.get("t_lo", np.nan)):
    return ""
  return f", t over {d['clusters']} {what} [{d['t_lo']:+.3f}, {d['t_hi']:+.3f}]"


def paired_delta_auc(
  auc_a_IQ: Any, auc_b_IQ: Any, *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
  """Mean paired AUC difference (A - B) and its bootstrap interval.

  ``auc_*_IQ``: per-question AUC of each seed's final policy (NaN where the
  question is all-right or all-wrong, ``calibration.auc_per_question``). Pairs
  count where both are finite. Each replicate draws I seeds and Q questions
  with replacement; its estimate is the pair-weighted mean over the drawn
  (seed, question) cells. Returns ``delta``, ``lo``, ``hi``, ``pairs`` (the
  number of paired cells) and ``seeds``; with fewer than ``T_BELOW`` seeds also
  ``t_mean``, ``t_lo``, ``t_hi``, ``clusters``: the t-interval over the seeds' own
  mean differences (NaN bounds with one seed), since a bootstrap over 2-5 seeds
  has only a handful of distinct seed draws.
  """
  a, b = (
    np.atleast_2d(np.asarray(auc_a_IQ, np.float64)),
    np.atleast_2d(np.asarray(auc_b_IQ, np.float64)),
  )
  if a.shape != b.shape:
    raise ValueError(f"paired_delta_auc: shapes differ, {a.shape} vs {b.shape}")
  valid_IQ = np.isfinite(a) & np.isfinite(b)
  d_IQ = np.where(valid_IQ, a - b, 0.0)
  n = int(valid_IQ.sum())
  if n == 0:
    return dict(delta=float("nan"), lo=float("nan"), hi=float("nan"), pairs=0, seeds=a.shape[0])
  I, Q = a.shape
  rng = np.random.default_rng(seed)
  w_OI = rng.multinomial(I, np.full(I, 1.0 / I), size=n_boot).astype(np.float64)
  v_OQ = rng.multinomial(Q, np.full(Q, 1.0 / Q), size=n_boot).astype(np.float64)
  num_O = np.einsum("oi,iq,oq->o", w_OI, d_IQ, v_OQ)
  den_O = np.einsum("oi,iq,oq->o", w_OI, valid_IQ.astype(np.float64), v_OQ)
  est_O = num_O[den_O > 0] / den_O[den_O > 0]
  lo, hi = _interval(est_O, level)
  with np.errstate(invalid="ignore", divide="ignore"):
    seed_means_I = d_IQ.sum(1) / valid_IQ.sum(1)  # NaN for a seed with no pair
  return dict(
    delta=float(d_IQ.sum() / n),
    lo=lo,
    hi=hi,
    pairs=n,
    seeds=I,
    **beside_bootstrap(seed_means_I, level),
  )


@dataclasses.dataclass(frozen=True)
class Matched:
  """Two runs' questions on one benchmark, matched by id.

  d_Q: AUC_A - AUC_B over the questions mixed in both (in A's order).
  not_mixed: in both runs, but all-right or all-wrong in at least one.
  only_a / only_b: question ids present in one run only.
  """

  d_Q: np.ndarray
  not_mixed: int
  only_a: int
  only_b: int


def _auc_by_id(ids: Sequence[str], auc: Sequence[float | None], who: str) -> dict[str, float]:
  if len(ids) != len(auc):
    raise ValueError(f"{who}: {len(ids)} question ids for {len(auc)} AUCs")
  out = {q: np.nan if v is None else float(v) for q, v in zip(ids, auc)}
  if len(out) != len(ids):
    raise ValueError(f"{who}: duplicate question ids")
  return out


def match_questions(
  ids_a: Sequence[str],
  auc_a: Sequence[float | None],
  ids_b: Sequence[str],
  auc_b: Sequence[float | None],
) -> Matched:
  """Pairs two runs' per-question AUCs (None / NaN: not mixed) by question id."""
  a, b = _auc_by_id(ids_a, auc_a, "run A"), _auc_by_id(ids_b, auc_b, "run B")
  both = [q for q in a if q in b]
  d_Q = np.array([a[q] - b[q] for q in both], np.float64)
  mixed_Q = np.isfinite(d_Q)
  return Matched(d_Q[mixed_Q], int((~mixed_Q).sum()), len(a) - len(both), len(b) - len(both))


def delta_interval(
  d_by_stratum: Sequence[Any], *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
  """Mean of the pooled differences and a bootstrap interval stratified by group.

  Each replicate resamples every stratum's differences with replacement
  (keeping its size) and takes the mean over all of them, so with one stratum
  it is the ordinary bootstrap of a mean. Returns ``delta``, ``lo``, ``hi`` and
  ``pairs``; NaN when there are no pairs.
  """
  d_list = [np.asarray(d, np.float64).ravel() for d in d_by_stratum]
  d_list = [d for d in d_list if d.size]
  n = sum(d.size for d in d_list)
  if n == 0:
    return dict(delta=float("nan"), lo=float("nan"), hi=float("nan"), pairs=0)
  rng = np.random.default_rng(seed)
  sum_O = np.zeros(n_boot)
  for d_Q in d_list:
    w_OQ = rng.multinomial(d_Q.size, np.full(d_Q.size, 1.0 / d_Q.size), size=n_boot)
    sum_O += w_OQ @ d_Q
  lo, hi = _interval(sum_O / n, level)
  return dict(delta=float(np.concatenate(d_list).mean()), lo=lo, hi=hi, pairs=n)


def _per_question(bench: Mapping[str, Any]) -> tuple[list[str], list[float | None]] | None:
  ids = bench.get("question_ids")
  return None if ids is None else (ids, bench["auc_per_question"])


def _row(label: str, run: str, out: Mapping[str, float], not_mixed: int, only: str) -> str:
  if not out["pairs"]:
    cells = ["-", "-"]
  else:
    cells = [f"{out['delta']:+.3f}", f"[{out['lo']:+.3f}, {out['hi']:+.3f}]"]
  return "| " + " | ".join([label, run, *cells, str(out["pairs"]), str(not_mixed), only]) + " |"


def paired_table(
  runs: Mapping[str, Mapping[str, Any]],
  *,
  n_boot: int = N_BOOT,
  seed: int = SEED,
  level: float = LEVEL,
) -> str:
  """Markdown: each run against the first, per benchmark and pooled (stratified).

  Columns: ΔAUC (run minus the first), its bootstrap interval, the pairs (mixed
  in both), questions in both but not mixed in both, and questions in only one
  of the two runs (first / this). A benchmark whose results.json predates the
  question ids gets a row saying so.
  """
  names = list(runs)
  if len(names) < 2:
    return "One run: nothing to pair.\n"
  base = runs[names[0]]["benchmarks"]
  pct = round(100 * level)
  lines = [
    f"| benchmark | run | ΔAUC vs {names[0]} | {pct}% interval | pairs "
    f"| not mixed in both | only in {names[0]} / in run |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for name in names[1:]:
    other = runs[name]["benchmarks"]
    d_by_bench, not_mixed, only = [], 0, [0, 0]
    for bench in [b for b in base if b in other]:
      qa, qb = _per_question(base[bench]), _per_question(other[bench])
      if qa is None or qb is None:
        lines.append(f"| {bench} | {name} | {MISSING} | | | | |")
        continue
      m = match_questions(qb[0], qb[1], qa[0], qa[1])  # this run minus the first
      out = delta_interval([m.d_Q], n_boot=n_boot, seed=seed, level=level)
      lines.append(_row(bench, name, out, m.not_mixed, f"{m.only_b} / {m.only_a}"))
      d_by_bench.append(m.d_Q)
      not_mixed += m.not_mixed
      only = [only[0] + m.only_b, only[1] + m.only_a]
    if d_by_bench:
      out = delta_interval(d_by_bench, n_boot=n_boot, seed=seed, level=level)
      lines.append(_row("pooled", name, out, not_mixed, f"{only[0]} / {only[1]}"))
  return "\n".join(lines) + "\n"


def paired_section(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The "Paired ΔAUC" section of comparison.md, as markdown lines."""
  return [
    "## Paired ΔAUC",
    "",
    "Per-question AUC of each run minus the first run's, over the questions (matched "
    f"by id) mixed in both; {LEVEL:.0%} bootstrap interval over questions ({N_BOOT} "
    f"replicates, seed {SEED}); pooled: every pair of the benchmarks, questions "
    "resampled within each benchmark.",
    "",
    paired_table(runs),
  ]
