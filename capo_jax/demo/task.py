"""A synthetic arithmetic task with verifiable boxed answers for the CPU demo.

A question is an expression of single-digit (by default) operands joined by
``+ - *`` and ending in ``=``, e.g. ``3+4*2-5=``. Its written solution reduces
one operation per line under normal precedence (the leftmost ``*`` first,
then ``+``/``-`` left to right); each line is the whole expression after that
step, and the last line boxes the answer so the project's reward function
extracts it::

    3+8-5
    11-5
    6
    \\boxed{6}

Difficulty grows with the number of operands and their size (``TaskConfig``).

``TaskConfig.wrong_rule = "left_to_right"`` writes a fraction
(``wrong_fraction``) of the *training* solutions with a fluent, consistent
wrong rule: strict left-to-right evaluation that ignores precedence, in the
same one-reduction-per-line format and boxed. Gold answers, rewards and the
held-out questions do not change. A warm start taught on such data samples
the wrong rule on some questions as confidently as the right one: confidently
wrong answers, the samples CAPO's pairwise surrogate is about (and the ones
GRPO's advantage leaves alone once they are rare), which the plain task lacks
(there a wrong answer is one low-probability slip). ``Example.meta`` carries
``rule_answer``, the wrong rule's answer, for every question.

Generation is deterministic in ``TaskConfig.seed``; the held-out questions are
drawn first from their own stream, so they do not change when ``num_train``
does, and the training questions exclude them.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from capo_jax.data.datasets import Example

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
WRONG_RULES = ("", "left_to_right")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Size and difficulty of the synthetic task.

  Attributes:
    min_operands / max_operands: each question draws its operand count
      uniformly from this range (inclusive); more operands = longer chains.
    max_operand: operands are drawn uniformly from ``0..max_operand``.
    operators: the operators to draw from (a subset of ``+-*``).
    num_train / num_heldout: numbers of distinct questions in each split.
    seed: the generation seed.
    wrong_rule: "" (every solution correct) or "left_to_right" (see the module doc).
    wrong_fraction: the fraction of training questions whose written solution
      follows ``wrong_rule`` (a seeded draw; held-out questions are never rewritten).
  """

  min_operands: int = 4
  max_operands: int = 4
  max_operand: int = 9
  operators: str = "+-*"
  num_train: int = 20000
  num_heldout: int = 400
  seed: int = 0
  wrong_rule: str = ""
  wrong_fraction: float = 0.0

  def __post_init__(self) -> None:
    if self.wrong_rule not in WRONG_RULES:
      raise ValueError(f"TaskConfig.wrong_rule={self.wrong_rule!r}: expected one of {WRONG_RULES}")
    if not 0.0 <= self.wrong_fraction <= 1.0:
      raise ValueError(f"TaskConfig.wrong_fraction={self.wrong_fraction} must be in [0, 1]")
    if self.wrong_fraction > 0 and not self.wrong_rule:
      raise ValueError(
        f"TaskConfig.wrong_fraction={self.wrong_fraction} needs a wrong_rule "
        f"(one of {WRONG_RULES[1:]})"
      )
    if self.min_operands < 2 or self.max_operands < self.min_operands:
      raise ValueError(
        f"TaskConfig: need 2 <= min_operands <= max_operands, got "
        f"{self.min_operands}, {self.max_operands}"
      )
    if self.max_operand < 1:
      raise ValueError(f"TaskConfig.max_operand must be >= 1, got {self.max_operand}")
    if (
      not self.operators
      or set(self.operators) - set(_OPS)
      or len(set(self.operators)) != len(self.operators)
    ):
      raise ValueError(
        f"TaskConfig.operators={self.operators!r}: expected distinct "
        f"characters from {''.join(_OPS)!r}"
      )
    if self.num_train < 0 or self.num_heldout < 0:
      raise ValueError(
        f"TaskConfig: num_train={self.num_train} and num_heldout={self.num_heldout} must be >= 0"
      )
    need = self.num_train + self.num_heldout
    if need > self.num_distinct_questions() // 2:
      raise ValueError(
        f"TaskConfig: {need} questions requested but only "
        f"{self.num_distinct_questions()} distinct ones exist; rejection "
        "sampling needs at most half of them (raise max_operand or operands)"
      )

  def num_distinct_questions(self) -> int:
    digits, ops = self.max_operand + 1, len(self.operators)
    return sum(digits**n * ops ** (n - 1) for n in range(self.min_operands, self.max_operands + 1))


