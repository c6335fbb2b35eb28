"""Rewards from the config: plug-in reward functions, checkers of ``correct``, DAPO's
overlong penalty.

Every sample has two grades (docs/rewards.md):

* ``correct`` (binary): CAPO's pairs, the noise mask, AUC, accuracy. A *checker* decides
  it: ``"math"`` (``capo_jax.data.rewards``, the default), ``"countdown"``
  (``capo_jax.data.countdown``) or a plug-in ``fn(completion, gold) -> bool``.
* ``reward`` (scalar): the advantage input of GRPO, Dr.GRPO, GSPO, CoDaPO, CDE, SimKO.
  Without plug-ins it is ``correct``; with ``reward.fns`` it is
  ``sum_k w_k f_k(completions, examples)``, ``"correct"`` naming the binary label as one
  of the f_k; the overlong penalty, when on, is added to either.

A plug-in is named ``package.module:function`` or ``path/to/file.py:function``. It runs in
worker processes of a ``DeadlinePool`` (the math grader's pool class), so a function that
hangs is killed, with its worker's process group, at ``reward.timeout_s`` and counted (a
reward function's rows score 0 for it and count in ``fn_timeout``; a checker's row is wrong
and counts in ``timeout``). Workers are replaced after ``reward.worker_max_calls`` calls or
above ``reward.worker_max_rss_mb`` MiB resident, so a leaking plug-in cannot grow them
without bound.

Reward functions are called once per question with its G completions and G (equal)
examples: ``f(completions: list[str], examples: list[Example]) -> Sequence[float]``, and
must return a list, tuple or 1-D numpy array of G real numbers (int, float, bool or numpy
scalars of those kinds), each finite in float32. A checker must return a bool or numpy bool
(``1`` and ``1.0`` are not bools). Anything else, or a raise, stops the run with a
``RewardFnError`` that names the function, the row and what it returned.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import importlib.util
import numbers
import os
import re
import reprlib
import threading
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from capo_jax.data import rewards
from capo_jax.data._grader_pool import ERROR, OK, TIMEOUT, DeadlinePool
from capo_jax.data.datasets import REGISTRY
from capo_jax.data.rows import Example

CHECKERS = {"math": None, "countdown": "capo_jax.data.countdown:is_correct"}
CORRECT = "correct"  # in reward.fns: the binary label itself, weighted like any f_k


FLOAT32_MAX = float(np.finfo(np.float32).max)
# Worker limits when the config gives none (the eval CLI's checkers): configs/common.py's.
DEFAULT_MAX_CALLS = 1000
DEFAULT_MAX_RSS_MB = 2048.0


class RewardFnError(RuntimeError):
  """A plug-in raised or returned something other than what docs/rewards.md asks for."""


# -- naming and loading plug-ins ------------------------------------------------------------


def target_of(name: str) -> str:
  """``module:fn`` as given; ``file.py:fn`` with the file made absolute (workers and the
  parent agree whatever their working directory). ValueError when malformed."""
  where, sep, attr = name.strip().rpartition(":")
  if not sep or not where or not attr.isidentifier():
    raise ValueError(f"{name!r} is not 'package.module:function' or 'path/to/file.py:function'")
  if where.endswith(".py") or os.sep in where:
    return f"{os.path.abspath(where)}:{attr}"
  return f"{where}:{attr}"


@functools.lru_cache(maxsize=None)
def load(target: str) -> Callable[..., Any]:
  """The function a target names (imports the module or executes the file once)."""
  where, _, attr = target.rpartition(":")
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise FileNotFoundError(f"{target}: no such file {where}")
    spec = importlib.util.spec_from_file_location(f"capo_reward_plugin_{abs(hash(where))}", where)
    if spec is None or spec.loader is None:
      raise ImportError(f"{target}: {where} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(where)
  fn = getattr(module, attr, None)
  if not callable(fn):
    raise AttributeError(f"{target}: {where} has no function {attr!r}")
  return fn


def checker_name(correct: str, train: str) -> str:
  """``reward.correct`` resolved: "auto" takes the checker of the training dataset's
  registry entry (math for files and the math datasets)."""
  if correct != "auto":
    return correct
  return REGISTRY[train].checker if train in REGISTRY else "math"


def benchmark_checker(name: str) -> str:
  """The checker of an evaluation benchmark: its registry entry's, else math."""
  return REGISTRY[name].checker if name in REGISTRY else "math"


