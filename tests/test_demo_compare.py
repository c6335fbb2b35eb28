"""The demo v2 pieces: the wrong-rule task, the paired comparison, the noisy verifier."""

from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest

from capo_jax.data import rewards
from capo_jax.demo import compare
from capo_jax.demo import run as demo_run
from capo_jax.demo import task as task_lib

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _left_to_right(operands: list[int], ops: list[str]) -> int:
  acc = operands[0]
  for op, v in zip(ops, operands[1:]):
    acc = _OPS[op](acc, v)
  return acc


def _eval_left_to_right(expr: str) -> int:
  """Parses a line like ``-3*4+2`` and folds it left to right."""
  nums, ops, i = [], [], 0
  while i < len(expr):
    j = i + 1 if expr[i] == "-" and i == 0 else i
    while j < len(expr) and expr[j].isdigit():
      j += 1
    nums.append(int(expr[i:j]))
    if j < len(expr):
      ops.append(expr[j])
    i = j + 1
  return _left_to_right(nums, ops)


def test_left_to_right_solution_matches_a_fold_and_each_line_keeps_the_value():
  for operands in itertools.product(range(0, 10, 3), repeat=4):
    for ops in itertools.product("+-*", repeat=3):
      lines = task_lib.solve_steps(list(operands), list(ops), "left_to_right")
      want = _left_to_right(list(operands), list(ops))
      assert int(lines[-1]) == want
      assert all(_eval_left_to_right(line) == want for line in lines)
      assert len(lines) == 3
  text = task_lib.solution_text([3, 4, 2, 5], ["+", "*", "-"], "left_to_right")
  assert text == "7*2-5\n14-5\n9\n\\boxed{9}"


def test_wrong_fraction_rewrites_only_that_share_of_training_solutions():
  base = task_lib.TaskConfig(num_train=1000, num_heldout=200, seed=3)
  wrong = task_lib.TaskConfig(
    num_train=1000, num_heldout=200, seed=3, wrong_rule="left_to_right", wrong_fraction=0.3
  )
  (tr0, ho0), (tr1, ho1) = task_lib.make_splits(base), task_lib.make_splits(wrong)
  assert [(e.problem, e.answer) for e in tr0] == [(e.problem, e.answer) for e in tr1]
  assert [e.meta for e in ho0] == [e.meta for e in ho1]  # held-out untouched
  rewritten = [e for e in tr1 if e.meta["rule"]]
  assert len(rewritten) == 300
  for e in rewritten:
    assert e.meta["solution"].endswith(f"\\boxed{{{e.meta['rule_answer']}}}")
    assert int(e.meta["rule_answer"]) == _left_to_right(e.meta["operands"], e.meta["ops"])
  with pytest.raises(ValueError, match="wrong_rule"):
    task_lib.TaskConfig(wrong_rule="right_to_left")
  with pytest.raises(ValueError, match="needs a wrong_rule"):
    task_lib.TaskConfig(wrong_fraction=0.5)


def test_difficulty_buckets_by_the_warm_start_accuracy():
  correct = np.zeros((5, 4), bool)
  correct[1, :1] = True  # 0.25 -> [0, 0.25]
  correct[2, :2] = True  # 0.5  -> (0.25, 0.5]
  correct[3, :3] = True  # 0.75 -> (0.5, 0.75]
  correct[4, :] = True  # 1.0  -> (0.75, 1]
  idx, labels = compare.difficulty_buckets(correct)
  assert idx.tolist() == [0, 0, 1, 2, 3]
  assert labels == ["[0, 0.25]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.75, 1]"]
  got = compare.bucket_auc([np.nan, 0.5, 1.0, 0.25, np.nan], idx, 4)
  assert got[0] == (0.5, 1) and got[1] == (1.0, 1) and got[2] == (0.25, 1)
  assert np.isnan(got[3][0]) and got[3][1] == 0


def test_paired_delta_is_the_mean_over_pairs_mixed_under_both():
  a = np.array([[0.9, np.nan, 0.7], [0.6, 0.8, np.nan]])
  b = np.array([[0.5, 0.4, np.nan], [0.6, 0.3, 0.2]])
  out = compare.paired_delta_auc(a, b, n_boot=500)
  assert out["pairs"] == 3
  assert out["delta"] == pytest.approx((0.4 + 0.0 + 0.5) / 3)
  assert out["lo"] <= out["delta"] <= out["hi"]
  const = compare.paired_delta_auc(np.full((3, 50), 0.8), np.full((3, 50), 0.7), n_boot=200)
  assert const["lo"] == pytest.approx(0.1) and const["hi"] == pytest.approx(0.1)