def solve_steps(operands: list[int], ops: list[str], rule: str = "") -> list[str]:
  """The chain of thought: the whole expression after each single reduction.

  The last line is the bare value. Only the leading term can turn negative
  (``*`` comes first and ``+``/``-`` reduce left to right), so no line holds
  ``--`` or ``+-`` and every line is itself a valid expression of equal value.
  ``rule="left_to_right"`` always reduces the leftmost operation (the wrong
  rule: ``3+4*2`` -> ``7*2`` -> ``14``); its lines are well-formed too, since
  again only the leading term can be negative.
  """
  if rule not in WRONG_RULES:
    raise ValueError(f"solve_steps: rule={rule!r}, expected one of {WRONG_RULES}")
  if len(operands) != len(ops) + 1:
    raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
  vals, ops = list(operands), list(ops)
  lines = []
  while ops:
    i = ops.index("*") if "*" in ops and not rule else 0
    vals[i : i + 2] = [_OPS[ops[i]](vals[i], vals[i + 1])]
    del ops[i]
    lines.append(format_expression(vals, ops))
  return lines


def format_expression(operands: list[int], ops: list[str]) -> str:
  parts = [str(operands[0])]
  for op, v in zip(ops, operands[1:]):
    parts += [op, str(v)]
  return "".join(parts)


def solution_text(operands: list[int], ops: list[str], rule: str = "") -> str:
  """The full written solution: reduction lines, then ``\\boxed{answer}``."""
  lines = solve_steps(operands, ops, rule)
  return "\n".join(lines + [f"\\boxed{{{lines[-1]}}}"])


def make_example(operands: list[int], ops: list[str], ex_id: str) -> Example:
  """One ``Example``; ``meta`` carries the operands and the reference solution."""
  steps = solve_steps(operands, ops)
  return Example(
    id=ex_id,
    problem=format_expression(operands, ops) + "=",
    answer=steps[-1],
    meta={
      "operands": list(operands),
      "ops": list(ops),
      "solution": solution_text(operands, ops),
      "num_steps": len(steps),
      "rule_answer": solve_steps(operands, ops, "left_to_right")[-1],
      "rule": "",
    },
  )


def rewrite_with_rule(ex: Example, rule: str) -> Example:
  """``ex`` with its written solution following ``rule`` (the gold answer unchanged)."""
  ops, operands = ex.meta["ops"], ex.meta["operands"]
  return Example(
    id=ex.id,
    problem=ex.problem,
    answer=ex.answer,
    meta={**ex.meta, "solution": solution_text(operands, ops, rule), "rule": rule},
  )


def _draw(
  cfg: TaskConfig, rng: np.random.Generator, count: int, exclude: set[str], prefix: str
) -> list[Example]:
  """``count`` distinct questions not in ``exclude`` (which is extended).

  Duplicates are redrawn, operand count included, so when the questions of a
  small count run out (2 operands: 300), the larger counts fill in.
  """
  out: list[Example] = []
  attempts, max_attempts = 0, 50 * count + 1000
  while len(out) < count:
    attempts += 1
    if attempts > max_attempts:
      raise RuntimeError(
        f"could not draw {count} distinct questions for {prefix!r} "
        f"after {max_attempts} attempts (space too small for {cfg})"
      )
    n = int(rng.integers(cfg.min_operands, cfg.max_operands + 1))
    operands = [int(x) for x in rng.integers(0, cfg.max_operand + 1, size=n)]
    ops = [cfg.operators[int(j)] for j in rng.integers(0, len(cfg.operators), size=n - 1)]
    key = format_expression(operands, ops)
    if key in exclude:
      continue
    exclude.add(key)
    out.append(make_example(operands, ops, f"{prefix}-{len(out)}"))
  return out


def make_splits(cfg: TaskConfig) -> tuple[list[Example], list[Example]]:
  """(train, heldout) lists of distinct, disjoint questions, deterministic in the seed."""
  seen: set[str] = set()
  heldout = _draw(cfg, np.random.default_rng([cfg.seed, 1]), cfg.num_heldout, seen, "heldout")
  train = _draw(cfg, np.random.default_rng([cfg.seed, 0]), cfg.num_train, seen, "train")
  if cfg.wrong_fraction > 0:
    pick = np.random.default_rng([cfg.seed, 2]).permutation(len(train))
    wrong = set(pick[: round(cfg.wrong_fraction * len(train))].tolist())
    train = [
      rewrite_with_rule(ex, cfg.wrong_rule) if i in wrong else ex for i, ex in enumerate(train)
    ]
  return train, heldout
