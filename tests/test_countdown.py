"""The Countdown task (capo_jax/data/countdown.py): the checker against hand-computed
cases, the generator against a brute-force solver, the registry loader, and the shrunk
run file end to end with the evaluator's calibration report."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from capo_jax.data import countdown, datasets, reward_fns

GOLD = "3 5 7 1 -> 24"


@pytest.mark.parametrize(
  "completion,expected",
  [
    (r"\boxed{(7 - 3) * (5 + 1)}", True),  # 4 * 6
    (r"\boxed{3 * (7 + 1)}", True),  # a subset of the numbers
    (r"\boxed{(7 + 5) * (3 - 1)}", True),
    (r"$\boxed{3 \times (7 + 1)}$", True),  # LaTeX times
    (r"\boxed{\left(7+1\right) \cdot 3}", True),
    (r"\boxed{3 * (7 + 1) = 24}", True),  # "= target" after the expression
    (r"The answer is 3*(7+1).", True),  # the math grader's fallback phrase
    (r"\boxed{3 * 8}", False),  # 8 is not given
    (r"\boxed{(7 + 5) * (3 - 1) + 1 - 1}", False),  # 1 used twice
    (r"\boxed{3 * (7 + 1) + 0}", False),  # 0 is not given
    (r"\boxed{24}", False),
    (r"\boxed{3 * (7 + 1) - 1}", False),  # 23
    (r"\boxed{(7 + 5) * -(1 - 3)}", False),  # unary minus is not an operation here
    (r"\boxed{3 ** 7}", False),
    (r"\boxed{__import__('os').getcwd()}", False),
    (r"\boxed{3(7 + 1)}", False),  # implicit product: a call node
    (r"\boxed{5 / (1 - 1) + 24}", False),  # division by zero
    (r"\boxed{3 * (7 + 1}", False),  # unclosed box -> no answer
    ("no answer at all", False),
    (r"\boxed{" + "+".join(["1"] * 150) + "}", False),  # over MAX_EXPR_LEN
  ],
)
def test_checker_hand_cases(completion: str, expected: bool) -> None:
  assert countdown.is_correct(completion, GOLD) is expected


def test_exact_fractions_and_repeated_numbers() -> None:
  # 8 / 3 * 3 == 8 exactly (floats would give 7.999...), and a number given twice may be
  # used twice.
  assert countdown.is_correct(r"\boxed{8 / 3 * 3}", "8 3 3 -> 8")
  assert countdown.is_correct(r"\boxed{8 \div 3 \times 3}", "8 3 3 -> 8")
  assert countdown.is_correct(r"\boxed{8 + 3 * (3 - 3)}", "3 3 3 8 -> 8")
  assert not countdown.is_correct(r"\boxed{8 + 3 / (3 - 3)}", "3 3 3 8 -> 8")  # 3 / 0
  assert countdown.is_correct(r"\boxed{(1 + 1) * 9}", "1 1 9 -> 18")
  assert not countdown.is_correct(r"\boxed{(1 + 1) * 9}", "1 2 9 -> 18")
  assert countdown.evaluate("(7 - 3) / 8") == (Fraction(1, 2), [7, 3, 8])
  with pytest.raises(ValueError, match="countdown gold 'junk'"):
    countdown.parse_gold("junk")


def _solvable(numbers: list[int], target: int) -> bool:
  """Brute force, independent of the generator: combine any two of the remaining values
  with + - * / (any order) until one value equals the target (subsets included)."""

  def search(vals: tuple[Fraction, ...]) -> bool:
    if target in vals:
      return True
    for i, j in itertools.permutations(range(len(vals)), 2):
      rest = tuple(v for k, v in enumerate(vals) if k not in (i, j))
      a, b = vals[i], vals[j]
      outs = [a + b, a - b, a * b] + ([a / b] if b else [])
      if any(search(rest + (o,)) for o in outs):
        return True
    return False

  return search(tuple(Fraction(n) for n in numbers))


def test_generator_is_deterministic_solvable_and_registered(tmp_path) -> None:
  first = countdown.examples(40, seed=3)
  assert first == countdown.examples(40, seed=3)
  assert first[:10] == countdown.examples(10, seed=3)  # question i depends on (seed, i) only
  assert first != countdown.examples(40, seed=4)
  for e in first:
    numbers, target = countdown.parse_gold(e.answer)
    assert 3 <= len(numbers) <= 4 and target not in numbers
    assert _solvable(numbers, target), e
    assert str(target) in e.problem and e.meta == {"numbers": numbers, "target": target}
  loaded = datasets.load_examples("countdown", data_dir=str(tmp_path))
  assert len(loaded) == 5000 and loaded.examples[:40] == countdown.examples(40)
  assert datasets.REGISTRY["countdown"].checker == "countdown"
  assert reward_fns.benchmark_checker("countdown") == "countdown"
  # A countdown.jsonl in the data dir wins, and reads back unchanged.
  countdown.write_jsonl(str(tmp_path / "countdown.jsonl"), first)
  assert datasets.load_examples("countdown", data_dir=str(tmp_path)).examples == first


def test_checker_grader_runs_in_the_pool(monkeypatch) -> None:
  monkeypatch.setenv("CAPO_GRADER_WORKERS", "1")
  grader = reward_fns.CheckerGrader("countdown", timeout_s=30.0)
  got, health = grader.score([r"\boxed{3 * (7 + 1)}", r"\boxed{24}"], [GOLD, GOLD])
  assert got.tolist() == [1.0, 0.0] and (health.total, health.correct) == (2, 1)
  reward_fns.pool(30.0).close()


@pytest.mark.slow  # ~1 min on 2 cores: a 2-step GRPO run, then the evaluator
def test_shrink_run_then_calibration_report(tmp_path) -> None:
  import hf_utils  # pylint: disable=import-outside-toplevel
  import rl_driver  # pylint: disable=import-outside-toplevel
  from capo_jax.eval import cli as eval_cli  # pylint: disable=import-outside-toplevel
  from configs import countdown as run_file  # pylint: disable=import-outside-toplevel

  c = run_file.get_config("shrink")
  c.tokenizer_path = str(hf_utils.make_tokenizer_dir(tmp_path / "tok"))
  c.algo.name = "grpo"  # the scalar reward feeds its advantage
  c.reward.overlong_buffer = 4
  c.train.num_steps = 2
  workdir = tmp_path / "run"
  rl_driver.train(c, workdir)
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("accuracy", "auc_mean", "reward_mean", "reward/fn_timeout", "reward/timeout"):
    assert key in rows[-1], key
  assert rows[-1]["reward/total"] == 16 and rows[-1]["reward/fn_timeout"] == 0
  # correct + 0.1 * format + overlong penalty, never above 1.1 or below -1.
  assert -1.0 <= rows[-1]["reward_mean"] <= 1.1
  out = tmp_path / "eval"
  results = eval_cli.main(
    [
      f"--policy={workdir}",
      "--benchmarks=countdown",
      "--limit=2",
      "--num_samples=4",
      "--max_new_tokens=8",
      "--batch_size=2",
      f"--out={out}",
      "--no_plots",
      "--no_progress",
      "--dtype=float32",
    ]
  )
  r = results["benchmarks"]["countdown"]
  assert r["n_questions"] == 2 and r["n_samples"] == 8
  for key in ("mean@4", "auc_mean", "aurc", "ece"):
    assert key in r, key
  samples = [json.loads(line) for line in open(out / "samples.jsonl")]
  assert len(samples) == 8 and all(s["benchmark"] == "countdown" for s in samples)