def test_paired_delta_interval_covers_the_true_mean_about_95_percent():
  rng = np.random.default_rng(0)
  hits, trials = 0, 200
  for t in range(trials):
    # Seed effects and question effects, both resampled by the two-way bootstrap.
    d = (
      0.05
      + 0.03 * rng.normal(size=(3, 1))
      + 0.1 * rng.normal(size=(1, 80))
      + 0.1 * rng.normal(size=(3, 80))
    )
    b = rng.uniform(0.3, 0.7, size=(3, 80))
    out = compare.paired_delta_auc(b + d, b, n_boot=400, seed=t)
    hits += out["lo"] <= 0.05 <= out["hi"]
  # Two-way bootstrap with 3 seeds is conservative-to-slightly-narrow; a broken
  # resampler (questions only, or none) covers far less often.
  assert 0.80 <= hits / trials <= 1.0


def test_value_at_accuracy_interpolates_between_evaluations():
  evals = [
    dict(accuracy=0.4, auc_mean=0.7),
    dict(accuracy=0.6, auc_mean=0.9),
    dict(accuracy=0.7, auc_mean=0.8),
  ]
  assert compare.value_at_accuracy(evals, 0.5, "auc_mean") == pytest.approx(0.8)
  assert compare.value_at_accuracy(evals, 0.3, "auc_mean") == pytest.approx(0.7)
  assert compare.value_at_accuracy(evals, 0.65, "auc_mean") == pytest.approx(0.85)
  assert np.isnan(compare.value_at_accuracy(evals, 0.8, "auc_mean"))


class _SerialGrader:
  """The project's real scoring function, in this process."""

  def score(self, completions, golds):
    return rewards.score_serial(completions, golds)


def test_noisy_grader_flips_the_given_fraction_deterministically():
  n = 4000
  texts = [f"\\boxed{{{i % 7}}}" for i in range(n)]
  golds = [str(i % 3) for i in range(n)]
  true, _ = _SerialGrader().score(texts, golds)
  noisy = compare.NoisyGrader(_SerialGrader(), 0.1, seed=1)
  r1, health = noisy.score(texts, golds)
  r2, _ = noisy.score(texts, golds)
  np.testing.assert_array_equal(r1, r2)
  frac = float((r1 != true).mean())
  assert abs(frac - 0.1) < 4 * np.sqrt(0.1 * 0.9 / n)
  assert health.correct == int(true.sum())  # the health counts the true verdicts
  r3, _ = compare.NoisyGrader(_SerialGrader(), 0.1, seed=2).score(texts, golds)
  assert (r3 != r1).any()
  with pytest.raises(ValueError, match="flip_prob"):
    compare.NoisyGrader(_SerialGrader(), 0.5)


def test_rule_share_counts_wrong_samples_that_follow_the_rule():
  ex = task_lib.make_example([3, 4, 2, 5], ["+", "*", "-"], "q0")  # gold 6, rule 9
  same = task_lib.make_example([1, 2, 3, 4], ["+", "+", "+"], "q1")  # rule = gold
  completions = [
    "\\boxed{6}",
    "\\boxed{9}",
    "\\boxed{7}",
    "\\boxed{9}",
    "\\boxed{1}",
    "\\boxed{10}",
    "\\boxed{10}",
    "\\boxed{10}",
  ]
  correct = np.array([[True, False, False, False], [False, True, True, True]])
  # q0: wrong samples 9, 7, 9 -> 2 of 3 follow the rule; q1 is skipped.
  assert demo_run.rule_share(completions, [ex, same], correct) == pytest.approx(2 / 3)


def test_dynamic_sampling_is_compared_at_the_shorter_runs_wall_time(tmp_path):
  import json  # pylint: disable=import-outside-toplevel

  from studies.grpo_vs_capo import report as study  # pylint: disable=import-outside-toplevel

  # capo: 4 steps of 1 s; capo_dyn: 4 steps of 2 s. Evals at steps 0, 2, 4.
  for name, dt, accs, aucs in (
    ("capo_seed0", 1.0, (0.4, 0.6, 0.7), (0.7, 0.8, 0.85)),
    ("capo_dyn_seed0", 2.0, (0.4, 0.8, 0.9), (0.7, 0.9, 0.95)),
  ):
    d = tmp_path / name
    d.mkdir()
    # As the loop writes it: each evaluation a row of its own, after its step's row.
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    for k in range(1, 5):
      rows.append({"step": k, "time_step": dt})
      if k % 2 == 0:
        rows.append({"step": k, "eval/accuracy": accs[k // 2]})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "evals.json").write_text(
      json.dumps(
        [{"step": k, "accuracy": a, "auc_mean": u} for k, a, u in zip((0, 2, 4), accs, aucs)]
      )
    )
  (row,) = study.equal_wall_time(str(tmp_path), study.load_runs(str(tmp_path)))
  # The base ran 4 s in all; capo_dyn at 4 s is at its step 2 (0.8, 0.9).
  assert row["seconds"] == 4.0
  assert (row["dyn_accuracy"], row["dyn_auc_mean"]) == pytest.approx((0.8, 0.9))
  assert (row["base_accuracy"], row["base_auc_mean"]) == pytest.approx((0.7, 0.85))
  assert compare.value_at([0, 2], [1.0, 3.0], 0.5) == pytest.approx(1.5)
  assert np.isnan(compare.value_at([0, 2], [1.0, 3.0], 2.5))
