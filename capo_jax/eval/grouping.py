"""Answer equivalence classes of one question's samples, checked within a time budget.

maj@k, PC and RPC count a question's answers by class. Each distinct answer, in order of
first appearance, is compared with the first member of each class found so far and joins
the first that matches, else starts a class; identical strings share a class unchecked.

A pair is checked by ``PairCheck.fast`` in this process (string equality, a caller's
callable, the math grader's cheap path) or, when that cannot decide, by ``PairCheck.slow``
in the worker processes of a ``DeadlinePool`` (math-verify for the default "rewards"),
where a hung check can be killed. A question's undecided pairs run there in parallel, in
waves of one pair per worker, most urgent first (the pair the comparison waits on, then
those it may consult after it), each within ``Limits.pair_timeout_s`` (at most the
budget). No wave starts once ``Limits.budget_s`` has passed since the question began, so
a question takes at most about the budget plus one pair timeout and one worker restart.
A pair that timed out or that the budget cut off counts as "different answers" and is
counted (``Grouped.n_unresolved``). When nothing times out the classes are exactly those
of the one-pair-at-a-time comparison.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Pair = tuple[int, int]  # (index of a class's first member, index of the answer compared)


@dataclasses.dataclass(frozen=True)
class PairCheck:
  """How two answers are compared.

  fast(first_member, answer): True / False when decided in this process, else a tuple of
    arguments for ``slow``.
  slow: "module:function" run in worker processes (importable in a fresh interpreter); its
    result, or a tuple result's first element, is the verdict.
  warmup: "module:function" a worker runs once before its first pair (slow imports).
  """

  fast: Callable[[str, str], bool | tuple]
  slow: str | None = None
  warmup: str | None = None


@dataclasses.dataclass(frozen=True)
class Limits:
  """Time limits of the slow checks (see the module docstring)."""

  budget_s: float = 30.0  # per question
  pair_timeout_s: float = 5.0
  # 0: one per core, at most 8 (a question has at most 120 pairs of 16 answers; every
  # worker holds its own sympy, beside the reward grader's pool).
  num_workers: int = 0

  def __post_init__(self) -> None:
    for name in ("budget_s", "pair_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"grouping Limits.{name} must be > 0, got {getattr(self, name)}")
    if self.num_workers < 0:
      raise ValueError(f"grouping Limits.num_workers must be >= 0, got {self.num_workers}")


@dataclasses.dataclass(frozen=True)
class Grouped:
  """Class id per answer (-1: no answer) and the pairs counted "different" unchecked."""

  group_G: np.ndarray
  n_unresolved: int


def _rewards_fast(first: str, answer: str) -> bool | tuple:
  # Exactly rewards.is_correct("\\boxed{first}", answer), with its math-verify stage left
  # to the worker pool: the grader's cheap path here, else _slow_judge's arguments.
  from capo_jax.data.rewards import _prepare  # pylint: disable=import-outside-toplevel

  verdict, status, pred = _prepare("\\boxed{" + first + "}", answer)
  return bool(verdict) if verdict is not None else (pred, answer, int(status))


REWARDS_CHECK = PairCheck(
  _rewards_fast, "capo_jax.data.rewards:_slow_judge", "capo_jax.data.rewards:_warmup"
)


def resolve_check(grouping: str | Callable[[str, str], bool] | PairCheck) -> PairCheck:
  """``"rewards"`` (the math grader), ``"exact"`` (string equality), a callable (run in
  this process, unbounded) or a ``PairCheck``."""
  if isinstance(grouping, PairCheck):
    return grouping
  if callable(grouping):
    return PairCheck(grouping)
  if grouping == "exact":
    return PairCheck(operator.eq)
  if grouping == "rewards":
    return REWARDS_CHECK
  raise ValueError(
    f"grouping must be 'rewards', 'exact', a callable or a PairCheck, got {grouping!r}"
  )


def resolve_same_answer(
  grouping: str | Callable[[str, str], bool] = "rewards",
) -> Callable[[str, str], bool]:
  """Answer equivalence as one callable: a callable, ``"rewards"`` (default) or ``"exact"``.

  ``"rewards"`` imports ``capo_jax.data.rewards`` lazily and grades one answer, boxed,
  against the other with its ``is_correct`` (one pair at a time; ``AnswerGrouper`` bounds
  a question's time); ``"exact"`` (string equality) is only used when asked for.
  """
  if callable(grouping):
    return grouping
  if grouping == "exact":
    return lambda a, b: a == b
  if grouping != "rewards":
    raise ValueError(f"grouping must be 'rewards', 'exact' or a callable, got {grouping!r}")
  from capo_jax.data import rewards  # pylint: disable=import-outside-toplevel

  return lambda a, b: bool(rewards.is_correct("\\boxed{" + a + "}", b))


def _replay(
  n: int, verdict: Callable[[int, int], bool | None]
) -> tuple[list[int], list[int], Pair | None]:
  """The sequential comparison over known verdicts: (class of each answer decided, first
  members, the pair it stopped at for want of a verdict, or None when complete)."""
  cls: list[int] = []
  firsts: list[int] = []
  for j in range(n):
    for i in firsts:
      v = verdict(i, j)
      if v is None:
        return cls, firsts, (i, j)
      if v:
        cls.append(cls[i])
        break
    else:
      cls.append(len(firsts))
      firsts.append(j)
  return cls, firsts, None


class AnswerGrouper:
  """Groups answers with a ``PairCheck``; slow checks run in a pool started on first need
  (``close()`` it, or use as a context manager)."""

  def __init__(
    self,
    grouping: str | Callable[[str, str], bool] | PairCheck = "rewards",
    limits: Limits = Limits(),
  ) -> None:
    self.check = resolve_check(grouping)
    self.limits = limits
    self._pool: Any = None  # a DeadlinePool once a slow check is needed

  def _workers(self) -> int:
    if self.limits.num_workers:
      return self.limits.num_workers
    cores = (
      len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return min(cores, 8)

  def _run(
    self,
    pairs: list[Pair],
    args: dict[Pair, tuple],
    verdicts: dict[Pair, bool],
    unresolved: set[Pair],
  ) -> None:
    if self.check.slow is None:
      raise TypeError(
        f"PairCheck.fast returned {args[pairs[0]]!r} (arguments for a slow "
        "check) but the PairCheck has no slow function"
      )
    # Imported here: the pool's package (capo_jax.data) is not needed without slow checks.
    from capo_jax.data import _grader_pool as pool_lib  # pylint: disable=import-outside-toplevel

    if self._pool is None:
      # A pair can use no more than the whole budget.
      timeout_s = min(self.limits.pair_timeout_s, self.limits.budget_s)
      self._pool = pool_lib.DeadlinePool(
        self.check.slow, self._workers(), timeout_s, warmup=self.check.warmup
      )
    for pair, (kind, value) in zip(pairs, self._pool.map([args[p] for p in pairs])):
      if kind == pool_lib.OK:
        verdicts[pair] = bool(value[0] if isinstance(value, (tuple, list)) else value)
        continue
      verdicts[pair] = False
      if kind == pool_lib.TIMEOUT:
        unresolved.add(pair)
      else:  # the check raised: "different", as the grader scores a raising item 0
        log.warning("grouping: checking an answer pair raised in a worker: %s", value)

  def group(self, answers: Sequence[str | None]) -> Grouped:
    """Class ids of one question's answers (see the module docstring)."""
    start = time.monotonic()
    uniq = list(dict.fromkeys(a for a in answers if a is not None))
    verdicts: dict[Pair, bool] = {}
    args: dict[Pair, tuple] = {}  # pairs the fast check left to the slow one
    unresolved: set[Pair] = set()

    def verdict(i: int, j: int) -> bool | None:
      if (i, j) not in verdicts and (i, j) not in args:
        v = self.check.fast(uniq[i], uniq[j])
        if isinstance(v, tuple):
          args[i, j] = v
        else:
          verdicts[i, j] = bool(v)
      return verdicts.get((i, j))

    def pending(firsts: list[int], stop: Pair) -> Iterator[Pair]:
      # Undecided pairs the comparison may consult, in the order it would: answers from
      # the one it stopped at on, against the decided first members and the undecided
      # answers before them (each may still start a class).
      for j in range(stop[1], len(uniq)):
        for i in firsts + list(range(stop[1], j)):
          if verdict(i, j) is None:
            yield i, j

    while True:
      cls, firsts, stop = _replay(len(uniq), verdict)
      if stop is None:
        break
      if time.monotonic() - start >= self.limits.budget_s:
        verdicts[stop] = False  # cut by the budget
        unresolved.add(stop)
        continue
      wave = []
      for pair in pending(firsts, stop):
        wave.append(pair)
        if len(wave) == self._workers():
          break
      self._run(wave, args, verdicts, unresolved)
    consulted: set[Pair] = set()

    def consult(i: int, j: int) -> bool:
      consulted.add((i, j))
      return verdicts[i, j]

    _replay(len(uniq), consult)
    index = {a: u for u, a in enumerate(uniq)}
    group_G = np.array([-1 if a is None else cls[index[a]] for a in answers], dtype=np.int64)
    return Grouped(group_G, len(consulted & unresolved))

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None

  def __enter__(self) -> AnswerGrouper:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def group_answers(
  answers: Sequence[str | None], same_answer: Callable[[str, str], bool]
) -> np.ndarray:
  """Class ids of one question's answers (-1 for None), ``same_answer`` called in this
  process one pair at a time, without a time limit."""
  return AnswerGrouper(same_answer).group(answers).group_G