# -- the worker side ------------------------------------------------------------------------


def _first_failing_row(
  fn: Callable[..., Any], completions: list[str], examples: list[Example]
) -> int | None:
  for i, (c, e) in enumerate(zip(completions, examples)):
    try:
      fn([c], [e])
    except Exception:  # noqa: BLE001 -- locating the row that raised
      return i
  return None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def _short(value: Any) -> str:
  """Type and repr of a plug-in's output, truncated (it may be huge), on one line."""
  return f"{type(value).__name__} " + re.sub(r"\s*\n\s*", " ", _REPR.repr(value))


def _is_real(v: Any) -> bool:
  """int, float, bool, Fraction, numpy integer / floating / bool scalars; not complex, str,
  containers, 0-d arrays."""
  return isinstance(v, (numbers.Real, np.bool_))


def _reward_problem(out: Any, n: int) -> tuple[int | None, str] | None:
  """None when `out` is n real numbers finite in float32, else (row or None, message)."""
  if isinstance(out, np.ndarray):
    if out.ndim != 1 or out.dtype.kind not in "biuf":
      shape = f"shape {out.shape}, dtype {out.dtype}"
      return None, f"returned {_short(out)} ({shape}), not a 1-D array of real numbers"
  elif not isinstance(out, (list, tuple)):
    return None, f"returned {_short(out)}, not a list, tuple or 1-D numpy array of numbers"
  if len(out) != n:
    return None, f"returned {len(out)} values for {n} completions: {_short(out)}"
  for i, v in enumerate(out):
    if not _is_real(v):
      return i, f"returned {_short(v)}, not a real number, in {_short(out)}"
    # Compared before float(): a huge int would overflow it.
    if not abs(v) <= FLOAT32_MAX:  # False for NaN too
      limit = f"|v| <= {FLOAT32_MAX:.4g}"
      return i, f"returned {_REPR.repr(v)}, not finite in float32 ({limit}), in {_short(out)}"
  return None


def _call(kind: str, target: str, *args: Any) -> tuple:
  """Runs one plug-in call in a worker: ("ok", value) or (problem, row or None, message)."""
  fn = load(target)
  if kind == "check":
    completion, gold = args
    try:
      verdict = fn(completion, gold)
    except Exception as e:  # noqa: BLE001 -- reported with the row by the parent
      return "raised", 0, f"{type(e).__name__}: {e}"[:500]
    if not isinstance(verdict, (bool, np.bool_)):  # 0, 1 and 1.0 are not verdicts
      return "bad", 0, f"returned {_short(verdict)}, not a bool"
    return "ok", bool(verdict)
  completions, examples = list(args[0]), list(args[1])
  try:
    out = fn(completions, examples)
  except Exception as e:  # noqa: BLE001
    return (
      "raised",
      _first_failing_row(fn, completions, examples),
      f"{type(e).__name__}: {e}"[:500],
    )
  problem = _reward_problem(out, len(completions))
  return ("bad", *problem) if problem else ("ok", [float(v) for v in out])


# -- the pool -------------------------------------------------------------------------------

_pools: dict[tuple[float, int, float], DeadlinePool] = {}
_pools_lock = threading.Lock()


def _workers() -> int:
  n = os.environ.get("CAPO_GRADER_WORKERS")
  return (
    int(n)
    if n
    else len(os.sched_getaffinity(0))
    if hasattr(os, "sched_getaffinity")
    else (os.cpu_count() or 1)
  )


