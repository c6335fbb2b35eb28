"""Countdown: a task whose answers are arithmetic expressions, not boxed numbers.

Each question gives a few numbers and a target; a completion is correct when the
expression in its final answer (the last ``\\boxed{...}``, or the math grader's
"the answer is ..." fallbacks) uses only those numbers, each at most as often as
given, with ``+ - * /`` and parentheses, and equals the target exactly.

The expression is read by walking its Python syntax tree (``ast``) with a white list of
nodes: non-negative integer literals, the four binary operators and parentheses. Nothing
is ever passed to ``eval``; unary minus, powers, names, calls and every other node are
rejected. Arithmetic is exact (``fractions.Fraction``), so 8 / 3 * 3 equals 8.

Nothing can be downloaded here, so the dataset is generated: ``examples(n, seed)``
builds ``n`` solvable questions deterministically (question i depends only on
(seed, i)). Registered as ``countdown`` in ``capo_jax.data.datasets.REGISTRY``; a
``countdown.jsonl`` in the data dir (rows ``{"id", "problem", "answer"}``, e.g. written
by ``write_jsonl``) takes precedence, as for every registry name.

The gold answer of a question is a string ``"3 5 7 1 -> 24"`` (the numbers, then the
target), so the checker has the grader interface ``is_correct(completion, gold)``.
"""

from __future__ import annotations

import ast
import collections
import json
import operator
import random
from fractions import Fraction
from typing import Callable

from capo_jax.data.answers import extract_answer
from capo_jax.data.rows import Example

MAX_EXPR_LEN = 200  # longer answers are wrong without being parsed
_OPS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
}
# LaTeX and typographic spellings models write inside a box -> Python's.
_REPLACE = (
  ("\\left", ""),
  ("\\right", ""),
  ("\\times", "*"),
  ("\\cdot", "*"),
  ("×", "*"),
  ("·", "*"),
  ("\\div", "/"),
  ("÷", "/"),
  ("−", "-"),
  ("\\{", "("),
  ("\\}", ")"),
  ("{", "("),
  ("}", ")"),
  ("[", "("),
  ("]", ")"),
  ("$", ""),
)


def format_gold(numbers: list[int], target: int) -> str:
  return f"{' '.join(str(n) for n in numbers)} -> {target}"


def parse_gold(gold: str) -> tuple[list[int], int]:
  """``"3 5 7 1 -> 24"`` -> ([3, 5, 7, 1], 24); ValueError naming the string otherwise."""
  numbers, sep, target = gold.partition("->")
  try:
    if not sep:
      raise ValueError("no '->'")
    return [int(x) for x in numbers.split()], int(target)
  except ValueError as e:
    raise ValueError(f"countdown gold {gold!r}: expected 'n1 n2 ... -> target' ({e})") from e


class _Rejected(Exception):
  """The expression is not a plain arithmetic expression over integer literals."""


def _value(node: ast.AST, used: list[int]) -> Fraction:
  if isinstance(node, ast.Expression):
    return _value(node.body, used)
  if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is not an int here
    used.append(node.value)
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    left, right = _value(node.left, used), _value(node.right, used)
    if isinstance(node.op, ast.Div) and right == 0:
      raise _Rejected("division by zero")
    return _OPS[type(node.op)](left, right)
  raise _Rejected(f"{type(node).__name__} is not allowed")


def evaluate(expr: str) -> tuple[Fraction, list[int]] | None:
  """(exact value, integer literals in order) of an arithmetic expression, or None when it
  is not one (syntax, a disallowed node, division by zero, too long)."""
  for old, new in _REPLACE:
    expr = expr.replace(old, new)
  expr = expr.split("=")[0].strip()  # "3*8 = 24": the left side is the expression
  if not expr or len(expr) > MAX_EXPR_LEN:
    return None
  try:
    tree = ast.parse(expr, mode="eval")
    used: list[int] = []
    return _value(tree, used), used
  except (SyntaxError, ValueError, _Rejected, RecursionError):
    return None


def check_expression(expr: str, numbers: list[int], target: int) -> bool:
  """Whether ``expr`` equals ``target`` and uses each of ``numbers`` at most once."""
  got = evaluate(expr)
  if got is None:
    return False
  value, used = got
  return value == target and not collections.Counter(used) - collections.Counter(numbers)


def is_correct(completion: str, gold: str) -> bool:
  """The checker (``reward.correct="countdown"``): the final answer solves the question."""
  numbers, target = parse_gold(gold)
  expr, _ = extract_answer(completion)
  return expr is not None and check_expression(expr, numbers, target)


def _question(
  rng: random.Random, min_numbers: int, max_numbers: int, max_number: int, max_target: int
) -> tuple[list[int], int]:
  """Numbers and a target that combining all of them in a random order reaches."""
  while True:
    numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
    pool = [Fraction(n) for n in numbers]
    while len(pool) > 1:
      a, b = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
      op = rng.choice("+-*/")
      if op == "-" and a < b:
        a, b = b, a
      if op == "/" and (b == 0 or a % b):
        op = "+"
      pool.append({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op])
    target = pool[0]
    if target.denominator == 1 and 1 <= target <= max_target and target not in numbers:
      return numbers, int(target)


PROMPT = (
  "Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
  "You may use +, -, *, / and parentheses, and each number at most once. "
  "Put the final expression in \\boxed{{}}."
)


def examples(
  n: int = 5000,
  seed: int = 0,
  *,
  min_numbers: int = 3,
  max_numbers: int = 4,
  max_number: int = 25,
  max_target: int = 200,
) -> list[Example]:
  """``n`` generated questions; question i depends only on (seed, i), so a longer list
  starts with the shorter one."""
  out = []
  for i in range(n):
    rng = random.Random(f"countdown:{seed}:{i}")  # str seeds hash with SHA-512: stable
    numbers, target = _question(rng, min_numbers, max_numbers, max_number, max_target)
    out.append(
      Example(
        id=f"countdown/{i}",
        problem=PROMPT.format(numbers=", ".join(map(str, numbers)), target=target),
        answer=format_gold(numbers, target),
        meta={"numbers": numbers, "target": target},
      )
    )
  return out


def write_jsonl(path: str, rows: list[Example]) -> None:
  """The questions as a JSONL file that ``load_examples`` reads back unchanged."""
  with open(path, "w", encoding="utf-8") as f:
    for e in rows:
      f.write(json.dumps({"id": e.id, "problem": e.problem, "answer": e.answer, **e.meta}) + "\n")
