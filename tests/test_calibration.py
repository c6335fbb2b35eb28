"""Calibration metrics against scikit-learn, brute force and hand-worked cases;
the samples.jsonl loader's errors and the report's comparison table."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from capo_jax.eval import calibration as cal
from capo_jax.eval import comparison, report


def _ragged_batch(seed: int, q: int = 40, g: int = 12):
  """Scores on a coarse grid (many ties), random correctness, ragged mask."""
  rng = np.random.default_rng(seed)
  scores = np.round(rng.normal(-0.5, 0.3, (q, g)), 1)
  correct = rng.uniform(size=(q, g)) < rng.uniform(size=(q, 1))
  n_valid = rng.integers(2, g + 1, size=q)
  valid = np.arange(g)[None, :] < n_valid[:, None]
  scores = np.where(valid, scores, np.nan)  # padding must be ignored
  return scores, correct, valid


def _pair_count_auc(s: np.ndarray, c: np.ndarray) -> float:
  wins, pairs = 0.0, 0
  for i in range(len(s)):
    for j in range(len(s)):
      if c[i] and not c[j]:
        pairs += 1
        wins += 1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0
  return wins / pairs if pairs else math.nan


def test_auc_per_question_matches_sklearn_and_pair_count():
  scores, correct, valid = _ragged_batch(0)
  auc_Q = cal.auc_per_question(scores, correct, valid)
  n_checked = 0
  for q in range(scores.shape[0]):
    s, c = scores[q][valid[q]], correct[q][valid[q]]
    brute = _pair_count_auc(s, c)
    if c.all() or not c.any():
      assert math.isnan(auc_Q[q]) and math.isnan(brute)
      continue
    n_checked += 1
    assert auc_Q[q] == pytest.approx(roc_auc_score(c, s), abs=1e-12)
    assert auc_Q[q] == pytest.approx(brute, abs=1e-12)
  assert n_checked >= 20


def test_auc_mean_skips_degenerate_questions_and_counts_used():
  scores, correct, valid = _ragged_batch(1)
  per_q = [
    roc_auc_score(correct[q][valid[q]], scores[q][valid[q]])
    for q in range(scores.shape[0])
    if 0 < correct[q][valid[q]].sum() < valid[q].sum()
  ]
  mean, n = cal.auc_mean(scores, correct, valid)
  assert n == len(per_q)
  assert mean == pytest.approx(np.mean(per_q), abs=1e-12)
  mean, n = cal.auc_mean(np.zeros((3, 4)), np.eye(3, 4) * 0)
  assert n == 0 and math.isnan(mean)


def test_auc_mean_hand_case_with_tie():
  # Correct scores 0.9, 0.5 vs wrong 0.5, 0.1: pairs 1, 1, 0.5 (tie), 1.
  mean, n = cal.auc_mean([[0.9, 0.5, 0.5, 0.1]], [[1, 1, 0, 0]])
  assert (mean, n) == (pytest.approx(3.5 / 4), 1)


def test_auc_by_bucket_groups_by_fraction_correct():
  scores, correct, valid = _ragged_batch(2, q=80)
  out = cal.auc_by_bucket(scores, correct, valid)
  assert list(out) == ["(0, 0.25]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.75, 1)"]
  for bucket in out.values():
    aucs = []
    for q in range(scores.shape[0]):
      s, c = scores[q][valid[q]], correct[q][valid[q]]
      frac = c.mean()
      if 0 < frac < 1 and bucket["lo"] < frac <= bucket["hi"]:
        aucs.append(roc_auc_score(c, s))
    assert bucket["n"] == len(aucs)
    if aucs:
      assert bucket["auc_mean"] == pytest.approx(np.mean(aucs), abs=1e-12)


def test_pooled_auc_matches_sklearn_with_ties():
  scores, correct, valid = _ragged_batch(3)
  expected = roc_auc_score(correct[valid], scores[valid])
  assert cal.pooled_auc(scores, correct, valid) == pytest.approx(expected, abs=1e-12)
  assert math.isnan(cal.pooled_auc([0.1, 0.2], [True, True]))


def test_precision_coverage_and_aurc_match_brute_force():
  rng = np.random.default_rng(4)
  s = np.round(rng.normal(size=300), 1)  # ties
  c = rng.uniform(size=300) < 1 / (1 + np.exp(-2 * s))
  coverage, precision, thresholds = cal.precision_coverage(s, c)
  assert np.all(np.diff(thresholds) < 0) and coverage[-1] == 1.0
  for cov, prec, t in zip(coverage, precision, thresholds):
    answered = s >= t
    assert cov == pytest.approx(answered.mean())
    assert prec == pytest.approx(c[answered].mean())
  assert len(thresholds) == len(np.unique(s))
  # Brute force: for each sample i, the risk of answering all s_j >= s_i.
  brute = np.mean([1.0 - c[s >= s[i]].mean() for i in range(len(s))])
  assert cal.aurc(s, c) == pytest.approx(brute, abs=1e-12)
  # Without ties it is the usual (1/n) sum_k risk of the top k.
  u = rng.permutation(50).astype(float)
  cu = rng.uniform(size=50) < 0.5
  top = cu[np.argsort(-u)]
  usual = np.mean([1.0 - top[:k].mean() for k in range(1, 51)])
  assert cal.aurc(u, cu) == pytest.approx(usual, abs=1e-12)


def test_ece_and_brier_hand_computed():
  conf = np.array([0.95, 0.85, 0.15, 0.12, 0.55])
  correct = np.array([1, 0, 0, 1, 1], bool)
  s = np.log(conf)
  # Bins of width 0.1: {0.95}, {0.85}, {0.15, 0.12}, {0.55}.
  expected_ece = (abs(1 - 0.95) + abs(0 - 0.85) + 2 * abs(0.5 - 0.135) + abs(1 - 0.55)) / 5
  assert cal.ece(s, correct, n_bins=10) == pytest.approx(expected_ece)
  expected_brier = np.mean([0.05**2, 0.85**2, 0.15**2, 0.88**2, 0.45**2])
  assert cal.brier(s, correct) == pytest.approx(expected_brier)
  assert cal.ece(np.log([1.0]), [True], n_bins=4) == pytest.approx(0.0)


def test_mean_at_k_uses_first_k_valid_samples():
  scores, correct, valid = _ragged_batch(5)
  del scores
  k = 2
  expected = np.mean([correct[q][valid[q]][:k].mean() for q in range(len(correct))])
  assert cal.mean_at_k(correct, k, valid) == pytest.approx(expected)
  with pytest.raises(ValueError, match="fewer valid samples"):
    cal.mean_at_k(correct, 13, valid)


def test_pass_at_k_matches_subset_brute_force():
  scores, correct, valid = _ragged_batch(6, q=25, g=9)
  del scores
  for k in (1, 2, 3):
    brute = []
    for q in range(len(correct)):
      c = correct[q][valid[q]]
      if len(c) < k:
        break
      subsets = list(itertools.combinations(range(len(c)), k))
      brute.append(np.mean([c[list(sub)].any() for sub in subsets]))
    else:
      assert cal.pass_at_k(correct, k, valid) == pytest.approx(np.mean(brute), abs=1e-12)
  full = np.array([[1, 0, 0, 0, 0, 0, 0, 0]], bool)
  assert cal.pass_at_k(full, 8) == 1.0 and cal.pass_at_k(full, 1) == pytest.approx(1 / 8)


def test_maj_at_k_ties_split_and_first():
  answers = [
    ["B", "A", "A", "B", "C", "A"],
    [None, None, "x", "y", None, None],
    [None, None, None, None, None, None],
  ]
  correct = [[0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0], [0] * 6]
  # k=4: q0 tie A/B (A right) -> split 0.5, first = B (index 0) -> 0.
  # q1: x/y tie among two voters -> split 0.5, first = x -> 1. q2 abstains -> 0.
  assert cal.maj_at_k(answers, correct, k=4) == pytest.approx((0.5 + 0.5 + 0) / 3)
  assert cal.maj_at_k(answers, correct, k=4, ties="first") == pytest.approx(1 / 3)
  # All 6: A has 3 votes and wins outright.
  assert cal.maj_at_k(answers[:1], correct[:1]) == 1.0


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="s_QG has shape"):
    cal.auc_mean(np.zeros((2, 3)), np.zeros((2, 4), bool))
  with pytest.raises(ValueError, match="NaN or inf"):
    cal.auc_mean([[np.nan, 0.0]], [[1, 0]])
  with pytest.raises(ValueError, match="boolean or 0/1"):
    cal.auc_mean([[0.1, 0.0]], [[2, 0]])
  with pytest.raises(ValueError, match="ties must be"):
    cal.maj_at_k([["a"]], [[1]], ties="random")


def _row(**over):
  row = {
    "benchmark": "aime25",
    "question_id": "q1",
    "sample_index": 0,
    "completion": "so \\boxed{3}",
    "answer": "3",
    "correct": True,
    "s": -0.25,
    "length": 12,
  }
  row.update(over)
  return json.dumps(row)


@pytest.mark.parametrize(
  "line, message",
  [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_row(s=None).replace('"s": null, ', ""), "missing field 's'"),
    (_row(correct=1), "field 'correct' must be bool"),
    (_row(sample_index=True), "field 'sample_index' must be int"),
    (_row(answer=3), "field 'answer' must be str/NoneType"),
    (_row(s=0.5), "must be finite and <= 0"),
    (_row(length=-1), "must be >= 0"),
    (_row(), "duplicate sample"),
  ],
)
def test_load_samples_errors_name_file_and_line(tmp_path, line, message):
  path = tmp_path / "samples.jsonl"
  path.write_text(_row() + "\n\n" + line + "\n", encoding="utf-8")
  with pytest.raises(ValueError, match=message) as err:
    report.load_samples(path)
  assert f"{path}:3" in str(err.value)


def test_comparison_table_layout():
  def bench(acc, auc, aurc):
    return {"mean@16": acc, "auc_mean": auc, "aurc": aurc, "ece": 0.5}

  runs = {
    "grpo": {"benchmarks": {"math500": bench(0.70, 0.80, 0.2), "aime25": bench(0.10, None, 0.8)}},
    "capo": {"benchmarks": {"math500": bench(0.72, 0.85, 0.1)}},
  }
  lines = comparison.comparison_table(runs).strip().split("\n")
  # The paper's metrics lead; ECE of exp(s) is in no table (comparison.ECE_NOTE).
  assert lines[0] == (
    "| benchmark | grpo acc | grpo AUC | grpo AURC | capo acc | capo AUC | capo AURC |"
  )
  assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|"
  assert lines[2] == "| math500 | 70.0 | 0.800 | 0.200 | 72.0 | 0.850 | 0.100 |"
  assert lines[3] == "| aime25 | 10.0 | - | 0.800 | - | - | - |"
  assert lines[4] == "| average | 40.0 | 0.800 | 0.500 | 72.0 | 0.850 | 0.100 |"
  assert len(lines) == 5
  for columns in (comparison.MAIN_COLUMNS, comparison.EXTRA_COLUMNS):
    assert "ece" not in {key for _, key in columns} and "brier" not in {k for _, k in columns}


def test_traced_auc_mean_equals_the_numpy_one():
  """The rollout's on-device AUC-mean (ties, invalid samples, degenerate questions)
  against the NumPy metric the evaluator reports."""
  import jax  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  s = rng.integers(0, 4, (40, 8)).astype(np.float32) / 4  # many ties
  correct = rng.random((40, 8)) < 0.5
  correct[:3] = True  # all-correct questions: no AUC
  valid = rng.random((40, 8)) < 0.85
  want, n_want = cal.auc_mean(s, correct, valid)
  got, n_got = jax.jit(cal.auc_mean_traced)(s, correct, valid)
  assert int(n_got) == n_want and 0 < n_want < 40
  assert float(got) == pytest.approx(want, abs=1e-6)
  nan, zero = cal.auc_mean_traced(s, np.ones_like(correct), valid)
  assert np.isnan(float(nan)) and int(zero) == 0
