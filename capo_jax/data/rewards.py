"""Math rewards: answer equivalence and safe, parallel scoring.

A completion is correct when its final answer (the last ``\\boxed{...}`` or ``\\fbox{...}``)
is mathematically equivalent to the gold answer. Equivalence is decided in two stages:

1. a cheap fast path in the calling process: the two answers are equal after normalisation
   (``$``, ``\\dfrac``, spaces, ``\\left``, degrees, percent, thousands separators, trailing
   ``\\text{}`` units), or both are plain numbers (integers, decimals, simple fractions) and are
   compared exactly ("007" == "7", "-12" != "12");
2. otherwise math-verify (``parse`` / ``verify``) with its signal-based timeouts turned off,
   run in worker processes that the parent kills past a per-item deadline (``_grader_pool``).
   A timed-out item is incorrect and counted in ``RewardHealth.timeout``.

The final answer is found by `capo_jax.data.answers` (the last box, else a fallback phrase).
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import logging
import os
import re
import threading
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from capo_jax.data._grader_pool import OK as _POOL_OK
from capo_jax.data._grader_pool import TIMEOUT as _POOL_TIMEOUT
from capo_jax.data._grader_pool import DeadlinePool

# extract_boxed is also reached here as `rewards.extract_boxed` (demo/, benchmarks/rewards.py).
from capo_jax.data.answers import extract_answer, extract_boxed  # noqa: F401

logger = logging.getLogger(__name__)

# Answers longer than this skip the fast path (its regexes stay cheap in the parent process).
_MAX_FAST_LEN = 1000


class Status(enum.IntEnum):
  """Why an item scored as it did (one per item; a correct item is OK or NO_BOX)."""

  OK = 0
  NO_BOX = 1  # no closed box: a fallback phrase was graded, or nothing was found
  PARSE_FAILURE = 2  # empty/unclosed box, or math-verify could not read the answer
  TIMEOUT = 3
  EXCEPTION = 4


@dataclasses.dataclass
class RewardHealth:
  """Counts over scored items; add them up across batches with ``+``."""

  total: int = 0
  correct: int = 0
  no_box: int = 0
  parse_failure: int = 0
  timeout: int = 0
  exception: int = 0

  @classmethod
  def from_arrays(cls, rewards: np.ndarray, statuses: np.ndarray) -> RewardHealth:
    counts = np.bincount(statuses.astype(np.int64), minlength=len(Status))
    return cls(
      total=int(rewards.size),
      correct=int((rewards > 0).sum()),
      no_box=int(counts[Status.NO_BOX]),
      parse_failure=int(counts[Status.PARSE_FAILURE]),
      timeout=int(counts[Status.TIMEOUT]),
      exception=int(counts[Status.EXCEPTION]),
    )

  def __add__(self, other: RewardHealth) -> RewardHealth:
    return RewardHealth(
      **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
    )

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


# -- normalisation and the fast path ----------------------------------------------------------

_SCI_RE = re.compile(r"([+-]?\d+(?:\.\d*)?)[eE]([+-]?\d+)")
_TRAILING_UNIT_RE = re.compile(r"(?<=\S)\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?$")
_WRAPPED_TEXT_RE = re.compile(r"^\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}$")
_INT_RE = re.compile(r"[+-]?\d+")
_DEC_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC_RE = re.compile(r"([+-]?)\\frac(\d|\{\d+\})(\d|\{\d+\})")
_SLASH_RE = re.compile(r"([+-]?\d+)/(\d+)")


def clean_answer(s: str) -> str:
  """Light normalisation that keeps the meaning; what math-verify is given."""
  s = s.strip().replace("\\$", "").replace("$", "")
  s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
  s = s.replace("\\!", "").replace("\\displaystyle", "")
  s = re.sub(r"\bnp\.([a-z]+)", r"\\\1", s)  # Minerva golds in numpy notation
  s = re.sub(r"(\d)\.(?!\d)", r"\1", s)  # "-1./3", "5."
  s = s.strip().rstrip(".").strip()
  m = _SCI_RE.fullmatch(s)  # whole-string code notation only: "3e^{2t}" is not 3*10^2
  if m:
    s = f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
  return s


@functools.lru_cache(maxsize=16384)
def _key(s: str) -> str:
  """Aggressive canonical form for the exact-match fast path."""
  s = clean_answer(s)
  s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
  s = re.sub(r"\\[,;: ]|~|\s+", "", s)
  s = re.sub(r"\^\{?\\circ\}?|°|\\degree(?![a-zA-Z])", "", s)
  s = s.replace("\\%", "").replace("%", "")
  s = _TRAILING_UNIT_RE.sub("", s)
  m = _WRAPPED_TEXT_RE.match(s)
  return m.group(1) if m else s


def _as_number(key: str) -> tuple[Fraction, bool] | None:
  """(value, exact) for integers, simple fractions (exact) and decimals (not exact)."""
  if _INT_RE.fullmatch(key):
    return Fraction(int(key)), True
  if _DEC_RE.fullmatch(key):
    return Fraction(key), False
  if _THOUSANDS_RE.fullmatch(key):
    plain = key.replace(",", "")
    return Fraction(plain), "." not in plain
  m = _FRAC_RE.fullmatch(key) or _SLASH_RE.fullmatch(key)
  if m:
    parts = [g.strip("{}") for g in m.groups()]
    num, den = (
      (int(parts[0] + parts[1]), int(parts[2]))
      if len(parts) == 3
      else (int(parts[0]), int(parts[1]))
    )
    return (Fraction(num, den), True) if den else None
  return None


def _fast_equal(pred: str, gold: str) -> bool | None:
  """True/False when decided cheaply, None when math-verify must decide."""
  kp, kg = _key(pred), _key(gold)
  if kp and kp == kg:
    return True
  np_, ng = _as_number(kp), _as_number(kg)
  if np_ is not None and ng is not None:
    if np_[0] == ng[0]:
      return True
    # Exact unequal rationals differ; decimals may be roundings and percents may be scaled.
    if np_[1] and ng[1] and "%" not in pred + gold:
      return False
  return None


def _prepare(completion: str, gold: str) -> tuple[bool | None, Status, str]:
  """Extraction + fast path: (verdict or None if math-verify is needed, status, answer)."""
  pred, has_box = extract_answer(completion)
  status = Status.OK if has_box else Status.NO_BOX
  if not pred:
    return False, status if not has_box else Status.PARSE_FAILURE, ""
  if len(pred) > _MAX_FAST_LEN or len(gold) > _MAX_FAST_LEN:
    return None, status, pred
  return _fast_equal(pred, gold), status, pred


# -- math-verify stage (runs in worker processes) ---------------------------------------------


@functools.lru_cache(maxsize=1)
def _mv() -> tuple[Any, list]:
  import math_verify  # noqa: PLC0415 -- heavy (sympy, antlr); only workers need it

  # Its timeouts are disabled on purpose (the pool enforces deadlines); silence the warning.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  cfg = [
    math_verify.LatexExtractionConfig(boxed_match_priority=0),
    math_verify.ExprExtractionConfig(),
  ]
  return math_verify, cfg


def _mv_parse(s: str) -> list:
  mv, cfg = _mv()
  return mv.parse("\\boxed{" + s + "}", extraction_config=cfg, parsing_timeout=None)


_mv_parse_gold = functools.lru_cache(maxsize=8192)(_mv_parse)


def _warmup() -> None:
  _mv()
  _slow_judge("\\frac{1}{2}", "0.5", int(Status.OK))


def _slow_judge(pred: str, gold: str, status: int) -> tuple[bool, int]:
  """math-verify equivalence of two extracted answers; returns (correct, status)."""
  mv, _ = _mv()
  gold_p = _mv_parse_gold(clean_answer(gold))
  pred_p = _mv_parse(clean_answer(pred))
  failed = False
  for g in gold_p:  # verify() would stop at the first pair that raises; try every pair
    for t in pred_p:
      try:
        if mv.verify(g, t, timeout_seconds=None, allow_set_relation_comp=True, raise_on_error=True):
          return True, status
      except Exception:  # noqa: BLE001 -- a sympy failure on one pair; counted below
        failed = True
  if failed:
    return False, int(Status.EXCEPTION)
  if status == Status.OK and all(isinstance(t, str) for t in pred_p):
    return False, int(Status.PARSE_FAILURE)
  return False, status


# -- public API -------------------------------------------------------------------------------


def _check(completions: Sequence[str], golds: Sequence[str]) -> None:
  if len(completions) != len(golds):
    raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
  for name, seq in (("completions", completions), ("golds", golds)):
    for i, s in enumerate(seq):
      if not isinstance(s, str):
        raise TypeError(f"{name}[{i}] is {type(s).__name__}, expected str")


def score_serial(
  completions: Sequence[str], golds: Sequence[str]
) -> tuple[np.ndarray, RewardHealth]:
  """Scores in this process, with NO time limit; for tests, benchmarks and trusted input."""
  _check(completions, golds)
  rewards = np.zeros(len(completions), np.float32)
  statuses = np.zeros(len(completions), np.int8)
  for i, (c, g) in enumerate(zip(completions, golds)):
    status: int  # a Status; _slow_judge gives its int (grader workers send it through a pipe)
    try:
      verdict, status, pred = _prepare(c, g)
      if verdict is None:
        verdict, status = _slow_judge(pred, g, int(status))
    except Exception:  # noqa: BLE001 -- one bad item must not lose the batch
      logger.exception("reward: scoring item %d failed", i)
      verdict, status = False, Status.EXCEPTION
    rewards[i], statuses[i] = verdict, status
  return rewards, RewardHealth.from_arrays(rewards, statuses)


class Grader:
  """Scores completions with math-verify in `num_workers` processes, `timeout_s` per item.

  Safe to call from any thread. Workers start on first use (a one-time cost; the benchmark
  table of docs/benchmarks.md has it) and are reused; call `close()` (or use as a context
  manager) to stop them.
  """

  def __init__(
    self, num_workers: int | None = None, timeout_s: float = 5.0, *, max_rss_mb: float = 2048.0
  ) -> None:
    if num_workers is None:
      num_workers = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
      )
    # sympy's caches grow with every expression a long run grades: a worker above
    # max_rss_mb (0: no ceiling) is replaced, as the plug-ins' workers are.
    self._pool = DeadlinePool(
      f"{__name__}:_slow_judge",
      num_workers,
      timeout_s,
      warmup=f"{__name__}:_warmup",
      max_rss_mb=max_rss_mb,
    )
    self.cumulative = RewardHealth()

  @property
  def num_restarts(self) -> int:
    """Workers killed and replaced so far (hung past the deadline, or crashed)."""
    return self._pool.num_restarts

  def score(
    self, completions: Sequence[str], golds: Sequence[str]
  ) -> tuple[np.ndarray, RewardHealth]:
    """Returns (rewards float32 [n] of 0/1, health counters of this batch)."""
    _check(completions, golds)
    rewards = np.zeros(len(completions), np.float32)
    statuses = np.zeros(len(completions), np.int8)
    slow_idx, slow_items = [], []
    for i, (c, g) in enumerate(zip(completions, golds)):
      try:
        verdict, status, pred = _prepare(c, g)
      except Exception:  # noqa: BLE001 -- one bad item must not lose the batch
        logger.exception("reward: scoring item %d failed", i)
        verdict, status, pred = False, Status.EXCEPTION, ""
      if verdict is None:
        slow_idx.append(i)
        slow_items.append((pred, g, int(status)))
      else:
        rewards[i], statuses[i] = verdict, status
    for i, (kind, value) in zip(slow_idx, self._pool.map(slow_items)):
      if kind == _POOL_OK:
        rewards[i], statuses[i] = value
      else:
        statuses[i] = Status.TIMEOUT if kind == _POOL_TIMEOUT else Status.EXCEPTION
        if kind != _POOL_TIMEOUT:
          logger.warning("reward: item %d raised in a grader worker: %s", i, value)
    health = RewardHealth.from_arrays(rewards, statuses)
    if health.timeout:
      logger.warning(
        "reward: %d of %d items timed out (%.1f s each) and scored 0",
        health.timeout,
        health.total,
        self._pool.timeout_s,
      )
    self.cumulative = self.cumulative + health
    return rewards, health

  def close(self) -> None:
    self._pool.close()

  def __enter__(self) -> Grader:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


_default: Grader | None = None
_default_lock = threading.Lock()


def default_grader() -> Grader:
  """The shared grader; workers from $CAPO_GRADER_WORKERS (default: all cores), timeout from
  $CAPO_GRADER_TIMEOUT_S (default 5)."""
  global _default
  with _default_lock:
    if _default is None:
      workers = os.environ.get("CAPO_GRADER_WORKERS")
      _default = Grader(
        int(workers) if workers else None, float(os.environ.get("CAPO_GRADER_TIMEOUT_S", "5"))
      )
      atexit.register(_default.close)
    return _default


def score(completions: Sequence[str], golds: Sequence[str]) -> np.ndarray:
  """Rewards (float32, 0 or 1) from the shared grader; its health is in
  ``default_grader().cumulative``, or use ``Grader.score`` for per-batch counters."""
  return default_grader().score(completions, golds)[0]


def is_correct(completion: str, gold: str) -> bool:
  """Whether the completion's final answer equals `gold` (math-verify runs in the pool)."""
  verdict, _, _ = _prepare(completion, gold)
  if verdict is not None:
    return verdict
  return bool(score([completion], [gold])[0] > 0)
