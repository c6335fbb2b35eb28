"""Answer grouping within a time budget (capo_jax.eval.grouping): slow checks in the grader
pool, a hung check counted as "different", the sequential classes kept when nothing hangs.

The slow checks are standard-library functions run in the pool's worker processes:
``time:sleep`` hangs like a pathological math-verify call, ``operator:le`` answers at once.
"""

from __future__ import annotations

import importlib
import logging
import time

import numpy as np
import pytest

from capo_jax.eval import grouping, report

HANG = grouping.PairCheck(lambda a, b: (3600.0,), slow="time:sleep")


def _near(a: str, b: str) -> bool:
  """Not transitive (0 ~ 1 ~ 2 but not 0 ~ 2): the classes depend on the comparison order."""
  return abs(int(a) - int(b)) <= 1


def _near_fast(a: str, b: str) -> bool | tuple:
  # Far pairs are decided here; near ones go to the pool as operator.le(|a - b|, 1).
  d = abs(int(a) - int(b))
  return False if d > 3 else (d, 1)


def test_question_whose_answers_all_hang_finishes_within_the_budget():
  answers = [str(i) for i in range(16)]  # 16 distinct answers: 120 pairs, all hang
  limits = grouping.Limits(budget_s=4.0, pair_timeout_s=1.0, num_workers=2)
  start = time.monotonic()
  with grouping.AnswerGrouper(HANG, limits) as grouper:
    got = grouper.group(answers)
  assert time.monotonic() - start < 30.0
  # Every pair counts as "different": each answer is its own class, all 120 pairs counted.
  np.testing.assert_array_equal(got.group_G, np.arange(16))
  assert got.n_unresolved == 16 * 15 // 2


def _record(q: str, i: int, answer: str | None) -> dict:
  return {
    "benchmark": "b",
    "question_id": q,
    "sample_index": i,
    "completion": f"c{i}",
    "answer": answer,
    "correct": answer in ("1", "1.0"),
    "s": -0.5,
    "length": 3,
  }


def test_timed_out_pairs_count_as_different_and_are_reported(caplog):
  # Numbers are compared here; a pair with an "x" answer hangs in the pool.
  check = grouping.PairCheck(
    lambda a, b: (3600.0,) if "x" in a + b else float(a) == float(b), slow="time:sleep"
  )
  answers = ["1", "1.0", "2", "x1", "x2", "1", None]
  config = report.ResultsConfig(
    grouping=check,
    mean_ks=(),
    pass_ks=(),
    maj_ks=(7,),
    grouping_limits=grouping.Limits(budget_s=3.0, pair_timeout_s=1.0, num_workers=2),
  )
  with caplog.at_level(logging.WARNING, logger="capo_jax.eval.report"):
    res = report.compute_results([_record("q", i, a) for i, a in enumerate(answers)], config)[
      "benchmarks"
    ]["b"]
  # x1 against the classes of 1 and 2, then x2 against 1, 2 and x1: 5 pairs unchecked.
  assert res["grouping_timeouts"] == 5
  assert "b: 5 answer pairs counted as different" in caplog.text
  # Classes [1, 1.0, 1], [2], [x1], [x2]: majority picks "1" (3 votes), which is correct.
  assert res["maj@k"]["7"] == 1.0


def test_pool_grouping_equals_the_sequential_comparison():
  rng = np.random.default_rng(0)
  limits = grouping.Limits(budget_s=120.0, pair_timeout_s=60.0, num_workers=2)
  check = grouping.PairCheck(_near_fast, slow="operator:le")
  with grouping.AnswerGrouper(check, limits) as grouper:
    for _ in range(6):
      answers = [None if rng.random() < 0.15 else str(rng.integers(0, 8)) for _ in range(16)]
      got = grouper.group(answers)
      want = grouping.group_answers(answers, _near)  # one pair at a time, in this process
      np.testing.assert_array_equal(got.group_G, want)
      assert got.n_unresolved == 0
    assert grouper._pool is not None  # the near pairs did go through the pool


def test_rewards_check_decides_plain_numbers_here_and_defers_the_rest():
  with grouping.AnswerGrouper("rewards") as grouper:
    got = grouper.group(["\\frac{1}{2}", "0.5", "3", None])
    assert list(got.group_G) == [0, 0, 1, -1] and got.n_unresolved == 0
    assert grouper._pool is None  # the grader's cheap path decided every pair
  # A pair the cheap path cannot decide becomes the pool function's arguments.
  args = grouping.REWARDS_CHECK.fast("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
  assert args == ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 0)
  for name in (grouping.REWARDS_CHECK.slow, grouping.REWARDS_CHECK.warmup):
    module, _, fn = name.partition(":")
    assert callable(getattr(importlib.import_module(module), fn))


def test_rewards_check_runs_math_verify_in_the_pool():
  with grouping.AnswerGrouper("rewards", grouping.Limits(num_workers=1)) as grouper:
    got = grouper.group(["\\frac{\\sqrt{2}}{2}", "3", "\\frac{1}{\\sqrt{2}}"])
  assert list(got.group_G) == [0, 1, 0] and got.n_unresolved == 0


def test_limits_reject_a_non_positive_budget():
  with pytest.raises(ValueError, match="budget_s"):
    grouping.Limits(budget_s=0)