def pool(
  timeout_s: float, max_calls: int = DEFAULT_MAX_CALLS, max_rss_mb: float = DEFAULT_MAX_RSS_MB
) -> DeadlinePool:
  """The shared plug-in pool with this per-call deadline and these worker limits (calls and
  resident MiB before a worker is replaced; 0: none), of $CAPO_GRADER_WORKERS workers."""
  key = (float(timeout_s), int(max_calls), float(max_rss_mb))
  with _pools_lock:
    if key not in _pools:
      _pools[key] = DeadlinePool(
        f"{__name__}:_call", _workers(), key[0], max_calls=key[1], max_rss_mb=key[2]
      )
      atexit.register(_pools[key].close)
    return _pools[key]


def _raise(what: str, rows: range, problem: str, row: int | None, message: str) -> None:
  where = (
    f"row {rows[row]}"
    if row is not None
    else f"rows {rows.start}-{rows.stop - 1}"
    if len(rows) > 1
    else f"row {rows.start}"
  )
  verb = "raised" if problem == "raised" else "returned a bad value:"
  raise RewardFnError(
    f"{what} on {where}: {message}" if problem == "bad" else f"{what} {verb} {message} on {where}"
  )


# -- checkers of `correct` ------------------------------------------------------------------


class CheckerGrader:
  """A plug-in checker with the grader interface: ``score(completions, golds) -> (0/1
  float32 rewards, RewardHealth)``; one pool call per completion."""

  def __init__(
    self,
    name: str,
    timeout_s: float,
    max_calls: int = DEFAULT_MAX_CALLS,
    max_rss_mb: float = DEFAULT_MAX_RSS_MB,
  ) -> None:
    self.name = name
    self.target = target_of(CHECKERS.get(name) or name)
    load(self.target)  # a typo fails here, not in every worker
    self.limits = (timeout_s, max_calls, max_rss_mb)  # pool()'s arguments
    self.cumulative = rewards.RewardHealth()

  def score(
    self, completions: Sequence[str], golds: Sequence[str]
  ) -> tuple[np.ndarray, rewards.RewardHealth]:
    if len(completions) != len(golds):
      raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
    out = pool(*self.limits).map([("check", self.target, c, g) for c, g in zip(completions, golds)])
    correct = np.zeros(len(out), np.float32)
    timeouts = 0
    for i, (kind, value) in enumerate(out):
      what = f"checker {self.name} (reward.correct)"
      if kind == TIMEOUT:
        timeouts += 1
      elif kind == ERROR:
        _raise(what, range(i, i + 1), "raised", None, value)
      elif value[0] != "ok":
        _raise(what, range(i, i + 1), *value)
      else:
        correct[i] = value[1]
    health = rewards.RewardHealth(total=len(out), correct=int(correct.sum()), timeout=timeouts)
    self.cumulative = self.cumulative + health
    return correct, health


_graders: dict[tuple[str, float, int, float], Any] = {}


def grader_for(
  checker: str,
  timeout_s: float = 5.0,
  max_calls: int = DEFAULT_MAX_CALLS,
  max_rss_mb: float = DEFAULT_MAX_RSS_MB,
) -> Any:
  """The grader deciding ``correct``: the shared math grader for "math", else one
  ``CheckerGrader`` per (checker, worker limits)."""
  if checker == "math":
    return rewards.default_grader()
  key = (checker, float(timeout_s), int(max_calls), float(max_rss_mb))
  if key not in _graders:
    _graders[key] = CheckerGrader(*key)
  return _graders[key]


# -- the scalar reward ----------------------------------------------------------------------


