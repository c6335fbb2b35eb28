"""Tests of capo_jax.data.rewards: extraction, equivalence, health counters, the deadline pool."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from capo_jax.data import answers, rewards

BENCHMARKS = ("math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench")


@pytest.fixture(scope="module")
def grader():
  """One pool for the module: starting spawned workers costs about a second each."""
  g = rewards.Grader(num_workers=2, timeout_s=2.0)
  yield g
  g.close()


def _boxed(s: str) -> str:
  return f"Some reasoning here.\nSo the final result is $\\boxed{{{s}}}$."


# -- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "text,expected",
  [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{\left(\frac{a}{b}, \sqrt{2}\right)}", r"\left(\frac{a}{b}, \sqrt{2}\right)"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
    (r"\boxed{x^{2^{3}}} more text", r"x^{2^{3}}"),
    (r"\fbox{42}", "42"),
    (r"\boxed 7 apples", "7"),
    (r"first \boxed{1}, then \fbox{2}, finally \boxed{3}", "3"),
    (r"\boxed{\boxed{5}}", "5"),
  ],
)
def test_extract_last_box_with_nested_braces(text: str, expected: str) -> None:
  assert answers.extract_answer(text) == (expected, True)


@pytest.mark.parametrize(
  "text,expected",
  [
    ("We get 12 apples. The answer is 12.", "12"),
    ("Thus the final answer is $\\frac{1}{2}$. Done", r"\frac{1}{2}"),
    ("**Answer:** 3", "3"),
    ("The answer is 4. Wait, the answer is 5.", "5"),
  ],
)
def test_fallback_used_only_without_a_box(text: str, expected: str) -> None:
  assert answers.extract_answer(text) == (expected, False)
  # With a box anywhere, the box wins over any phrase after it.
  assert answers.extract_answer(r"\boxed{99} " + text) == ("99", True)


def test_unclosed_or_empty_box_and_no_answer() -> None:
  assert answers.extract_answer(r"so \boxed{\frac{1}{2} and then it stopped") == (None, True)
  assert answers.extract_answer(r"\boxed{}") == (None, True)
  assert answers.extract_answer("I do not know.") == (None, False)


# -- equivalence ------------------------------------------------------------------------------

# (gold, model answer) pairs in the formats of ../shared/data golds and of typical outputs.
EQUAL = [
  ("025", "25"),
  ("25", "025"),
  ("7", "007"),
  ("-12", "-12"),
  ("\\frac{1}{2}", "0.5"),
  ("\\frac{1}{2}", "\\dfrac12"),
  ("\\dfrac{17}{50}", "\\frac{17}{50}"),
  ("\\frac43", "4/3"),
  ("\\frac 59", "\\tfrac{5}{9}"),
  ("$2n$", "2n"),
  ("$2n-2$", "2n - 2"),
  ("$2^{1009}$", "2^{1009}"),
  ("$\\frac{9}{32}$", "\\frac{9}{32}"),
  ("90^\\circ", "90"),
  ("90^\\circ", "90^{\\circ}"),
  ("$90^{\\circ}$,$60^{\\circ}$", "90^\\circ, 60^\\circ"),
  ("25\\%", "25"),
  ("25\\%", "0.25"),
  ("10,\\!080", "10080"),
  ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
  ("58,500", "58500"),
  ("\\$32,\\!348", "32348"),
  ("\\$18.90", "18.9"),
  ("5.4 \\text{ cents}", "5.4"),
  ("864 \\mbox{ inches}^2", "864"),
  ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
  ("\\text{Evelyn}", "Evelyn"),
  ("\\text{(C)}", "C"),
  ("\\text{(C)}", "\\textbf{(C)}"),
  ("(3,4]", "(3, 4]"),
  ("(-\\infty, 0]", "(-\\infty,0]"),
  ("(2,\\infty)", "x > 2"),
  ("x \\in [-2,7]", "[-2,7]"),
  ("$[\\frac{1}{2}, 8]$", "[0.5, 8]"),
  ("(0,9) \\cup (9,36)", "(0,9)\\cup(9,36)"),
  ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
  ("$(1,8,19), (2,7,13), (4,5,7)$", "(4,5,7),(1,8,19),(2,7,13)"),
  ("1,-2", "-2, 1"),
  ("\\{1\\pm\\sqrt{5},-2\\}", "1+\\sqrt5,1-\\sqrt5,-2"),
  ("3 \\pm 2 \\sqrt{2}", "3+2\\sqrt2, 3-2\\sqrt2"),
  ("p - q", "-q+p"),
  ("6 - 5i", "6-5i"),
  ("1\\frac{4}{5}", "1.8"),
  ("137 \\frac{1}{2}", "137.5"),
  ("x=5", "5"),
  ("y = 2x + 3", "y=3+2x"),
  (
    "\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}",
    "\\begin{pmatrix} -\\dfrac13 \\\\ \\frac{2}{3} \\end{pmatrix}",
  ),
  ("1.70e4", "1.7 \\times 10^4"),
  ("4.5e33", "4.5 \\times 10^{33}"),
  ("-1./3", "-\\frac13"),
  ("np.arcsin(10/13)", "\\arcsin(10/13)"),
  ("\\cot x", "\\frac{\\cos x}{\\sin x}"),
]
# Perturbed answers: changed number, interval endpoint or sign, other choice or word.
UNEQUAL = [
  ("025", "26"),
  ("7", "-7"),
  ("-12", "12"),
  ("\\frac{1}{2}", "-0.5"),
  ("\\frac{1}{2}", "0.51"),
  ("\\frac43", "\\frac34"),
  ("$2n-2$", "2n+2"),
  ("$2^{1009}$", "2^{1008}"),
  ("90^\\circ", "91"),
  ("25\\%", "26"),
  ("10,\\!080", "10081"),
  ("\\$18.90", "18.91"),
  ("\\text{Evelyn}", "Navin"),
  ("\\text{(C)}", "D"),
  ("(3,4]", "(3,4)"),
  ("(3,4]", "(3,5]"),
  ("(-\\infty, 0]", "(-\\infty,0)"),
  ("$[\\frac{1}{2}, 8]$", "[0.5, 9]"),
  ("$[\\frac{1}{2}, 8]$", "(0.5, 8]"),
  ("(0,9) \\cup (9,36)", "(0,36)"),
  ("$(1,8,19), (2,7,13), (4,5,7)$", "(1,8,19),(2,7,13)"),
  ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi)"),
  ("p - q", "q-p"),
  ("6 - 5i", "6+5i"),
  ("-\\frac{24}{25}", "\\frac{24}{25}"),
  ("1.70e4", "1.8 \\times 10^4"),
  ("x=5", "x=-5"),
  ("\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}", "\\begin{pmatrix} 1/3 \\\\ 2/3 \\end{pmatrix}"),
]


def test_equivalent_and_perturbed_forms_pool_and_serial_agree(grader: rewards.Grader) -> None:
  pairs = EQUAL + UNEQUAL
  want = np.array([1.0] * len(EQUAL) + [0.0] * len(UNEQUAL), np.float32)
  comps, golds = [_boxed(p) for _, p in pairs], [g for g, _ in pairs]
  got_pool, health = grader.score(comps, golds)
  got_serial, _ = rewards.score_serial(comps, golds)
  wrong = [(pairs[i], want[i]) for i in np.flatnonzero(got_pool != want)]
  assert not wrong, f"misjudged (pair, expected): {wrong}"
  np.testing.assert_array_equal(got_serial, got_pool)
  assert (health.timeout, health.exception) == (0, 0)
  assert got_pool.dtype == np.float32


def test_integer_fast_path_matches_int_compare() -> None:
  rng = np.random.default_rng(0)
  a = rng.integers(-30, 30, 4000)
  b = np.where(rng.random(4000) < 0.5, a, rng.integers(-30, 30, 4000))
  golds = [str(x) for x in a]
  comps = [_boxed(f"{y:03d}" if y >= 0 and i % 3 == 0 else str(y)) for i, y in enumerate(b)]
  t0 = time.perf_counter()
  got, health = rewards.score_serial(comps, golds)
  elapsed = time.perf_counter() - t0
  np.testing.assert_array_equal(got, (a == b).astype(np.float32))
  assert health.total == 4000 and health.correct == int((a == b).sum())
  assert all(rewards._prepare(c, g)[0] is not None for c, g in zip(comps[:200], golds[:200]))
  assert elapsed < 4.0, f"integer fast path too slow: {elapsed:.2f} s for 4000 items"


def test_health_counters_and_is_correct(grader: rewards.Grader, monkeypatch) -> None:
  comps = [
    _boxed("5"),
    _boxed("6"),
    "The answer is 5.",
    "no answer at all",
    r"\boxed{5",
    r"\boxed{}",
    _boxed(r"\frac{10}{2}"),
  ]
  rew, health = grader.score(comps, ["5"] * len(comps))
  np.testing.assert_array_equal(rew, [1, 0, 1, 0, 0, 0, 1])
  assert health.as_dict() == {
    "total": 7,
    "correct": 3,
    "no_box": 2,
    "parse_failure": 2,
    "timeout": 0,
    "exception": 0,
  }
  total = health + health
  assert total.total == 14 and total.parse_failure == 4
  monkeypatch.setattr(rewards, "_default", grader)  # reuse the module's pool
  assert rewards.is_correct(_boxed("0.5"), "\\frac{1}{2}")
  assert not rewards.is_correct(_boxed("(1, 2)"), "[1,2]")
  np.testing.assert_array_equal(rewards.score([_boxed("3"), _boxed("x")], ["3", "y"]), [1, 0])
  with pytest.raises(ValueError, match="2 completions but 1 gold"):
    grader.score(["a", "b"], ["a"])


# -- data-driven checks on ../shared/data -----------------------------------------------------


def _rows(shared_data, name: str) -> list[dict]:
  with open(shared_data / f"{name}.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_math500_reference_solutions_match_gold(shared_data, grader: rewards.Grader) -> None:
  rows = _rows(shared_data, "math500")
  rew, health = grader.score([r["solution"] for r in rows], [r["answer"] for r in rows])
  bad = [
    (r["id"], r["answer"], answers.extract_boxed(r["solution"])) for r, x in zip(rows, rew) if not x
  ]
  for row in bad:
    print("MATH500 disagreement (id, gold, boxed):", row)
  assert len(bad) <= 0.01 * len(rows), bad
  assert health.timeout == 0


_INT = re.compile(r"-?\d+")
_FRAC = re.compile(r"(-?)\\frac\{(\d+)\}\{(\d+)\}")
_INTERVAL = re.compile(r"([\[(])(-?\d+), ?(-?\d+)([\])])")


def _forms_and_perturbations(gold: str) -> tuple[list[str], list[str]]:
  """Model-style rewrites of a gold answer that must match, and perturbations that must not."""
  g = gold.strip()
  same, diff = [g, g.strip("$")], []
  if _INT.fullmatch(g):
    n = int(g)
    same += [str(n), f"{n}.0", f"{n:,}"]
    diff += [str(n + 1)] + ([str(-n)] if n else [])
  elif m := _FRAC.fullmatch(g):
    sign, a, b = m.group(1), int(m.group(2)), int(m.group(3))
    same += [f"{sign}\\dfrac{{{a}}}{{{b}}}", f"{sign}{a}/{b}"]
    diff += [f"{sign}\\frac{{{a + 1}}}{{{b}}}", f"{'' if sign else '-'}\\frac{{{a}}}{{{b}}}"]
  elif m := _INTERVAL.fullmatch(g.strip("$")):
    lo, hi = m.group(2), m.group(3)
    same += [f"{m.group(1)}{lo},{hi}{m.group(4)}"]
    diff += [f"{m.group(1)}{lo},{int(hi) + 1}{m.group(4)}"]
  return same, diff


def test_gold_answers_equal_their_forms_and_not_perturbations(
  shared_data, grader: rewards.Grader
) -> None:
  comps, golds, want = [], [], []
  for name in BENCHMARKS:
    for r in _rows(shared_data, name):
      same, diff = _forms_and_perturbations(r["answer"])
      for form, label in [(s, 1.0) for s in same] + [(d, 0.0) for d in diff]:
        comps.append(_boxed(form))
        golds.append(r["answer"])
        want.append(label)
  got, health = grader.score(comps, golds)
  want_arr = np.array(want, np.float32)
  wrong = [
    (golds[i], answers.extract_boxed(comps[i]), want[i]) for i in np.flatnonzero(got != want_arr)
  ]
  assert not wrong, f"{len(wrong)} misjudged (gold, form, expected): {wrong[:20]}"
  assert health.timeout == 0 and len(comps) > 3000


# -- the time limit ---------------------------------------------------------------------------


def test_pathological_item_times_out_off_the_main_thread(grader: rewards.Grader) -> None:
  # 9^(9^9) has ~370 million digits: sympy grinds on it far past the 2 s limit.
  comps = [_boxed("9^{9^{9}}"), _boxed("\\frac{3}{6}"), _boxed("(3,4]"), _boxed("2")]
  golds = ["5", "0.5", "(3,4]", "3"]
  out: dict = {}

  def run() -> None:
    t0 = time.perf_counter()
    out["result"] = grader.score(comps, golds)
    out["elapsed"] = time.perf_counter() - t0

  restarts = grader.num_restarts
  thread = threading.Thread(target=run)
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive(), "scoring hung"
  rew, health = out["result"]
  np.testing.assert_array_equal(rew, [0, 1, 1, 0])
  assert health.timeout == 1 and health.exception == 0
  assert out["elapsed"] < 2.0 + 10.0, out["elapsed"]
  assert grader.num_restarts == restarts + 1
  # The replaced worker serves the next batch.
  rew2, health2 = grader.score([_boxed("x > 2")] * 3, ["(2,\\infty)"] * 3)
  np.testing.assert_array_equal(rew2, [1, 1, 1])
  assert health2.timeout == 0


def test_deadline_pool_timeout_error_crash_and_close() -> None:
  from capo_jax.data._grader_pool import ERROR, OK, TIMEOUT, DeadlinePool

  pool = DeadlinePool("time:sleep", num_workers=2, timeout_s=0.5)
  items = [(0.0,), (30.0,), (0.01,), (-1.0,), (0.0,)]  # sleep(-1) raises ValueError
  t0 = time.perf_counter()
  out = pool.map(items)
  # Well under the 30 s sleep, so that item was killed, not waited for; spawning the
  # workers took up to 19 s on a loaded 2-core box, so the bound leaves room for that.
  assert time.perf_counter() - t0 < 25.0
  assert [k for k, _ in out] == [OK, TIMEOUT, OK, ERROR, OK]
  assert "ValueError" in out[3][1] and pool.num_restarts == 1
  crash = DeadlinePool("os:_exit", num_workers=1, timeout_s=5.0)
  out = crash.map([(3,), (4,)])  # each item kills its worker; both reported, pool recovers
  assert [k for k, _ in out] == [ERROR, ERROR] and "exit code 3" in out[0][1]
  procs = [w.proc for w in pool._workers]
  pool.close()
  crash.close()
  assert all(p.poll() is not None for p in procs)
  assert pool.map([(0.0,)]) == [(OK, None)]  # a closed pool starts afresh
  pool.close()


def test_recycling_waits_while_another_worker_starts(tmp_path, monkeypatch) -> None:
  """Both workers reach max_calls in one map: the second keeps working until the first's
  replacement (a 3 s import here) is ready, instead of both restarting at once."""
  from capo_jax.data._grader_pool import DeadlinePool

  (tmp_path / "slow_start.py").write_text("import time\n\ndef warm():\n  time.sleep(3)\n")
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
  )
  pool = DeadlinePool(
    "os:getpid", num_workers=2, timeout_s=60.0, warmup="slow_start:warm", max_calls=2
  )
  try:
    assert pool.wait_ready(120.0)
    pool.map([()])  # one worker 1 item from its limit
    second = pool.map([()] * 8)
    assert all(k == "ok" for k, _ in second)
    # One worker recycled at its 2nd item; the other, at its limit too, answered the rest
    # while the replacement was importing.
    assert pool.num_recycled == 1
    assert len({v for _, v in second}) == 2
    assert pool.wait_ready(120.0)  # the replacement is ready: the deferred recycle happens
    pool.map([()] * 16)
    assert pool.num_recycled == 2
  finally:
    pool.close()