def overlong_penalty(lengths_B: np.ndarray, max_len: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong penalty on L generated tokens: 0 for L <= max_len - buffer,
  (max_len - buffer - L) / buffer up to max_len, -1 beyond (float32)."""
  if buffer <= 0 or buffer > max_len:
    raise ValueError(f"overlong_penalty: buffer={buffer} must be in [1, max_len={max_len}]")
  L = np.asarray(lengths_B, np.float64)
  soft = (max_len - buffer - L) / buffer
  return np.where(L <= max_len - buffer, 0.0, np.where(L <= max_len, soft, -1.0)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RewardFns:
  """reward = (sum_k weights[k] * fns[k], or ``correct`` without fns) + overlong penalty.

  Attributes:
    fns: plug-in names (``module:fn`` / ``file.py:fn``) or ``"correct"``.
    weights: one per fn.
    timeout_s: each call's deadline (one call per question).
    max_len, overlong_buffer: the overlong penalty's L_max and L_b (0: off).
    worker_max_calls, worker_max_rss_mb: a worker is replaced after this many calls or
      above this resident memory in MiB (0: no limit).
  """

  fns: tuple[str, ...] = ()
  weights: tuple[float, ...] = ()
  timeout_s: float = 5.0
  max_len: int = 0
  overlong_buffer: int = 0
  worker_max_calls: int = DEFAULT_MAX_CALLS
  worker_max_rss_mb: float = DEFAULT_MAX_RSS_MB

  def __post_init__(self) -> None:
    if len(self.weights) != len(self.fns):
      raise ValueError(f"{len(self.fns)} reward fns but {len(self.weights)} weights")

  def __call__(
    self,
    completions: Sequence[str],
    examples: Sequence[Example],
    correct_B: np.ndarray,
    lengths_B: np.ndarray,
  ) -> tuple[np.ndarray, dict[str, int]]:
    """(reward float32 [B], {"fn_timeout": rows whose call timed out, summed over fns})."""
    n = len(completions)
    if not len(examples) == len(correct_B) == len(lengths_B) == n:
      raise ValueError(
        f"{n} completions, {len(examples)} examples, {len(correct_B)} labels, "
        f"{len(lengths_B)} lengths"
      )
    # One call per question: runs of rows that share their example.
    starts = [i for i in range(n) if i == 0 or examples[i] is not examples[i - 1]] + [n]
    groups = [range(a, b) for a, b in zip(starts, starts[1:])]
    reward_B = np.zeros(n, np.float64) if self.fns else np.asarray(correct_B, np.float64)
    timeouts = 0
    for k, (name, w) in enumerate(zip(self.fns, self.weights)):
      if name == CORRECT:
        reward_B += w * np.asarray(correct_B, np.float64)
        continue
      target = target_of(name)
      workers = pool(self.timeout_s, self.worker_max_calls, self.worker_max_rss_mb)
      out = workers.map(
        [("fn", target, [completions[i] for i in g], [examples[i] for i in g]) for g in groups]
      )
      what = f"reward function {name} (reward.fns[{k}])"
      for g, (kind, value) in zip(groups, out):
        if kind == TIMEOUT:
          timeouts += len(g)
        elif kind == ERROR:
          _raise(what, g, "raised", None, value)
        elif value[0] != OK:
          _raise(what, g, *value)
        else:
          reward_B[g.start : g.stop] += w * np.asarray(value[1], np.float64)
    if self.overlong_buffer:
      reward_B += overlong_penalty(lengths_B, self.max_len, self.overlong_buffer)
    # Each value is finite in float32, but weights can push a sum past it.
    over = np.flatnonzero(~(np.abs(reward_B) <= FLOAT32_MAX))
    if over.size:
      raise RewardFnError(
        f"the weighted sum of reward.fns={self.fns} with reward.weights="
        f"{self.weights} is {float(reward_B[over[0]])!r} on row {over[0]}, not "
        f"finite in float32: lower the weights"
      )
    return reward_B.astype(np.float32), {"fn_timeout": timeouts}


def grade(
  grader: Any,
  reward_fns: RewardFns | None,
  completions: Sequence[str],
  examples: Sequence[Example],
  lengths_B: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
  """(correct, reward, health counts) of a batch: the grader decides ``correct``; the
  reward is ``correct`` itself (the same array) unless ``reward_fns`` is given."""
  correct_B, health = grader.score(completions, [e.answer for e in examples])
  counts = health.as_dict()
  if reward_fns is None:
    return correct_B, correct_B, counts
  reward_B, fn_counts = reward_fns(completions, examples, np.asarray(correct_B), lengths_B)
  return correct_B, reward_B, {**counts, **fn_counts}
